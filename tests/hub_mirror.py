"""An offline Hugging Face Hub on loopback for tests: olah serving git repos built in a tmp dir.

Large files are committed as Git LFS pointer files with their blobs under `.git/lfs/objects`
(no git-lfs needed), the layout olah reads. See /work/shared/notes/test-services.md.

Known limits of olah (not of the real Hub), which tests must keep in mind:
- it ignores HTTP `Range` (answers 200 with the whole body);
- a missing repo, file or revision all come back as 401 `RepositoryNotFoundError`;
- the etag of an LFS file is the sha256 of the blob it finds, not the pointer's `oid`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.live_server import stop_process_group

LFS_THRESHOLD = 1 << 20  # files of 1 MiB and more are committed as LFS pointers
STARTUP_TIMEOUT_S = 60


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def lfs_pointer(sha256: str, size: int) -> str:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"


class MirrorRepo:
    """A git repo at MIRRORS/models/ORG/NAME, written through plain git commands."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def git(self, *args: str) -> str:
        result = subprocess.run(
            ["git", *args],
            cwd=self.path,
            check=True,
            capture_output=True,
            text=True,
            env={
                **os.environ,
                "GIT_AUTHOR_DATE": "2025-01-01T00:00:00",
                "GIT_COMMITTER_DATE": "2025-01-01T00:00:00",
            },
        )
        return result.stdout.strip()

    def put(self, files: Mapping[str, Path | bytes]) -> None:
        """Writes files into the work tree (name -> source file or content); large ones as LFS."""
        for name, src in files.items():
            dest = self.path / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            data_path: Path | None = src if isinstance(src, Path) else None
            size = data_path.stat().st_size if data_path is not None else len(src)  # type: ignore[arg-type]
            if size < LFS_THRESHOLD:
                dest.write_bytes(data_path.read_bytes() if data_path is not None else src)  # type: ignore[arg-type]
                continue
            if data_path is None:
                tmp = self.path / ".git" / "ferrum-tmp-blob"
                tmp.write_bytes(src)  # type: ignore[arg-type]
                data_path = tmp
            sha = _sha256_file(data_path)
            self.put_lfs_blob(sha, data_path)
            dest.write_text(lfs_pointer(sha, size))
            if data_path.name == "ferrum-tmp-blob":
                data_path.unlink()

    def put_lfs_blob(self, sha256: str, src: Path) -> Path:
        blob = self.lfs_blob_path(sha256)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            try:
                os.link(src, blob)  # same file system: no copy of a large file
            except OSError:
                shutil.copyfile(src, blob)
        return blob

    def lfs_blob_path(self, sha256: str) -> Path:
        return self.path / ".git" / "lfs" / "objects" / sha256[:2] / sha256[2:4] / sha256

    def commit(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "HEAD")


class HubMirror:
    """A folder of model repos for olah's `mirrors-path`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mirrors = root / "mirrors"

    def create_repo(self, repo_id: str) -> MirrorRepo:
        path = self.mirrors / "models" / repo_id
        path.mkdir(parents=True)
        repo = MirrorRepo(path)
        repo.git("init", "-q", "-b", "main")
        repo.git("config", "user.email", "tests@ferrum.invalid")
        repo.git("config", "user.name", "ferrum tests")
        return repo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class OlahServer:
    endpoint: str  # for HF_ENDPOINT
    pid: int


@contextmanager
def olah_server(mirror: HubMirror) -> Iterator[OlahServer]:
    """Starts `olah-cli` in offline mode over `mirror` on a free loopback port; stops it by its pid."""
    port = _free_port()
    netloc = f"127.0.0.1:{port}"
    conf = mirror.root / "olah.toml"
    conf.write_text(
        "[basic]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        f'repos-path = "{mirror.root / "olah-cache"}"\n'
        'mirror-scheme = "http"\n'
        f'mirror-netloc = "{netloc}"\n'
        f'mirror-lfs-netloc = "{netloc}"\n'
        f'mirrors-path = ["{mirror.mirrors}"]\n'
        "[accessibility]\n"
        "offline = true\n"
    )
    olah_cli = Path(sys.executable).with_name("olah-cli")
    log_path = mirror.root / "olah.out"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(olah_cli), "-c", str(conf), "--log-path", str(mirror.root / "olah-logs")],
            cwd=mirror.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"olah exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
            try:
                httpx.get(f"http://{netloc}/", timeout=2)
                break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"olah not up after {STARTUP_TIMEOUT_S}s: {log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield OlahServer(endpoint=f"http://{netloc}", pid=proc.pid)
    finally:
        stop_process_group(proc, grace_s=15)
