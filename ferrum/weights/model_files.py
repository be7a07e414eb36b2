"""Which files make a model folder that `ferrum serve` can run, whatever the source.

required    config.json, tokenizer.json
optional    tokenizer_config.json, generation_config.json, chat_template.jinja,
            special_tokens_map.json
weights     model.safetensors.index.json and the shards its weight_map names, else
            model.safetensors
"""

from __future__ import annotations

from ferrum.weights.formats import parse_index

__all__ = ["INDEX_FILE", "OPTIONAL_FILES", "REQUIRED_FILES", "SINGLE_WEIGHTS_FILE", "shards_of_index"]

REQUIRED_FILES: tuple[str, ...] = ("config.json", "tokenizer.json")
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
