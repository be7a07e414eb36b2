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


def iter_checkpoint(folder: Path, device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Every tensor of the checkpoint; on a GPU, safetensors puts each on the device itself (its
    upload is about three times faster than copying a host tensor across)."""
    target = str(device) if device is not None and device.type == "cuda" else "cpu"
    for path in safetensors_files(folder):
        read_header(path)  # untrusted input: sizes, offsets and dtypes checked before mapping it
        try:
            with safe_open(str(path), framework="pt", device=target) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name), path
        except SafetensorError as exc:
            raise CorruptWeightsError(str(path), f"corrupt or unreadable safetensors file: {exc}") from None


def load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    params = dict(model.named_parameters())
    expected = set(params)
    loaded: set[str] = set()
    device = next(iter(params.values())).device
    with torch.no_grad():
        for hf_name, tensor, path in iter_checkpoint(folder, device):
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
            dest.copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
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
    on_gpu = model.embed_tokens.weight.is_cuda
    if on_gpu:
        torch.cuda.synchronize(model.embed_tokens.weight.device)
    reading = time.perf_counter()
    load_weights(model, folder)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval()
    if on_gpu:
        torch.cuda.synchronize(model.embed_tokens.weight.device)
    done = time.perf_counter()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info("loaded %.2f GB of weights to %s in %.2fs (%.2f GB/s; model set-up before them %.2fs)",
             nbytes / 1e9, device, done - reading, nbytes / 1e9 / (done - reading), reading - started)
    return model, config

