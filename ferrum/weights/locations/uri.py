"""Model locations, parsed into the weight source types (ferrum.weights.spec.sources) that name a folder,
and the files of each one resolved for serving.

    hf://org/name[@revision]       the Hugging Face Hub (revision: a branch, tag or commit)
    s3://bucket[/prefix]           S3; region, endpoint and credentials from the AWS environment
    https://host/path/ (http://)   a folder URL: its files are fetched by name
    a path (or file:///path)       a local model folder, used where it is

or a GGUF file, served like a model folder (see `gguf_file`): a path, URL or S3 key ending in
".gguf", or hf://org/name[@revision]/path/model.gguf;

or a mapping, as YAML gives it:

    {source: hf, repo: org/name, revision: v1.0}             (file: model.gguf for a GGUF in it)
    {source: s3, bucket: b, prefix: models/x, region: eu-west-1, endpoint: http://...}
    {source: url, url: https://host/x/, sha256: {model.safetensors: <hex>}, headers: {...}}
    {source: local, path: models/x}

A location is one of File (a folder), HuggingFace (filename ""), S3 (a prefix) or Url (ending in
"/"), or the same types naming a .gguf file; `sha256` (s3 and url) pins files by name (the source's
`pins`; a GGUF file's own sha256). Which files make a model
folder is decided for each of them by one rule (`model_files.model_folder_files`).

Two ways to resolve one:
- `resolve_model(location, config)` -> ModelFiles, for serving: the small files (config, tokenizer,
  the index) in a local folder, and the weights' source. For S3 and URLs not yet in the cache the
  weights stay remote: the WeightLoader streams them onto the device while it writes the verified
  cache, and `publish_model_folder` then makes the folder a cache hit for the next start. For the
  Hub, huggingface_hub downloads everything into its cache first (HF_HOME, HF_HUB_OFFLINE; see
  `ferrum.weights.hub`); a local folder is used as it is.
- `resolve_model_folder(location, config)` -> a local folder with every file (`ferrum pull`): for the
  Hub its snapshot folder, for S3 and URLs `<cache_dir>/models/<name>` (see `remote_folder`).

A GGUF file resolves (both ways) to the folder of the files its metadata stands for and, as its
weights, the file itself: a remote one fetched into its cache first (see `gguf_file`).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from ferrum.weights.errors import SourceNotFoundError, WeightError
from ferrum.weights.locations.gguf_file import GGUF_SUFFIX, is_gguf_location, resolve_gguf
from ferrum.weights.locations.model_files import (
    FOLDER_NAMES,
    INDEX_FILE,
    FolderFiles,
    ModelFiles,
    ModelLocation,
    local_listing,
    local_model_folder,
    local_weights,
    model_folder_files,
    shards_of_index,
)
from ferrum.weights.spec.loader_config import WeightLoaderConfig
from ferrum.weights.spec.sources import S3, File, HuggingFace, Url, normalize_sha256

if TYPE_CHECKING:
    import aiohttp

    from ferrum.weights.locations.remote_folder import RemoteFolder

__all__ = [
    "ModelLocationError",
    "model_display_name",
    "parse_model_location",
    "publish_model_folder",
    "resolve_model",
    "resolve_model_folder",
]


class ModelLocationError(ValueError):
    """A model location that cannot be understood (bad scheme, repo id, bucket, mapping keys)."""


_LOCATION_TYPES = (File, HuggingFace, S3, Url)
T = TypeVar("T")
_MAPPING_KEYS: Mapping[str, frozenset[str]] = {
    "hf": frozenset({"repo", "revision", "file"}),
    "s3": frozenset({"bucket", "prefix", "region", "endpoint", "sha256"}),
    "url": frozenset({"url", "headers", "sha256"}),
    "local": frozenset({"path"}),
}
_SOURCE_ALIASES = {"huggingface": "hf", "hub": "hf", "http": "url", "https": "url", "file": "local"}


# ------------------------------------------------------------------------------------------ parsing


def _hub(repo_id: str, revision: str | None, text: str, filename: str = "") -> HuggingFace:
    if filename and not filename.lower().endswith(GGUF_SUFFIX):
        raise ModelLocationError(
            f"model location {text}: a Hub location is a repository, or a {GGUF_SUFFIX} file in one; not {filename}"
        )
    try:
        return HuggingFace(repo_id, filename, revision)
    except ValueError as exc:
        raise ModelLocationError(f"model location {text}: {exc}") from None


def _hub_url(rest: str, text: str) -> HuggingFace:
    """hf://org/name[@revision], or hf://org/name[@revision]/path/model.gguf."""
    parts = rest.strip("/").split("/")
    if len(parts) > 2 and parts[-1].lower().endswith(GGUF_SUFFIX):
        repo, _, revision = "/".join(parts[:2]).partition("@")
        return _hub(repo, revision or None, text, "/".join(parts[2:]))
    repo, _, revision = rest.strip("/").partition("@")
    return _hub(repo.strip("/"), revision or None, text)


