"""The Hugging Face source (ferrum/weights/hub/fetch.py) against a real Hub API on loopback: olah in offline
mode serving git repos built here (tests/hub_mirror.py), with large files as Git LFS pointers.

What olah does differently from the real Hub, and how these tests deal with it:
- a missing repository, file or revision all come back as 401 "repository not found", so the
  not-found tests check that the message names all three and says the missing part may be any;
- it ignores HTTP Range, so `hub_metadata` gets the whole body and must stop reading after the
  header (checked here by it not leaving the file in the cache, not by counting bytes on the wire);
- its etag for an LFS file is the sha256 of the blob it has, so corruption is injected between it
  and the client (a fault proxy) or in the client's cache, where Ferrum's check must catch it.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors import safe_open

from ferrum.weights import HuggingFace, WeightLoaderConfig
from ferrum.weights.errors import IntegrityError, SourceNotFoundError, SourceUnavailableError
from ferrum.weights.hub.fetch import hub_fetch, hub_metadata, hub_snapshot
from tests.fault_server import FaultServer
from tests.hub_mirror import HubMirror, olah_server
from tests.tiny_model import folder_files, make_tiny_llama

REPO = "acme/tiny-llama"


@dataclass(frozen=True)
class Hub:
    endpoint: str
    v1: str  # commit of tag v1 (seed 0 weights)
    main: str  # head of main (seed 1 weights)
    dev: str  # head of branch dev (v1 + another generation_config.json)
    files_v1: dict[str, bytes]
    files_main: dict[str, bytes]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    root = tmp_path_factory.mktemp("hub")
    first = make_tiny_llama(root / "seed0", seed=0)
    second = make_tiny_llama(root / "seed1", seed=1)
    mirror = HubMirror(root)
    repo = mirror.create_repo(REPO)
    repo.put({p.name: p for p in first.iterdir()})
    v1 = repo.commit("tiny llama, seed 0")
    repo.git("tag", "v1")
    repo.git("checkout", "-q", "-b", "dev")
    repo.put({"generation_config.json": b'{"do_sample": false, "max_new_tokens": 7}\n'})
    dev = repo.commit("dev: another generation config")
    repo.git("checkout", "-q", "main")
    repo.put({p.name: p for p in second.iterdir()})
    main = repo.commit("tiny llama, seed 1")
    with olah_server(mirror) as server:
        yield Hub(server.endpoint, v1, main, dev, folder_files(first), folder_files(second))


@pytest.fixture
def config(tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch) -> WeightLoaderConfig:
    """A fresh Hugging Face cache (HF_HOME) and Ferrum cache per test, talking to the mirror."""
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return WeightLoaderConfig(cache_dir=tmp_path / "ferrum", progress="off", max_retries=1)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "revision, expected",
    [
        (None, "main"),
        ("main", "main"),
        ("v1", "v1"),
        ("dev", "dev"),
        ("V1_SHA", "v1"),
        ("V1_SHORT", "v1"),
    ],
)
async def test_fetch_by_branch_tag_and_commit(
    hub: Hub, config: WeightLoaderConfig, tmp_path: Path, revision: str | None, expected: str
) -> None:
    rev = {"V1_SHA": hub.v1, "V1_SHORT": hub.v1[:7]}.get(revision or "", revision)
    commit = {"main": hub.main, "v1": hub.v1, "dev": hub.dev}[expected]
    files = hub.files_main if expected == "main" else hub.files_v1
    weights = await hub_fetch(HuggingFace(REPO, "model.safetensors", rev), config)
    gen = await hub_fetch(HuggingFace(REPO, "generation_config.json", rev), config)
    # huggingface_hub's cache layout under HF_HOME, in the snapshot of the commit the revision names
    snapshot = tmp_path / "hf" / "hub" / "models--acme--tiny-llama" / "snapshots" / commit
    assert weights == snapshot / "model.safetensors" and weights.is_symlink()
    assert weights.read_bytes() == files["model.safetensors"]
    if expected == "dev":
        assert b"max_new_tokens" in gen.read_bytes()
    else:
        assert gen.read_bytes() == files["generation_config.json"]


async def test_offline_mode_uses_the_cache_only(
    hub: Hub, config: WeightLoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = HuggingFace(REPO, "model.safetensors", "v1")
    online = await hub_fetch(source, config)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")  # nothing may be asked
    assert await hub_fetch(source, config) == online
    meta = await hub_metadata(source, config)  # from the cached file's header
    assert "model.embed_tokens.weight" in meta.tensors
    with pytest.raises(SourceNotFoundError) as info:
        await hub_fetch(HuggingFace(REPO, "tokenizer.json", "v1"), config)
    message = str(info.value)
    assert "hf://acme/tiny-llama@v1/tokenizer.json" in message and "HF_HUB_OFFLINE" in message


@pytest.mark.parametrize(
    "repo, filename, revision",
    [
        ("acme/no-such-model", "config.json", None),
        (REPO, "no-such-file.json", "main"),
        (REPO, "config.json", "no-such-branch"),
    ],
)
async def test_not_found_names_repo_file_and_revision(
    config: WeightLoaderConfig, repo: str, filename: str, revision: str | None
) -> None:
    with pytest.raises(SourceNotFoundError) as info:
        await hub_fetch(HuggingFace(repo, filename, revision), config)
    message = str(info.value)
    assert "\n" not in message
    assert repo in message and filename in message and (revision or "main") in message
    # olah answers 401 "repository not found" for all three; the message must not claim more than that
    assert "repository not found" in message and "file or the revision" in message


async def test_the_token_comes_from_hf_token(config: WeightLoaderConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """olah checks no token, so a recording server stands in for the Hub here (it answers 404)."""
    import http.server
    import threading

    seen: list[str | None] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # the name http.server calls
            seen.append(self.headers.get("Authorization"))
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        with pytest.raises(SourceNotFoundError):
            await hub_fetch(HuggingFace(REPO, "config.json", "main"), config)
    finally:
        server.shutdown()
        server.server_close()
    assert seen and all(value == "Bearer hf_test_token" for value in seen)


async def test_unreachable_hub_is_unavailable_not_missing(
    config: WeightLoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub retries a refused connection 5 times with 1-8 s waits (Ferrum adds no retries of
    its own on top); its waits are skipped here to keep the test short, and counted."""
    from huggingface_hub.utils import _http

    waits: list[float] = []
    monkeypatch.setattr(_http.time, "sleep", waits.append)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(SourceUnavailableError) as info:
        await hub_fetch(HuggingFace(REPO, "config.json"), config)
    assert "cannot reach" in str(info.value) and REPO in str(info.value)
    assert len(waits) == 5


