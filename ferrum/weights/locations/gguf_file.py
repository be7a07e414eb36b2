"""A GGUF file served like a model folder.

A model location naming a `.gguf` file (a local path, `https://host/x/model.gguf`,
`s3://bucket/x/model.gguf`, `hf://org/name[@revision]/model.gguf`) resolves to:

    folder   `<cache_dir>/models/gguf--<stem>--<hash>/`: config.json, tokenizer.json,
             tokenizer_config.json and generation_config.json made from the file's metadata
             (formats.gguf_model), keyed by the file's identity (its resolved path, size and mtime,
             and the version of that derivation); built under a temporary name and renamed into
             place, with a manifest `.ferrum-model.json` written last, so a reader never sees half a
             folder and a changed file gets a folder of its own
    weights  the .gguf itself: a local file where it is; a remote one fetched whole into the
             download cache first (the Downloader for URLs and S3, huggingface_hub's cache for the
             Hub; the GGUF's header, with the vocabulary, is needed before anything else), then
             read from there (File(blob, format=GGUF))
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import posixpath
import re
import shutil
import urllib.parse
import uuid
from pathlib import Path

from ferrum.weights.errors import SourceNotFoundError, WeightError
from ferrum.weights.formats.gguf import gguf_header
from ferrum.weights.formats.gguf_model import gguf_model_files
from ferrum.weights.locations.model_files import ModelFiles, ModelLocation
from ferrum.weights.spec.loader_config import WeightLoaderConfig
from ferrum.weights.spec.sources import S3, File, HuggingFace, Url, WeightFormat

__all__ = ["GGUF_SUFFIX", "MANIFEST", "gguf_model_folder", "is_gguf_location", "resolve_gguf"]

GGUF_SUFFIX = ".gguf"
MANIFEST = ".ferrum-model.json"
_DERIVATION = 2  # bump when gguf_model derives different files: older folders are then made again


def _object_name(location: ModelLocation) -> str:
    if isinstance(location, File):
        return location.path.name
    if isinstance(location, Url):
        return urllib.parse.unquote(posixpath.basename(urllib.parse.urlsplit(location.url).path))
    if isinstance(location, S3):
        return posixpath.basename(location.key)
    return posixpath.basename(location.filename)


def is_gguf_location(location: ModelLocation) -> bool:
    """Whether the location names a .gguf file (by its name) rather than a model folder."""
    return _object_name(location).lower().endswith(GGUF_SUFFIX) and not (
        isinstance(location, File) and location.path.is_dir()
    )


async def resolve_gguf(location: ModelLocation, config: WeightLoaderConfig) -> ModelFiles:
    """The model files of a location naming a GGUF file (see the module docstring): the remote file
    fetched into its cache, the folder of its derived files made or found. Raises WeightErrors naming
    the file (missing, truncated, an architecture or tokenizer Ferrum does not serve)."""
    if isinstance(location, File):
        path, weights = location.path, File(location.path)
    else:
        path = await _fetch(location, config)
        weights = File(path, format=WeightFormat.GGUF)
    folder = await asyncio.to_thread(gguf_model_folder, path, config, name=location.display)
    return ModelFiles(location, folder, weights, complete=True)


async def _fetch(location: Url | S3 | HuggingFace, config: WeightLoaderConfig) -> Path:
    if isinstance(location, HuggingFace):
        from ferrum.weights.hub.fetch import hub_fetch

        return await hub_fetch(location, config)
    from ferrum.weights.download.downloader import Downloader
    from ferrum.weights.download.remote import RemoteObject

    obj: RemoteObject
    if isinstance(location, Url):
        from ferrum.weights.download.http import HttpObject

        obj, sha256 = HttpObject(location.url, location.headers, config), location.sha256
        sha256 = sha256 or config.expected_sha256.get(location.url)
    else:
        from ferrum.weights.download.s3 import S3Object

        obj, sha256 = S3Object(location, config), location.sha256 or config.expected_sha256.get(location.display)
    downloader = Downloader(config)
    try:
        return await downloader.fetch(obj, sha256)
    finally:
        downloader.close()
        close = getattr(obj, "aclose", None)
        if close is not None:
            await close()


def gguf_model_folder(path: Path, config: WeightLoaderConfig, *, name: str | None = None) -> Path:
    """The folder of the files the GGUF file at `path` stands for, made unless already there
    (blocking). `name`: the file as messages name it."""
    label = name or str(path)
    try:
        real = path.resolve(strict=True)
        st = real.stat()
    except FileNotFoundError:
        raise SourceNotFoundError(label, "no such file") from None
    except OSError as exc:
        raise WeightError(label, f"cannot read: {exc.strerror or exc}") from None
    identity = f"gguf {real}|{st.st_size}|{st.st_mtime_ns}|derivation {_DERIVATION}"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.name.removesuffix(GGUF_SUFFIX)).strip("-._")[:80] or "model"
    target = config.cache_dir / "models" / f"gguf--{stem}--{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
    if _complete(target, identity):
        return target
    files = gguf_model_files(gguf_header(real, name=label, stat=st), real)
    return _publish(target, files, identity)


def _complete(folder: Path, identity: str) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("identity") != identity or not isinstance(files, dict):
        return False
    try:
        return all((folder / file).stat().st_size == size for file, size in files.items())
    except OSError:
        return False


def _publish(target: Path, files: dict[str, str], identity: str) -> Path:
    """Writes the files under a temporary name, the manifest last, then renames the folder into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    tmp.mkdir()
    try:
        sizes = {}
        for file, text in files.items():
            data = text.encode("utf-8")
            (tmp / file).write_bytes(data)
            sizes[file] = len(data)
        (tmp / MANIFEST).write_text(json.dumps({"identity": identity, "files": sizes}, indent=1, sort_keys=True) + "\n")
        if target.exists():  # incomplete (a file removed): replaced whole
            old = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.old")
            try:
                os.rename(target, old)
            except FileNotFoundError:
                pass
            else:
                shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError as exc:  # another process put it in place first
            if _complete(target, identity):
                return target
            raise WeightError(str(target), f"cannot put the GGUF's model folder in place: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
