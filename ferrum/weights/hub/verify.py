"""Checks a file in huggingface_hub's cache against the hash the Hub vouched for.

huggingface_hub names each blob by the etag the Hub sent: for a Git LFS file the sha256 of its
content (the LFS oid), for a file stored in git the git blob id (sha1 of "blob <size>\\0" + content).
It checks only the size of what it downloads; Ferrum checks the content against that name (or a
sha256 the configuration gives). A file that passed is remembered by a small marker under
`<ferrum cache>/hub-verified/` that holds the blob's size, mtime and inode, so a second start does
not hash gigabytes again; any change to the blob makes the marker stale.

For a download that just happened, the sha256 is usually taken while it arrives (see
`hash_ahead`), so only the last bytes are left to hash here.

On a mismatch the blob and the snapshot's link to it are deleted (the next fetch downloads the file
again) and IntegrityError is raised.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ferrum.weights.errors import IntegrityError

__all__ = ["expected_hash", "verify_cached_file"]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_GIT_SHA1 = re.compile(r"[0-9a-f]{40}")
_READ = 8 * 1024 * 1024


def expected_hash(blob: Path, sha256: str | None) -> tuple[str, str] | None:
    """(algorithm, hex digest) the blob must have: the given sha256, else what its etag name says."""
    if sha256 is not None:
        return "sha256", sha256
    name = blob.name
    if _SHA256.fullmatch(name):
        return "sha256", name
    if _GIT_SHA1.fullmatch(name):
        return "git-sha1", name
    return None


def _digest(path: Path, algorithm: str, size: int) -> str:
    h = hashlib.sha256() if algorithm == "sha256" else hashlib.sha1(b"blob %d\0" % size)
    with path.open("rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()


def _stamp(blob: Path, algorithm: str, digest: str) -> str:
    st = blob.stat()
    return f"{algorithm} {digest} {st.st_size} {st.st_mtime_ns} {st.st_ino}\n"


def verify_cached_file(
    path: Path, where: str, sha256: str | None, marker_dir: Path | None, hashed_ahead: str | None = None
) -> None:
    """Checks `path` (a snapshot entry, usually a link to a blob). `hashed_ahead`: a sha256 of the
    blob taken while it was downloaded (`hash_ahead`); when it matches, the blob is not read
    again; when it does not, the blob is hashed again before anything is called corrupt.
    Blocking: run it in a thread."""
    blob = path.resolve()
    want = expected_hash(blob, sha256)
    if want is None:
        return  # the Hub gave no hash (a mirror with odd etags): only huggingface_hub's size check stands
    algorithm, digest = want
    marker = marker_dir / f"{algorithm}-{digest}" if marker_dir is not None else None
    stamp = _stamp(blob, algorithm, digest)
    if marker is not None:
        try:
            if marker.read_text() == stamp:
                return
        except OSError:
            pass
    size = blob.stat().st_size
    actual = (
        hashed_ahead if algorithm == "sha256" and hashed_ahead == digest else _digest(blob, algorithm, size)
    )
    if actual != digest:
        for stale in (path, blob):
            try:
                stale.unlink()
            except OSError:
                pass
        raise IntegrityError(
            where,
            f"{algorithm} of the downloaded file is {actual}, the Hub vouched for {digest} ({size} bytes); "
            "the corrupt copy was deleted from the Hugging Face cache, fetch again",
        )
    if marker is not None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
            tmp.write_text(stamp)
            os.replace(tmp, marker)
        except OSError:
            pass  # no marker: the file is hashed again next time, nothing worse