async def test_unreachable_hub_for_metadata_is_retried_by_ferrum(
    config: WeightLoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(SourceUnavailableError) as info:
        await hub_metadata(HuggingFace(REPO, "model.safetensors"), config)
    assert "gave up after 2 attempts" in str(info.value)  # config.max_retries = 1


async def test_corruption_in_transit_is_caught_and_not_kept(
    hub: Hub, config: WeightLoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = FaultServer(upstream=hub.endpoint)
    proxy.start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", proxy.base_url)
        proxy.faults.corrupt_offset = 1000  # one flipped byte in every body that reaches offset 1000
        source = HuggingFace(REPO, "model.safetensors", "v1")
        with pytest.raises(IntegrityError) as info:
            await hub_fetch(source, config)
        message = str(info.value)
        assert "hf://acme/tiny-llama@v1/model.safetensors" in message and "sha256" in message
        blobs = Path(config.cache_dir).parent / "hf" / "hub" / "models--acme--tiny-llama" / "blobs"
        assert list(blobs.iterdir()) == [], "the corrupt download must not stay in the cache"
        proxy.reset()
        path = await hub_fetch(source, config)  # downloaded again, now intact
        assert path.read_bytes() == hub.files_v1["model.safetensors"]
    finally:
        proxy.stop()


@pytest.mark.parametrize("filename", ["model.safetensors", "config.json"])  # an LFS file, a git file
async def test_tampered_cache_blob_is_caught(hub: Hub, config: WeightLoaderConfig, filename: str) -> None:
    source = HuggingFace(REPO, filename, "v1")
    path = await hub_fetch(source, config)
    blob = path.resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))  # same size: huggingface_hub's own check cannot see it
    with pytest.raises(IntegrityError) as info:
        await hub_fetch(source, config)
    assert filename in str(info.value) and ("sha256" if filename.endswith("tensors") else "git-sha1") in str(
        info.value
    )
    assert (await hub_fetch(source, config)).read_bytes() == hub.files_v1[filename]  # fetched again


