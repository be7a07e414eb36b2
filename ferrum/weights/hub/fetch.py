"""The Hugging Face Hub source, through huggingface_hub.

- Files land in huggingface_hub's own cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `~/.cache/huggingface/hub`; a `HuggingFace` source's `cache_dir` wins), shared with every other
  program that uses it. `HF_ENDPOINT` picks the Hub or a mirror; `HF_HUB_OFFLINE=1` uses only what
  is cached; the token comes from `HF_TOKEN` or `hf auth login`, as huggingface_hub does it.
- A revision is a branch, a tag or a commit (full or short); None means the default branch.
- huggingface_hub checks a download's size; Ferrum also checks its content against the etag the Hub
  sent (the LFS sha256, or the git blob id), see `verify`, hashing while the bytes arrive
  (`hash_ahead`) so the check adds little to a download.
- Blocking huggingface_hub calls run in threads. Downloads are retried by huggingface_hub itself
  (5xx, 429, time-outs, resets: 5 retries with backoff, and resumed from the `.incomplete` file), so
  Ferrum does not retry them again; the metadata reads of `hub_metadata` are retried like HTTP and S3.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TypeVar

import huggingface_hub
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import build_hf_headers

from ferrum.weights.download.http import HttpObject
from ferrum.weights.download.remote import RetryPolicy, retrying
from ferrum.weights.errors import SourceNotFoundError, SourceUnavailableError, UnsupportedError, WeightError
from ferrum.weights.formats.readers import metadata_from_header
from ferrum.weights.formats.safetensors_header import header_length, parse_header, read_header
from ferrum.weights.hub.errors import HubTarget, hub_error
from ferrum.weights.hub.hash_ahead import HashAhead
from ferrum.weights.hub.settings import HubSettings, hub_settings
from ferrum.weights.hub.verify import verify_cached_file
from ferrum.weights.spec.loader_config import WeightLoaderConfig
from ferrum.weights.spec.sources import HuggingFace, WeightFormat
from ferrum.weights.spec.tensors import WeightMetadata

__all__ = ["hub_fetch", "hub_metadata", "hub_snapshot"]

T = TypeVar("T")


async def _call(
    target: HubTarget,
    settings: HubSettings,
    config: WeightLoaderConfig,
    fn: Callable[[], T],
    what: str,
    *,
    retry: bool = False,
) -> T:
    """Runs blocking `fn` in a thread, its errors mapped to WeightErrors; transient ones retried per
    `config.max_retries` when `retry` (only for calls huggingface_hub does not retry itself)."""

    async def attempt() -> T:
        try:
            return await asyncio.to_thread(fn)
        except WeightError:
            raise
        except Exception as exc:  # huggingface_hub's errors, translated below (others re-raised)
            mapped = hub_error(exc, target, settings)
            if mapped is None:
                raise
            raise mapped from exc

    if not retry:
        return await attempt()
    return await retrying(target.where, RetryPolicy.from_config(config), attempt, what)


def _marker_dir(config: WeightLoaderConfig) -> Path | None:
    return config.cache_dir / "hub-verified" if config.cache_enabled else None


def _expected_sha256(source: HuggingFace, config: WeightLoaderConfig) -> str | None:
    """A sha256 the configuration pins for this file, by `hf://org/name@rev/file` or `hf://org/name/file`."""
    plain = f"hf://{source.repo_id}/{source.filename}"
    return config.expected_sha256.get(source.display) or config.expected_sha256.get(plain)


def _blobs_dir(settings: HubSettings, repo_id: str) -> Path:
    return settings.cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model") / "blobs"


def _hash_ahead(
    settings: HubSettings, repo_id: str, config: WeightLoaderConfig
) -> AbstractContextManager[HashAhead | None]:
    """A HashAhead on the repository's blobs folder, or nothing when integrity checks are off."""
    if not config.verify_integrity:
        return nullcontext(None)
    return HashAhead(_blobs_dir(settings, repo_id))


async def _verify(
    path: Path, where: str, sha256: str | None, config: WeightLoaderConfig, ahead: HashAhead | None = None
) -> None:
    if not config.verify_integrity:
        return
    hashed = await asyncio.to_thread(ahead.digest, path.resolve()) if ahead is not None else None
    await asyncio.to_thread(verify_cached_file, path, where, sha256, _marker_dir(config), hashed)


