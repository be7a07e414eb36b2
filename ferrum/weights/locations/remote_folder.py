"""A remote model folder (HTTP or S3) made local: `<cache_dir>/models/<name>/`.

The files (see `model_files`) are fetched by the `Downloader` into the download cache, where each
blob is verified before it is committed; the model folder holds relative symbolic links to those
blobs (a hard link, then a copy, where links cannot be made) and, written last, a manifest
`.ferrum-model.json` with the location's identity and each file's size. A folder whose manifest
matches and whose files are all there with those sizes is a cache hit: no network at all.
The folder is built under a temporary name and renamed into place, so a reader never sees half a
folder; when the download cache evicts a blob, the folder is no longer complete and is rebuilt
by the next resolve.

For serving a model not yet in the cache, `stage_small_files` fetches only the small files (config,
tokenizer, the index) into `<cache_dir>/models/.<name>.parts/`: the weights are then streamed onto
the device (the WeightLoader writes them into the same download cache as it goes), and
`materialize` afterwards finds every blob in the cache and publishes the folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ferrum.weights.download.downloader import Downloader
from ferrum.weights.download.remote import RemoteObject
from ferrum.weights.errors import SourceNotFoundError, WeightError
from ferrum.weights.locations.model_files import (
    INDEX_FILE,
    OPTIONAL_FILES,
    REQUIRED_FILES,
    SINGLE_WEIGHTS_FILE,
    FolderFiles,
    model_folder_files,
    shards_of_index,
)
from ferrum.weights.spec.loader_config import WeightLoaderConfig

__all__ = ["MANIFEST", "RemoteFolder", "complete_folder", "materialize", "models_dir", "stage_small_files"]

MANIFEST = ".ferrum-model.json"
_SHARDS_AT_ONCE = 2  # each shard is already fetched in concurrent chunks

T = TypeVar("T")


@dataclass(frozen=True)
class RemoteFolder:
    """A folder of files on a remote source."""

    name: str  # the folder's name under <cache_dir>/models/ (a safe, unique file name)
    display: str  # for messages: the folder URL, s3://bucket/prefix/
    identity: str  # what the manifest records: a changed location never matches an old folder
    open_object: Callable[[str], RemoteObject]  # file name (relative) -> its remote object
    sha256: Mapping[str, str] = field(default_factory=dict)  # file name -> the sha256 it must have


def models_dir(config: WeightLoaderConfig) -> Path:
    return config.cache_dir / "models"


async def complete_folder(folder: RemoteFolder, config: WeightLoaderConfig) -> Path | None:
    """The cached model folder when it is complete (no network request), else None."""
    target = models_dir(config) / folder.name
    return target if await asyncio.to_thread(_complete, target, folder.identity) else None


async def stage_small_files(folder: RemoteFolder, config: WeightLoaderConfig) -> tuple[Path, str]:
    """The small files (required, optional, the index) fetched and verified into the cache and
    linked into `<cache_dir>/models/.<name>.parts/` (rebuilt each time: links only); returns that
    folder and the name of the weights' entry point (the index, or the single weights file, whose
    presence is checked with one metadata request). Raises SourceNotFoundError naming what a model
    folder lacks (`model_folder_files`)."""
    downloader = Downloader(config)
    try:
        files, blobs = await _fetch_small_files(folder, downloader)
    finally:
        downloader.close()
    target = models_dir(config) / f".{folder.name}.parts"
    staged = await asyncio.to_thread(_publish, target, blobs, folder.identity + "|small files")
    return staged, files.weights


async def materialize(folder: RemoteFolder, config: WeightLoaderConfig) -> Path:
    """The local model folder of `folder`: the cached one when complete, else fetched and built."""
    target = models_dir(config) / folder.name
    if await asyncio.to_thread(_complete, target, folder.identity):
        return target
    downloader = Downloader(config)
    try:
        blobs = await _fetch_files(folder, downloader)
    finally:
        downloader.close()
    return await asyncio.to_thread(_publish, target, blobs, folder.identity)


async def _all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Like gather, but the first failure cancels the rest (no download left running unattended)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _close(obj: RemoteObject) -> None:
    close = getattr(obj, "aclose", None)
    if close is not None:
        await close()


async def _fetch(folder: RemoteFolder, downloader: Downloader, name: str) -> Path | None:
    """The verified blob of `name`, or None when the folder has no such file."""
    obj = folder.open_object(name)
    try:
        return await downloader.fetch(obj, folder.sha256.get(name))
    except SourceNotFoundError:
        return None
    finally:
        await _close(obj)


async def _exists(folder: RemoteFolder, name: str) -> bool:
    obj = folder.open_object(name)
    try:
        await obj.info()
    except SourceNotFoundError:
        return False
    finally:
        await _close(obj)
    return True


async def _fetch_small_files(folder: RemoteFolder, downloader: Downloader) -> tuple[FolderFiles, dict[str, Path]]:
    """Which files make the model (`model_folder_files`, on the names this folder has: a URL cannot be
    listed, so each name is asked for), and the small ones fetched: required, optional, the index."""
    names = [*REQUIRED_FILES, *OPTIONAL_FILES, INDEX_FILE]
    found = await _all(_fetch(folder, downloader, n) for n in names)
    blobs = {name: path for name, path in zip(names, found, strict=True) if path is not None}
    listing = set(blobs)
    if INDEX_FILE not in blobs and await _exists(folder, SINGLE_WEIGHTS_FILE):
        listing.add(SINGLE_WEIGHTS_FILE)
    return model_folder_files(listing, folder.display), blobs


async def _fetch_files(folder: RemoteFolder, downloader: Downloader) -> dict[str, Path]:
    files, blobs = await _fetch_small_files(folder, downloader)
    index = blobs.get(INDEX_FILE) if files.weights == INDEX_FILE else None
    if index is not None:
        shards = shards_of_index(
            await asyncio.to_thread(index.read_bytes), name=f"{folder.display}{INDEX_FILE}"
        )
    else:
        shards = [files.weights]
    limit = asyncio.Semaphore(_SHARDS_AT_ONCE)

    async def shard(name: str) -> Path:
        async with limit:
            path = await _fetch(folder, downloader, name)
        if path is None:
            why = f"a shard {INDEX_FILE} lists" if index is not None else "it was there a moment ago"
            raise SourceNotFoundError(folder.display, f"no {name} ({why})")
        return path

    for name, path in zip(shards, await _all(shard(s) for s in shards), strict=True):
        blobs[name] = path
    return blobs


def _read_manifest(folder: Path) -> dict[str, object] | None:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _complete(folder: Path, identity: str) -> bool:
    """Whether `folder` holds every file its manifest lists, at its size (blocking). Marks the blobs
    as used for the download cache's LRU eviction."""
    manifest = _read_manifest(folder)
    files = manifest.get("files") if manifest is not None else None
    if manifest is None or manifest.get("identity") != identity or not isinstance(files, dict):
        return False
    for name, size in files.items():
        try:
            if (folder / name).stat().st_size != size:
                return False
        except OSError:
            return False
    for name in files:
        try:
            os.utime(folder / name)  # follows the link: the blob's mtime is its last use
        except OSError:
            pass
    return True


def _link(blob: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.symlink(os.path.relpath(blob, dest.parent), dest)
        return
    except OSError:
        pass
    try:
        os.link(blob, dest)
    except OSError:
        shutil.copyfile(blob, dest)


def _publish(target: Path, blobs: Mapping[str, Path], identity: str) -> Path:
    """Builds the folder under a temporary name, then renames it into place (blocking)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    tmp.mkdir()
    try:
        for name, blob in blobs.items():
            _link(blob.resolve(), tmp / name)
        manifest = {
            "identity": identity,
            "files": {name: blob.stat().st_size for name, blob in blobs.items()},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if target.exists() or target.is_symlink():
            old = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.old")
            try:
                os.rename(target, old)
            except FileNotFoundError:
                pass  # gone meanwhile: nothing to remove
            else:
                shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError as exc:  # another process published it first
            if _complete(target, identity):
                return target
            raise WeightError(str(target), f"cannot put the model folder in place: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