async def test_a_download_is_hashed_while_it_arrives(
    hub: Hub, config: WeightLoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sha256 check of a fresh download reads no byte of the blob again (hub/hash_ahead.py). A fault
    proxy holds the body for a moment mid-way, so the file is seen while it is incomplete."""
    from ferrum.weights.hub import verify as hub_verify

    rehashed: list[str] = []
    real = hub_verify._digest

    def digest(path: Path, algorithm: str, size: int) -> str:
        rehashed.append(path.name)
        return real(path, algorithm, size)

    monkeypatch.setattr(hub_verify, "_digest", digest)
    proxy = FaultServer(upstream=hub.endpoint)
    proxy.start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", proxy.base_url)
        proxy.faults.stall_at_offset, proxy.faults.stall_s = 100_000, 0.5
        path = await hub_fetch(HuggingFace(REPO, "model.safetensors", "v1"), config)
    finally:
        proxy.stop()
    assert path.read_bytes() == hub.files_v1["model.safetensors"]
    assert rehashed == []


def test_a_wrong_hash_ahead_is_never_taken_for_corruption(tmp_path: Path) -> None:
    """A download restarted from zero can leave the early hash wrong: the blob is then hashed again."""
    from ferrum.weights.hub.verify import verify_cached_file

    data = b"weights" * 1000
    blob = tmp_path / hashlib.sha256(data).hexdigest()
    blob.write_bytes(data)
    verify_cached_file(blob, "hf://x/y/z", None, None, hashed_ahead="f" * 64)  # no error: re-hashed, fine
    blob.write_bytes(b"x" + data[1:])
    with pytest.raises(IntegrityError):
        verify_cached_file(
            blob, "hf://x/y/z", None, None, hashed_ahead=hashlib.sha256(data).hexdigest()[::-1]
        )


async def test_pinned_sha256_in_the_config_is_enforced(hub: Hub, config: WeightLoaderConfig) -> None:
    good = hashlib.sha256(hub.files_v1["config.json"]).hexdigest()
    ok = WeightLoaderConfig(cache_dir=config.cache_dir, expected_sha256={f"hf://{REPO}/config.json": good})
    assert (await hub_fetch(HuggingFace(REPO, "config.json", "v1"), ok)).read_bytes() == hub.files_v1[
        "config.json"
    ]
    bad = WeightLoaderConfig(
        cache_dir=config.cache_dir, expected_sha256={f"hf://{REPO}@main/config.json": "0" * 64}
    )
    with pytest.raises(IntegrityError):
        await hub_fetch(HuggingFace(REPO, "config.json", "main"), bad)


async def test_metadata_reads_only_the_header(hub: Hub, config: WeightLoaderConfig, tmp_path: Path) -> None:
    meta = await hub_metadata(HuggingFace(REPO, "model.safetensors", "v1"), config)
    local = tmp_path / "local.safetensors"
    local.write_bytes(hub.files_v1["model.safetensors"])
    with safe_open(str(local), framework="pt") as f:
        expected = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    assert {name: shape for name, (shape, _) in meta.tensors.items()} == expected
    assert {str(dtype) for dtype in meta.dtypes} == {"torch.bfloat16"}
    # nothing was downloaded into the cache: olah sent the whole body (it ignores Range), but only the
    # first bytes were read off the connection
    hf_cache = tmp_path / "hf" / "hub" / "models--acme--tiny-llama" / "blobs"
    assert not hf_cache.exists() or not any(hf_cache.iterdir())


async def test_metadata_of_a_missing_file(config: WeightLoaderConfig) -> None:
    with pytest.raises(SourceNotFoundError) as info:
        await hub_metadata(HuggingFace(REPO, "nope.safetensors", "v1"), config)
    assert "nope.safetensors" in str(info.value) and "v1" in str(info.value)


async def test_snapshot_with_patterns_and_revisions(hub: Hub, config: WeightLoaderConfig) -> None:
    folder = await hub_snapshot(REPO, "v1", ["*.json"], config)
    assert folder.name == hub.v1
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    full = await hub_snapshot(REPO, None, None, config)
    assert full.name == hub.main
    assert folder_files(full) == hub.files_main


async def test_snapshot_of_a_missing_revision(config: WeightLoaderConfig) -> None:
    with pytest.raises(SourceNotFoundError) as info:
        await hub_snapshot(REPO, "v9", None, config)
    assert REPO in str(info.value) and "v9" in str(info.value)