def _s3(
    bucket: str, prefix: str, region: str | None, endpoint: str | None, sha256: Mapping[str, str], text: str
) -> S3:
    prefix = prefix.strip("/")
    if prefix.lower().endswith(GGUF_SUFFIX):  # a GGUF file, pinned by its name
        try:
            return S3(bucket, prefix, region, endpoint, sha256.get(posixpath.basename(prefix)))
        except ValueError as exc:
            raise ModelLocationError(f"model location {text}: {exc}") from None
    prefix = f"{prefix}/" if prefix else ""
    try:
        return S3(bucket, prefix, region, endpoint, pins=sha256)
    except ValueError as exc:
        raise ModelLocationError(f"model location {text}: {exc}") from None


def _url(url: str, headers: Mapping[str, str], sha256: Mapping[str, str], text: str) -> Url:
    try:
        Url(url, headers)  # checks the scheme, the host and the headers
    except (TypeError, ValueError, WeightError) as exc:
        raise ModelLocationError(f"model location {text}: {exc}") from None
    parts = urllib.parse.urlsplit(url)
    name = urllib.parse.unquote(posixpath.basename(parts.path))
    if name.lower().endswith(GGUF_SUFFIX):  # a GGUF file, pinned by its name
        return Url(url, MappingProxyType(dict(headers)), sha256.get(name))
    if name.endswith((".safetensors", ".json", ".bin")):
        raise ModelLocationError(
            f"model location {text}: a URL location is the model's folder (ending in '/'), whose "
            f"config.json, tokenizer.json and weights are fetched by name, or a {GGUF_SUFFIX} file; not a single "
            "file of a folder"
        )
    path = parts.path if parts.path.endswith("/") else parts.path + "/"
    folder = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))
    return Url(folder, MappingProxyType(dict(headers)), pins=sha256)


def _sha256_map(value: Any, text: str) -> Mapping[str, str]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        raise ModelLocationError(
            f"model location {text}: sha256 must be a mapping of file name to hex digest"
        )
    pins: dict[str, str] = {}
    for name, digest in value.items():
        if not isinstance(digest, str):
            raise ModelLocationError(
                f"model location {text}: sha256 of {name} must be a string of 64 hex digits "
                f"(quote it in YAML), got {digest!r}"
            )
        try:
            pins[str(name)] = normalize_sha256(f"sha256 of {name}", digest)
        except ValueError as exc:
            raise ModelLocationError(f"model location {text}: {exc}") from None
    return MappingProxyType(pins)