async def hub_fetch(source: HuggingFace, config: WeightLoaderConfig) -> Path:
    """The local path of `source`'s file in huggingface_hub's cache, downloaded if needed, verified."""
    settings = hub_settings(source.cache_dir)
    target = HubTarget(source.repo_id, source.revision, source.filename)

    def download() -> str:
        return huggingface_hub.hf_hub_download(
            source.repo_id,
            source.filename,
            revision=source.revision,
            cache_dir=settings.cache_dir,
            endpoint=settings.endpoint,
            local_files_only=settings.offline,
            etag_timeout=config.timeout_s,
        )

    with _hash_ahead(settings, source.repo_id, config) as ahead:
        path = Path(await _call(target, settings, config, download, "download"))
        await _verify(path, target.where, _expected_sha256(source, config), config, ahead)
    return path


async def hub_snapshot(
    repo_id: str,
    revision: str | None,
    allow_patterns: Sequence[str] | None,
    config: WeightLoaderConfig,
    *,
    cache_dir: Path | None = None,
) -> Path:
    """The snapshot folder (`.../models--org--name/snapshots/<commit>`) holding the repository's files
    that match `allow_patterns` (all files when None), downloaded if needed, each verified."""
    settings = hub_settings(cache_dir)
    target = HubTarget(repo_id, revision)
    patterns = list(allow_patterns) if allow_patterns is not None else None

    def download() -> str:
        return str(
            huggingface_hub.snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=settings.cache_dir,
                endpoint=settings.endpoint,
                local_files_only=settings.offline,
                allow_patterns=patterns,
                max_workers=config.max_concurrent_downloads,
                etag_timeout=config.timeout_s,
            )
        )

    with _hash_ahead(settings, repo_id, config) as ahead:
        folder = Path(await _call(target, settings, config, download, "snapshot download"))
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            name = path.relative_to(folder).as_posix()
            where = HubTarget(repo_id, revision, name).where
            await _verify(path, where, config.expected_sha256.get(f"hf://{repo_id}/{name}"), config, ahead)
    return folder


async def hub_metadata(source: HuggingFace, config: WeightLoaderConfig) -> WeightMetadata:
    """What a SafeTensors file on the Hub holds, from its header alone: read from the cached copy when
    there is one, else with two ranged reads (8 bytes, then the header) from the start of the file.
    A server that ignores Range (olah does) answers with the whole body, of which only those first
    bytes are read before the connection is closed."""
    settings = hub_settings(source.cache_dir)
    target = HubTarget(source.repo_id, source.revision, source.filename)
    where = target.where
    named = (
        source.format
        if source.format is not None
        else (WeightFormat.SAFETENSORS if source.filename.endswith(".safetensors") else None)
    )
    if named is not WeightFormat.SAFETENSORS:
        raise UnsupportedError(
            where, "hub_metadata reads SafeTensors headers only; fetch the file to read others"
        )
    cached = huggingface_hub.try_to_load_from_cache(
        source.repo_id, source.filename, cache_dir=settings.cache_dir, revision=source.revision
    )
    if isinstance(cached, str):
        return metadata_from_header(await asyncio.to_thread(read_header, Path(cached), name=where))
    if settings.offline:
        raise SourceNotFoundError(
            where,
            f"{target.what} is not in the Hugging Face cache {settings.cache_dir} "
            "and offline mode is on (HF_HUB_OFFLINE)",
        )
    url = huggingface_hub.hf_hub_url(
        source.repo_id, source.filename, revision=source.revision, endpoint=settings.endpoint
    )
    meta = await _call(
        target,
        settings,
        config,
        lambda: huggingface_hub.get_hf_file_metadata(
            url, timeout=config.timeout_s, endpoint=settings.endpoint
        ),
        "metadata request",
        retry=True,
    )
    if meta.size is None:
        raise SourceUnavailableError(where, f"{settings.endpoint} did not say the size of {target.what}")
    obj = HttpObject(meta.location, build_hf_headers(), config)
    try:
        n = header_length(await obj.read_range(0, 8), file_size=meta.size, name=where)
        raw = await obj.read_range(0, 8 + n)  # from byte 0 again: also right where Range is ignored
    except WeightError as exc:
        raise type(exc)(where, f"{target.what}: {exc.message}") from exc
    finally:
        await obj.aclose()
    return metadata_from_header(parse_header(raw[8:], data_size=meta.size - 8 - n, name=where))
