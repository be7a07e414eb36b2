"""Which files make a model folder that `ferrum serve` can run, whatever the source, and
`ModelFiles`: a resolved model, ready to load.

required    config.json, tokenizer.json
optional    tokenizer_config.json, generation_config.json, chat_template.jinja,
            special_tokens_map.json
weights     model.safetensors.index.json and the shards its weight_map names, else
            model.safetensors, else (a local folder) its only *.safetensors file
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ferrum.weights.errors import SourceNotFoundError
from ferrum.weights.formats import parse_index
from ferrum.weights.sources import File

if TYPE_CHECKING:
    from ferrum.weights.sources import WeightSource

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "OPTIONAL_FILES",
    "REQUIRED_FILES",
    "SINGLE_WEIGHTS_FILE",
    "TOKENIZER_FILE",
    "ModelFiles",
    "local_weights",
    "shards_of_index",
]

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
REQUIRED_FILES: tuple[str, ...] = (CONFIG_FILE, TOKENIZER_FILE)
OPTIONAL_FILES: tuple[str, ...] = (
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"


def shards_of_index(data: bytes, *, name: str) -> list[str]:
    """The shard file names an index lists, each once, sorted; validated as plain relative names
    (CorruptWeightsError naming `name` otherwise)."""
    return sorted(set(parse_index(data, name=name).values()))


def local_weights(folder: Path) -> File:
    """The weights of a local model folder: its index, else model.safetensors, else its only
    *.safetensors file (SourceNotFoundError naming the folder otherwise)."""
    for candidate in (INDEX_FILE, SINGLE_WEIGHTS_FILE):
        if (folder / candidate).is_file():
            return File(folder / candidate)
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return File(found[0])
    raise SourceNotFoundError(
        str(folder),
        f"model folder has no {INDEX_FILE} nor {SINGLE_WEIGHTS_FILE}"
        + (f" (and {len(found)} *.safetensors files)" if found else ""),
    )


@dataclass(frozen=True)
class ModelFiles:
    """A model resolved for serving (ferrum.weights.uri.resolve_model): `folder` is a local folder
    with its config.json, tokenizer files (and index, if sharded); `weights` the source of its
    weights, model.safetensors or the index: a local File, or the remote object itself (S3 or a
    URL not yet in the cache), which the WeightLoader streams onto the device while writing the
    verified cache. `complete`: `folder` holds the weights too."""

    location: WeightSource  # where the model lives: a folder source (ferrum.weights.uri)
    folder: Path
    weights: WeightSource
    complete: bool

    @property
    def display(self) -> str:
        return self.location.display