def _optional_str(raw: Mapping[str, Any], key: str, text: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ModelLocationError(f"model location {text}: {key} must be a string, got {value!r}")
    return str(value)


def _from_mapping(raw: Mapping[str, Any]) -> ModelLocation:
    text = f"{{source: {raw.get('source')!r}, ...}}"
    source = str(raw.get("source", "")).lower()
    source = _SOURCE_ALIASES.get(source, source)
    if source not in _MAPPING_KEYS:
        raise ModelLocationError(f"model location {dict(raw)!r}: `source` must be one of hf, s3, url, local")
    unknown = sorted(set(raw) - _MAPPING_KEYS[source] - {"source"})
    if unknown:
        raise ModelLocationError(
            f"model location {text}: unknown key(s) {', '.join(unknown)}; valid keys: "
            f"source, {', '.join(sorted(_MAPPING_KEYS[source]))}"
        )
    need = {"hf": "repo", "s3": "bucket", "url": "url", "local": "path"}[source]
    main = _optional_str(raw, need, text)
    if not main:
        raise ModelLocationError(f"model location {text}: `{need}` is required")
    if source == "hf":
        return _hub(main, _optional_str(raw, "revision", text), text, _optional_str(raw, "file", text) or "")
    if source == "s3":
        return _s3(
            main,
            _optional_str(raw, "prefix", text) or "",
            _optional_str(raw, "region", text),
            _optional_str(raw, "endpoint", text),
            _sha256_map(raw.get("sha256"), text),
            text,
        )
    if source == "url":
        headers = raw.get("headers") or {}
        if not isinstance(headers, Mapping):
            raise ModelLocationError(f"model location {text}: headers must be a mapping")
        return _url(
            main, {str(k): str(v) for k, v in headers.items()}, _sha256_map(raw.get("sha256"), text), text
        )
    return File(Path(main).expanduser())


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def parse_model_location(value: str | os.PathLike[str] | Mapping[str, Any] | ModelLocation) -> ModelLocation:
    """A model location from a string, a path or a mapping (ModelLocationError when it is not one)."""
    if isinstance(value, _LOCATION_TYPES):
        return value
    if isinstance(value, Mapping):
        return _from_mapping(value)
    if isinstance(value, os.PathLike):
        return File(Path(value).expanduser())
    if not isinstance(value, str) or not value.strip():
        raise ModelLocationError(f"model location must be a non-empty string or a mapping, got {value!r}")
    value = value.strip()
    text = repr(value)  # for messages
    match = _SCHEME.match(value)
    if match is None:
        return File(Path(value).expanduser())
    scheme, rest = match.group(1).lower(), value[match.end() :]
    if scheme == "hf":
        return _hub_url(rest, text)
    if scheme == "s3":
        bucket, _, prefix = rest.partition("/")
        return _s3(bucket, prefix, None, None, {}, text)
    if scheme in ("http", "https"):
        return _url(value, {}, {}, text)
    if scheme == "file":
        return File(Path(urllib.parse.unquote(urllib.parse.urlsplit(value).path)))
    raise ModelLocationError(
        f"model location {text}: unsupported scheme {scheme}://; use hf://org/name[@revision], "
        "s3://bucket/prefix, https://host/folder/ or a local path"
    )


def model_display_name(value: str | os.PathLike[str] | Mapping[str, Any] | ModelLocation) -> str:
    """The model's name for clients when none is configured: the folder's / repo's / prefix's last part
    (a GGUF file's name without .gguf)."""
    location = parse_model_location(value)
    if is_gguf_location(location):
        path = location.filename if not isinstance(location, File) else location.path.name
        return posixpath.basename(path)[: -len(GGUF_SUFFIX)] or "model"
    if isinstance(location, File):
        return location.path.name or str(location.path)
    if isinstance(location, HuggingFace):
        return location.repo_id.rsplit("/", 1)[-1]
    if isinstance(location, S3):
        return location.key.rstrip("/").rsplit("/", 1)[-1] or location.bucket
    return posixpath.basename(urllib.parse.urlsplit(location.url).path.rstrip("/")) or (
        urllib.parse.urlsplit(location.url).hostname or "model"
    )


# ---------------------------------------------------------------------------------------- resolving


def _folder_name(kind: str, readable: str, identity: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", readable).strip("-._")[:80] or "model"
    return f"{kind}--{safe}--{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def _pins_text(pins: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(pins.items()))


async def _resolve_hub(location: HuggingFace, config: WeightLoaderConfig) -> tuple[Path, FolderFiles]:
    """Two snapshot passes at one commit: the files a model folder may have (the weights when not
    sharded), then the shards its index names."""
    from ferrum.weights.hub.fetch import hub_snapshot

    first = await hub_snapshot(location.repo_id, location.revision, list(FOLDER_NAMES), config)
    commit = first.name
    where = location.display
    files = model_folder_files(local_listing(first), where)
    if files.weights != INDEX_FILE:
        return first, files
    shards = shards_of_index((first / INDEX_FILE).read_bytes(), name=f"{where}/{INDEX_FILE}")
    folder = await hub_snapshot(location.repo_id, commit, shards, config)
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise SourceNotFoundError(
            where,
            f"{INDEX_FILE} lists shards the repository does not have at commit {commit}: {', '.join(missing)}",
        )
    return folder, files


def _remote_folder(
    location: S3 | Url, config: WeightLoaderConfig, session: aiohttp.ClientSession | None = None
) -> RemoteFolder:
    """The RemoteFolder of an S3 prefix or a folder URL: its cache name, identity and objects."""
    from ferrum.weights.locations.remote_folder import RemoteFolder

    if isinstance(location, S3):
        from ferrum.weights.download.s3 import S3Object

        identity = (
            f"s3 {location.endpoint or ''}|{location.region or ''}|{location.bucket}/{location.key}|"
            + _pins_text(location.pins)
        )
        return RemoteFolder(
            name=_folder_name("s3", f"{location.bucket}-{location.key}", identity),
            display=location.display,
            identity=identity,
            open_object=lambda name: S3Object(location.child(name), config),
            sha256=location.pins,
        )
    from ferrum.weights.download.http import HttpObject

    parts = urllib.parse.urlsplit(location.url)
    identity = f"url {location.url}|" + _pins_text(location.pins)
    return RemoteFolder(
        name=_folder_name("url", f"{parts.netloc}{parts.path}", identity),
        display=location.display,
        identity=identity,
        open_object=lambda name: HttpObject(location.child(name).url, location.headers, config, session=session),
        sha256=location.pins,
    )


async def _with_folder(
    location: S3 | Url, config: WeightLoaderConfig, use: Callable[[RemoteFolder], Awaitable[T]]
) -> T:
    """`use(remote_folder)`, with one HTTP session for a URL folder's objects."""
    if isinstance(location, S3):
        return await use(_remote_folder(location, config))
    import aiohttp

    async with aiohttp.ClientSession(auto_decompress=False, trust_env=True) as session:
        return await use(_remote_folder(location, config, session))


async def resolve_model_folder(
    location: str | os.PathLike[str] | Mapping[str, Any] | ModelLocation, config: WeightLoaderConfig
) -> Path:
    """A local folder with the model's config, tokenizer files and weights (see the module docstring).
    Raises ModelLocationError for a location it cannot parse, WeightError subclasses (naming the
    repository / URL / key, and what a model folder lacks: model_files.model_folder_files) when the
    model cannot be fetched."""
    from ferrum.weights.locations.remote_folder import materialize

    parsed = parse_model_location(location)
    if is_gguf_location(parsed):
        return (await resolve_gguf(parsed, config)).folder
    if isinstance(parsed, File):
        local_model_folder(parsed.path)
        return parsed.path
    if isinstance(parsed, HuggingFace):
        return (await _resolve_hub(parsed, config))[0]
    return await _with_folder(parsed, config, lambda folder: materialize(folder, config))


async def resolve_model(
    location: str | os.PathLike[str] | Mapping[str, Any] | ModelLocation, config: WeightLoaderConfig
) -> ModelFiles:
    """What serving needs before the weights: the small files local, and where the weights are. An
    S3 or URL model already in the cache (a complete folder) loads from there, with no network
    request; one that is not keeps its weights remote, to be streamed (see the module docstring)."""
    from ferrum.weights.locations.remote_folder import complete_folder, stage_small_files

    parsed = parse_model_location(location)
    if is_gguf_location(parsed):
        return await resolve_gguf(parsed, config)
    if isinstance(parsed, File):
        files = local_model_folder(parsed.path)
        return ModelFiles(parsed, parsed.path, File(parsed.path / files.weights), complete=True)
    if isinstance(parsed, HuggingFace):
        folder, files = await _resolve_hub(parsed, config)
        return ModelFiles(parsed, folder, File(folder / files.weights), complete=True)
    remote_location = parsed

    async def stage(remote: RemoteFolder) -> ModelFiles:
        cached = await complete_folder(remote, config)
        if cached is not None:
            return ModelFiles(remote_location, cached, local_weights(cached), complete=True)
        folder, weights_name = await stage_small_files(remote, config)
        return ModelFiles(remote_location, folder, remote_location.child(weights_name), complete=False)

    return await _with_folder(remote_location, config, stage)


async def publish_model_folder(files: ModelFiles, config: WeightLoaderConfig) -> Path:
    """After a remote model's weights were loaded (and so verified and committed to the download
    cache), the complete model folder `<cache_dir>/models/<name>`, for the next start to load with
    no network request; the folder itself when it already was complete."""
    if files.complete:
        return files.folder
    return await resolve_model_folder(files.location, config)
