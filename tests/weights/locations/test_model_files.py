"""Which files make a model folder: one verdict and one message, whether the names come from a folder on
disk or from a listing (a Hub repository's files, the names an S3 prefix or a URL folder answered for)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ferrum.weights.errors import SourceNotFoundError
from ferrum.weights.locations.model_files import FolderFiles, local_model_folder, model_folder_files

SMALL = ["config.json", "tokenizer.json", "tokenizer_config.json"]
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def verdict(run: Callable[[], FolderFiles]) -> FolderFiles | str:
    """The folder's files, or the message that refuses it (without where it is)."""
    try:
        return run()
    except SourceNotFoundError as exc:
        return exc.message


@pytest.mark.parametrize(
    "names",
    [
        [*SMALL, "model.safetensors"],
        [*SMALL, "model.safetensors.index.json", *SHARDS, "model.safetensors"],  # the index wins
        [*SMALL, *SHARDS],  # shards and no index: refused on disk and on the Hub alike
        [*SMALL, "weights.safetensors"],  # a lone other name: not a model's weights (as transformers)
        ["config.json", "model.safetensors"],
        [],
    ],
    ids=["single", "sharded", "shards-no-index", "other-name", "no-tokenizer", "empty"],
)
def test_disk_and_a_listing_get_one_verdict(tmp_path: Path, names: list[str]) -> None:
    for name in names:
        (tmp_path / name).write_bytes(b"{}")
    (tmp_path / "extra").mkdir()  # a folder is not a file of the model
    on_disk = verdict(lambda: local_model_folder(tmp_path))
    listed = verdict(lambda: model_folder_files(names, "hf://org/name"))
    assert on_disk == listed
    if isinstance(listed, str):
        assert listed.startswith("not a model folder: no ")
    else:
        assert listed.optional == ("tokenizer_config.json",)


def test_every_missing_part_is_named_once(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError) as info:
        model_folder_files(["tokenizer.json"], "s3://bucket/m/")
    assert str(info.value) == (
        "s3://bucket/m/: not a model folder: no config.json, "
        "no weights (model.safetensors.index.json or model.safetensors)"
    )
    with pytest.raises(SourceNotFoundError) as info:
        local_model_folder(tmp_path / "org" / "missing")
    assert "no config.json" in str(info.value) and "the folder does not exist" in str(info.value)
