"""Which files make a model folder that `ferrum serve` can run, one rule and one message for every
source (a folder on disk, a Hub repository, an S3 prefix, a URL folder), and `ModelFiles`: a
resolved model, ready to load.

required    config.json, tokenizer.json
optional    tokenizer_config.json, generation_config.json, chat_template.jinja,
            special_tokens_map.json, quantize_config.json
weights     model.safetensors.index.json and the shards its weight_map names, else model.safetensors
            (as transformers: other *.safetensors files without an index are not a model's weights)

`model_folder_files(listing, where)` gives the verdict on a folder's file names; a listing needs to
hold only the names above (`FOLDER_NAMES`), so a source that cannot list (a URL folder) asks for
those names one by one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from ferrum.weights.errors import SourceNotFoundError, WeightError
from ferrum.weights.formats.readers import parse_index
from ferrum.weights.spec.sources import S3, File, HuggingFace, Url

__all__ = [
    "CONFIG_FILE",
    "FOLDER_NAMES",
    "INDEX_FILE",
    "OPTIONAL_FILES",
    "REQUIRED_FILES",
    "SINGLE_WEIGHTS_FILE",
    "TOKENIZER_FILE",
    "WEIGHTS_FILES",
    "FolderFiles",
    "ModelFiles",
    "ModelLocation",
    "local_listing",
    "local_model_folder",
    "local_weights",
    "model_folder_files",
    "shards_of_index",
    "weights_file",
]

ModelLocation: TypeAlias = File | HuggingFace | S3 | Url  # each naming a folder, or a .gguf file (locations.uri)

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
REQUIRED_FILES: tuple[str, ...] = (CONFIG_FILE, TOKENIZER_FILE)
OPTIONAL_FILES: tuple[str, ...] = (
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "quantize_config.json",  # an older GPTQ folder's quantization (AutoGPTQ)
)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_FILES: tuple[str, ...] = (INDEX_FILE, SINGLE_WEIGHTS_FILE)  # in this order of preference
FOLDER_NAMES: tuple[str, ...] = (*REQUIRED_FILES, *OPTIONAL_FILES, *WEIGHTS_FILES)  # all the rule looks at
_WEIGHTS = f"weights ({INDEX_FILE} or {SINGLE_WEIGHTS_FILE})"


def shards_of_index(data: bytes, *, name: str) -> list[str]:
    """The shard file names an index lists, each once, sorted; validated as plain relative names
    (CorruptWeightsError naming `name` otherwise)."""
    return sorted(set(parse_index(data, name=name).values()))


@dataclass(frozen=True)
class FolderFiles:
    """The files of a model folder that serving uses, as `model_folder_files` chose them."""

    optional: tuple[str, ...]  # the optional files the folder has
    weights: str  # the weights' entry: INDEX_FILE (then the shards it names) or SINGLE_WEIGHTS_FILE


def weights_file(listing: Iterable[str], where: str) -> str:
    """The weights' entry of a folder from its file names: the index, else model.safetensors
    (SourceNotFoundError naming `where` otherwise)."""
    names = set(listing)
    for candidate in WEIGHTS_FILES:
        if candidate in names:
            return candidate
    raise SourceNotFoundError(where, f"no {_WEIGHTS}")


def model_folder_files(listing: Iterable[str], where: str) -> FolderFiles:
    """Which files of a folder, given its file names (relative to it), make the model; the one rule for
    every source. SourceNotFoundError naming `where` and all that is missing otherwise."""
    names = set(listing)
    missing = [name for name in REQUIRED_FILES if name not in names]
    if not any(name in names for name in WEIGHTS_FILES):
        missing.append(_WEIGHTS)
    if missing:
        raise SourceNotFoundError(where, f"not a model folder: no {', no '.join(missing)}")
    return FolderFiles(tuple(n for n in OPTIONAL_FILES if n in names), weights_file(names, where))


def local_listing(folder: Path) -> list[str]:
    """The names of the files in `folder` (links to files included); none when it does not exist."""
    try:
        with os.scandir(folder) as entries:
            return [entry.name for entry in entries if entry.is_file()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    except PermissionError:
        raise WeightError(str(folder), "cannot list the folder: permission denied") from None


def local_model_folder(folder: Path) -> FolderFiles:
    """`model_folder_files` of a folder on disk; a folder that does not exist gets a hint."""
    try:
        return model_folder_files(local_listing(folder), str(folder))
    except SourceNotFoundError as exc:
        if folder.exists():
            raise
        hint = " (the folder does not exist"
        if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*", str(folder)):
            hint += f"; for the Hugging Face Hub write hf://{folder}"
        raise SourceNotFoundError(exc.where, exc.message + hint + ")") from None


def local_weights(folder: Path) -> File:
    """The weights' entry of a folder on disk (see `weights_file`), as a File."""
    return File(folder / weights_file(local_listing(folder), str(folder)))


@dataclass(frozen=True)
class ModelFiles:
    """A model resolved for serving (ferrum.weights.locations.uri.resolve_model): `folder` is a local folder
    with its config.json, tokenizer files (and index, if sharded); `weights` the source of its
    weights, model.safetensors, the index or a GGUF file: a local File, or the remote object itself (S3 or a
    URL not yet in the cache), which the WeightLoader streams onto the device while writing the
    verified cache. `complete`: the weights are local too (in `folder`; a GGUF file's in its place
    or its cache)."""

    location: ModelLocation  # where the model lives
    folder: Path
    weights: File | S3 | Url
    complete: bool

    @property
    def display(self) -> str:
        return self.location.display
