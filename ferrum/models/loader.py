"""Build a model from an HF folder: config.json plus safetensors (one file or shards)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors import SafetensorError

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


class _PinnedStaging:
    """Copies host tensors to a GPU through two pinned buffers in turn: the next tensor's host copy
    (parallel memcpy out of the page cache) overlaps the previous one's asynchronous upload, where a
    plain copy from pageable memory would stage through the driver one piece at a time."""

    def __init__(self, device: torch.device, size: int = 256 << 20) -> None:
        self.buffers = [torch.empty(size, dtype=torch.uint8).pin_memory() for _ in range(2)]
        self.done = [torch.cuda.Event(), torch.cuda.Event()]
        self.stream = torch.cuda.Stream(device)
        self.turn = 0

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        nbytes = src.numel() * src.element_size()
        if nbytes > self.buffers[0].numel() or not dest.is_contiguous() or src.dtype != dest.dtype:
            dest.copy_(src)
            return
        i = self.turn
        self.turn ^= 1
        self.done[i].synchronize()  # the upload that last used this buffer has finished
        staged = self.buffers[i][:nbytes].view(src.dtype).view(src.shape)
        staged.copy_(src)
        with torch.cuda.stream(self.stream):
            dest.copy_(staged, non_blocking=True)
            self.done[i].record(self.stream)

    def finish(self) -> None:
        self.stream.synchronize()


def load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    params = dict(model.named_parameters())
    expected = set(params)
    loaded: set[str] = set()
    device = next(iter(params.values())).device
    staging = _PinnedStaging(device) if device.type == "cuda" else None
    with torch.no_grad():
        for hf_name, tensor, path in iter_checkpoint(folder):
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
            if staging is not None:
                staging.copy(dest, tensor)
            else:
                dest.copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
    if staging is not None:
        staging.finish()
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

