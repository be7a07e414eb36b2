"""Build a model from an HF folder: config.json plus safetensors (one file or shards)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open
from safetensors import SafetensorError

from ferrum.weights.dtypes import as_dtype
from ferrum.weights.errors import CorruptWeightsError, WeightError
from ferrum.weights.safetensors_header import read_header

from ferrum.models.config import ModelConfig, load_model_config
from ferrum.models.layers import RotaryEmbedding
from ferrum.models.llama import LlamaForCausalLM


class WeightsError(WeightError, ValueError):
    """Weights missing or not matching the model's config; names the file."""


log = logging.getLogger(__name__)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CorruptWeightsError(str(index), f"not a valid safetensors index ({exc})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise WeightsError(str(index), f"shards listed but missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise WeightsError(str(folder), "no model.safetensors, model.safetensors.index.json or *.safetensors found")


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    for path in safetensors_files(folder):
        read_header(path)  # untrusted input: sizes, offsets and dtypes checked before mapping it
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name), path
        except SafetensorError as exc:
            raise CorruptWeightsError(str(path), f"corrupt or unreadable safetensors file: {exc}") from None


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes lie in a local SafeTensors file (header already validated)."""

    file: BinaryIO
    path: Path
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self) -> torch.Tensor:
        data = bytearray(self.nbytes)
        self.file.seek(self.offset)
        if self.file.readinto(data) != self.nbytes:
            raise CorruptWeightsError(str(self.path), f"the file ends inside a tensor at byte {self.offset}")
        return torch.frombuffer(data, dtype=self.dtype).view(self.shape) if self.nbytes else torch.empty(self.shape)


def iter_stored_tensors(folder: Path) -> Iterator[tuple[str, StoredTensor, Path]]:
    for path in safetensors_files(folder):
        header = read_header(path)  # untrusted input: sizes, offsets and dtypes checked first
        with open(path, "rb", buffering=0) as f:
            for name, entry in header.tensors.items():
                start, end = header.file_range(name)
                yield name, StoredTensor(f, path, start, end - start, entry.shape, as_dtype(entry.dtype)), path


class DeviceUploader:
    """File bytes to GPU tensors through two pinned buffers in turn: the file is read straight into
    one (no intermediate host tensor) while the other's asynchronous upload runs."""

    def __init__(self, device: torch.device, size: int = 128 << 20) -> None:
        self.buffers = [torch.empty(size, dtype=torch.uint8).pin_memory() for _ in range(2)]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.done = [torch.cuda.Event(), torch.cuda.Event()]
        self.stream = torch.cuda.Stream(device)
        self.turn = 0

    def upload(self, dest: torch.Tensor, stored: StoredTensor) -> None:
        if stored.dtype != dest.dtype or not dest.is_contiguous():
            dest.copy_(stored.read())  # a cast on the way: through a host tensor
            return
        out = dest.view(-1).view(torch.uint8)
        stored.file.seek(stored.offset)
        done = 0
        while done < stored.nbytes:
            n = min(self.buffers[0].numel(), stored.nbytes - done)
            i = self.turn
            self.turn ^= 1
            self.done[i].synchronize()  # the upload that last used this buffer has finished
            got = 0
            while got < n:
                k = stored.file.readinto(self.views[i][got:n])
                if not k:
                    raise CorruptWeightsError(str(stored.path), f"the file ends inside a tensor at byte {stored.offset}")
                got += k
            with torch.cuda.stream(self.stream):
                out[done : done + n].copy_(self.buffers[i][:n], non_blocking=True)
                self.done[i].record(self.stream)
            done += n

    def finish(self) -> None:
        self.stream.synchronize()


def load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    params = dict(model.named_parameters())
    expected = set(params)
    loaded: set[str] = set()
    device = next(iter(params.values())).device
    uploader = DeviceUploader(device) if device.type == "cuda" else None
    source = iter_stored_tensors(folder) if uploader is not None else iter_checkpoint(folder)
    with torch.no_grad():
        for hf_name, tensor, path in source:
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            if "rotary_emb" in name:
                continue
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 2 and parts[-2] in model.FUSED:
                fused, shard = model.FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            param = params.get(target)
            if param is None:
                raise WeightsError(str(path), f"tensor {hf_name!r} does not belong to {model.config.architecture}")
            dest = param.data
            if shard is not None:
                offsets = model.shard_offsets(target.split(".")[-2])
                dest = dest[offsets[shard] : offsets[shard + 1]]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise WeightsError(
                    str(path),
                    f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, config.json implies {tuple(dest.shape)}",
                )
            if isinstance(tensor, StoredTensor):
                assert uploader is not None
                uploader.upload(dest, tensor)
            else:
                dest.copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
    if uploader is not None:
        uploader.finish()
    required: set[str] = set()
    for name in expected:
        fused = name.split(".")[-2] if "." in name else ""
        if fused in ("qkv_proj", "gate_up_proj"):
            n = 3 if fused == "qkv_proj" else 2
            required.update(f"{name}#{i}" for i in range(n))
        else:
            required.add(name)
    if model.config.tie_word_embeddings:
        required.discard("lm_head.weight")
    missing = sorted(required - loaded)
    if missing:
        shown = ", ".join(m.replace("#", " shard ") for m in missing[:5])
        raise WeightsError(str(folder), f"{len(missing)} weights missing from the checkpoint, e.g. {shown}")


def load_model(folder: str | Path, dtype: torch.dtype, device: str = "cpu") -> tuple[LlamaForCausalLM, ModelConfig]:
    folder = Path(folder)
    config = load_model_config(folder)
    started = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device=device)  # allocated once, in the target dtype
    # the rope tables were built on meta: build them for real, in float32
    model.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings).to(device)
    load_weights(model, folder)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval()
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.synchronize(model.embed_tokens.weight.device)
    elapsed = time.perf_counter() - started
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info("loaded %.2f GB of weights to %s in %.2fs (%.2f GB/s)", nbytes / 1e9, device, elapsed, nbytes / 1e9 / elapsed)
    return model, config

