"""Writes tests/data/quantized/: tiny quantized checkpoints made by the real quantization tools, each beside the
tool's own dequantized reference, so that Ferrum's loaders are checked against the tools without CI installing them.

    python scripts/make_quantized_fixtures.py [--out tests/data/quantized] [--venvs /tmp/ferrum-quant-venvs]
                                              [--only NAME ...]

The driver (any Python 3.11) makes two virtual environments under --venvs, torch==2.13.0 installed first in each
(pinned: pip takes the CPU build this machine holds; a bare `torch` pulls the CUDA wheels), then the tools, and runs
this file inside them, one process per fixture (`--stage NAME`):

  gptqmodel      gptqmodel 7.6.0 (GPTQ; AWQ in AutoAWQ's GEMM layout), transformers 5.24.0 (its FineGrainedFP8
                 quantizer), autoawq 0.2.9 without its dependencies (only awq/utils/packing_utils.py is loaded: the
                 AWQ reference dequantization, checked equal to gptqmodel's)
  llmcompressor  llmcompressor 0.14.0.1 with what it pins: transformers 5.17.0, compressed-tensors 0.19.0

Every fixture quantizes one tiny Llama (base/: vocab 128, hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads,
untied embeddings; weights normal(0, 0.08) from seed 0, norm weights 1 + normal(0, 0.08), every value exact in both
bfloat16 and float16), calibrated on 16 random sequences of 32 tokens (seed 1). Each folder holds the checkpoint as
the tool wrote it (config.json with its quantization_config, quantize_config.json where the tool writes one,
model.safetensors) and reference.safetensors:

  input_ids            int64 [1, 16], the same in every fixture (seed 2, BOS first)
  <linear>.weight      float32 [out, in]: the tool's own dequantization of each quantized linear of layer 0
                       (REFERENCE_LAYERS), named like the HF weight, computed from the checkpoint's tensors with
                       their scales widened to float32 (exact)
  logits               float32 [1, 16, 128]: the tool's own forward of the quantized checkpoint on the CPU (absent
                       where no tool runs the format on a CPU)
  logits_dequantized   float32 [1, 16, 128]: transformers' Llama in float32 with the tool-dequantized weights and
                       the checkpoint's unquantized tensors (weights only: no activation quantization)

Its safetensors metadata has one key, "reference": a JSON object saying which tool and versions wrote the fixture
and how each reference was computed (one key: safetensors writes several in a random order). Reruns write the
same bytes.

Where this file quantizes or dequantizes itself instead of calling a tool, the function says so (only fp8-tensor-
static: no tool that writes AutoFP8's format installs here). The README beside the fixtures is written from the same
table.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

TORCH = "torch==2.13.0"
VENVS: dict[str, tuple[tuple[str, ...], ...]] = {
    # each inner tuple is one `pip install`, in order
    "gptqmodel": (("gptqmodel==7.6.0", "transformers==5.24.0"), ("--no-deps", "autoawq==0.2.9")),
    "llmcompressor": (("llmcompressor==0.14.0.1", "transformers==5.17.0", "compressed-tensors==0.19.0"),),
}
VERSIONED = ("torch", "transformers", "gptqmodel", "autoawq", "llmcompressor", "compressed-tensors", "safetensors")

MODEL: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
SEED, CALIBRATION_SEED, INPUT_SEED = 0, 1, 2
SPREAD = 0.08
CALIBRATION_ROWS, CALIBRATION_TOKENS, INPUT_TOKENS = 16, 32, 16
FIRST_TOKEN = 3  # 0-2 are <unk>, <s>, </s>
LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)
CHECKPOINT_FILES = ("config.json", "quantize_config.json", "model.safetensors")
# the layers whose dequantized weights reference.safetensors keeps (every layer's go into logits_dequantized):
# layer 0 has every projection kind, and all of them would double the fixtures' size
REFERENCE_LAYERS = (0,)


@dataclass(frozen=True)
class Fixture:
    name: str
    venv: str  # a key of VENVS
    writer: str  # a key of WRITERS
    summary: str  # one line for the README
    params: dict[str, Any] = field(default_factory=dict)


def _w4(group_size: int, symmetric: bool) -> dict[str, Any]:
    return {"num_bits": 4, "type": "int", "symmetric": symmetric, "group_size": group_size if group_size > 0 else None,
            "strategy": "group" if group_size > 0 else "channel"}


FIXTURES: tuple[Fixture, ...] = (
    Fixture("gptq-w4-g32-sym", "gptqmodel", "gptqmodel", "GPTQ 4-bit, group 32, symmetric (checkpoint_format gptq)",
            {"bits": 4, "group_size": 32, "sym": True, "desc_act": False}),
    Fixture("gptq-w4-g32-asym-descact", "gptqmodel", "gptqmodel",
            "GPTQ 4-bit, group 32, asymmetric, desc_act (a permuted g_idx)",
            {"bits": 4, "group_size": 32, "sym": False, "desc_act": True, "act_group_aware": False}),
    Fixture("gptq-w4-channel", "gptqmodel", "gptqmodel", "GPTQ 4-bit, group_size -1 (one scale per output channel)",
            {"bits": 4, "group_size": -1, "sym": True, "desc_act": False, "act_group_aware": False}),
    Fixture("gptq-w8-g32", "gptqmodel", "gptqmodel", "GPTQ 8-bit, group 32, symmetric",
            {"bits": 8, "group_size": 32, "sym": True, "desc_act": False}),
    Fixture("gptq-w4-g32-asym-v2", "gptqmodel", "gptqmodel",
            "GPTQ 4-bit, group 32, asymmetric, checkpoint_format gptq_v2 (zeros stored without the -1)",
            {"bits": 4, "group_size": 32, "sym": False, "desc_act": False, "format": "gptq_v2"}),
    Fixture("awq-w4-g32-gemm", "gptqmodel", "gptqmodel",
            "AWQ 4-bit, group 32, zero points, GEMM layout (AutoAWQ's packing; clipping search off, see below)",
            {"bits": 4, "group_size": 32, "sym": False, "method": "awq", "format": "gemm"}),
    Fixture("fp8-block32", "gptqmodel", "transformers-fp8",
            "quant_method fp8, weight_block_size [32, 32], weight_scale_inv per block, dynamic activations",
            {"weight_block_size": [32, 32], "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head"]}),
    Fixture("fp8-tensor-static", "gptqmodel", "autofp8-format",
            "quant_method fp8, per-tensor weight_scale and static input_scale (AutoFP8's format, vLLM's `fp8`)"),
    Fixture("ct-w4a16-g32", "llmcompressor", "llmcompressor",
            "compressed-tensors pack-quantized W4A16, group 32, symmetric (GPTQ)",
            {"modifier": "gptq", "config_groups": {"group_0": {"targets": ["Linear"], "weights": _w4(32, True)}},
             "ignore": ["lm_head"]}),
    Fixture("ct-w4a16-g32-asym-ignore", "llmcompressor", "llmcompressor",
            "pack-quantized W4A16, group 32, asymmetric (weight_zero_point), ignore lm_head and layer 0's down_proj",
            {"modifier": "gptq", "config_groups": {"group_0": {"targets": ["Linear"], "weights": _w4(32, False)}},
             "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}),
    Fixture("ct-w4a16-channel", "llmcompressor", "llmcompressor",
            "pack-quantized W4A16, channel-wise scales, symmetric (GPTQ)",
            {"modifier": "gptq", "config_groups": {"group_0": {"targets": ["Linear"], "weights": _w4(-1, True)}},
             "ignore": ["lm_head"]}),
    Fixture("ct-w8a8-int8", "llmcompressor", "llmcompressor",
            "int-quantized W8A8: int8 channel-wise weights, dynamic per-token int8 activations",
            {"modifier": "rtn", "scheme": "W8A8", "ignore": ["lm_head"]}),
    Fixture("ct-fp8-dynamic", "llmcompressor", "llmcompressor",
            "float-quantized FP8: channel-wise weight scales, dynamic per-token activations (FP8_DYNAMIC)",
            {"modifier": "rtn", "scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}),
    Fixture("ct-fp8-static-kv", "llmcompressor", "llmcompressor",
            "float-quantized FP8: per-tensor weight scales, static per-tensor input_scale, FP8 kv_cache_scheme "
            "(k_scale, v_scale)",
            {"modifier": "rtn", "scheme": "FP8", "ignore": ["lm_head"],
             "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                 "symmetric": True}}),
)


# ---------------------------------------------------------------- shared by every stage (torch + transformers)


def calibration_ids() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    rows = torch.randint(FIRST_TOKEN, MODEL["vocab_size"], (CALIBRATION_ROWS, CALIBRATION_TOKENS), generator=gen)
    return [row.tolist() for row in rows]


def input_ids() -> Any:
    import torch

    gen = torch.Generator().manual_seed(INPUT_SEED)
    rest = torch.randint(FIRST_TOKEN, MODEL["vocab_size"], (INPUT_TOKENS - 1,), generator=gen)
    return torch.cat([torch.tensor([MODEL["bos_token_id"]]), rest]).unsqueeze(0)


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def load_tensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def linear_names() -> list[str]:
    return [f"model.layers.{i}.{linear}" for i in range(MODEL["num_hidden_layers"]) for linear in LINEARS]


def dequantized_logits(folder: Path, dequantized: dict[str, Any]) -> Any:
    """transformers' Llama in float32 with `dequantized` (HF weight name -> float32 [out, in]) and the checkpoint's
    unquantized tensors: the weights-only reference forward of `input_ids()`."""
    import torch
    import transformers

    settings = json.loads((folder / "config.json").read_text())
    settings.pop("quantization_config", None)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(settings)).float().eval()
    stored = load_tensors(folder)
    plain = (torch.float16, torch.bfloat16, torch.float32)
    state = {}
    for name in model.state_dict():
        if name in dequantized:
            state[name] = dequantized[name].float()
        elif name in stored and stored[name].dtype in plain:
            state[name] = stored[name].float()
        else:
            raise SystemExit(f"{folder}: neither a dequantized weight nor an unquantized tensor for {name}")
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(input_ids=input_ids()).logits.float()


def write_reference(folder: Path, dequantized: dict[str, Any], logits: Any | None, logits_note: str,
                    dequant_note: str, tool: str) -> None:
    """reference.safetensors beside the checkpoint (see the module docstring): `dequantized` maps each quantized
    linear's module name to its float32 [out, in] weight."""
    import torch
    from safetensors.torch import save_file

    for name, weight in dequantized.items():
        if weight.dtype != torch.float32 or not torch.isfinite(weight).all():
            raise SystemExit(f"{folder.name}: dequantized {name} is {weight.dtype} or not finite")
    weights = {f"{name}.weight": weight.contiguous() for name, weight in dequantized.items()}
    kept = tuple(f"model.layers.{i}." for i in REFERENCE_LAYERS)
    tensors = {"input_ids": input_ids().to(torch.int64)} | {k: w for k, w in weights.items() if k.startswith(kept)}
    if logits is not None:
        tensors["logits"] = logits.float().contiguous()
    tensors["logits_dequantized"] = dequantized_logits(folder, weights)
    about = {"tool": tool, "versions": versions(), "logits": logits_note, "dequantized": dequant_note,
             "logits_dequantized": "transformers LlamaForCausalLM, float32, tool-dequantized weights"}
    save_file(tensors, str(folder / "reference.safetensors"), metadata=reference_metadata(about))


def reference_metadata(about: dict[str, Any]) -> dict[str, str]:
    return {"reference": json.dumps(about, sort_keys=True)}


def copy_checkpoint(source: Path, destination: Path) -> None:
    """The tool's config.json, quantize_config.json (if written) and model.safetensors, as written."""
    if destination.exists():
        shutil.rmtree(destination)
    destination.mkdir(parents=True)
    for file in CHECKPOINT_FILES:
        if (source / file).exists():
            shutil.copyfile(source / file, destination / file)
    if not (destination / "model.safetensors").exists():
        raise SystemExit(f"{source}: the tool wrote no single model.safetensors")


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer ("t<id>") over the 128 ids: gptqmodel loads one beside the model; no fixture keeps it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(FIRST_TOKEN, MODEL["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="</s>").save_pretrained(str(folder))


# ---------------------------------------------------------------- the base model


def write_base(work: Path, out: Path) -> None:
    """base/ (bfloat16, committed: the unquantized source of every fixture, with its float32 logits) and the
    float16 and bfloat16 copies the tools start from (same values: each is exact in both dtypes)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).float().eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            values = torch.randn(parameter.shape, generator=gen) * SPREAD
            if name.endswith("norm.weight"):
                values += 1.0
            values = values.to(torch.bfloat16)
            values[values.abs() < 2**-14] = 0  # below float16's normal range a bfloat16 value may not be exact
            if not torch.equal(values.to(torch.float16).to(torch.bfloat16), values):
                raise SystemExit(f"base: {name} is not exact in float16")
            parameter.copy_(values.float())
    with torch.no_grad():
        logits = model(input_ids=input_ids()).logits.float()
    for dtype, folder in ((torch.bfloat16, work / "base-bf16"), (torch.float16, work / "base-fp16")):
        if folder.exists():
            shutil.rmtree(folder)
        model.to(dtype).save_pretrained(str(folder))
        write_tokenizer(folder)
    copy_checkpoint(work / "base-bf16", out / "base")
    save_file({"input_ids": input_ids(), "logits": logits.contiguous()}, str(out / "base" / "reference.safetensors"),
              metadata=reference_metadata({"tool": "none (unquantized)", "versions": versions(),
                                           "logits": "transformers LlamaForCausalLM, float32"}))


# ---------------------------------------------------------------- gptqmodel: GPTQ and AWQ


def write_gptqmodel(fixture: Fixture, work: Path, out: Path) -> None:
    # gptqmodel's CPU pool has (cores + 1) // 2 workers and asks 2 of them for its model loader: 2 cores give 1
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    import torch
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig  # type: ignore[import-not-found]

    awq = fixture.params.get("method") == "awq"
    if awq:
        from gptqmodel.looper.awq_processor import AWQProcessor  # type: ignore[import-not-found]

        # AWQ's clipping search batches output channels by 64 (asserted), and k_proj/v_proj have 32: off, as
        # AutoAWQ's own `apply_clip=False` turns it off; the scale search and the packing are unchanged.
        init = AWQProcessor.__init__

        def init_without_clip(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.apply_clip = False

        AWQProcessor.__init__ = init_without_clip
    backend = BACKEND.AWQ_TORCH if awq else BACKEND.GPTQ_TORCH
    config = QuantizeConfig(offload_to_disk=False, device="cpu", **fixture.params)
    model = GPTQModel.load(str(work / "base-fp16"), config, dtype=torch.float16)
    calibration = [{"input_ids": row, "attention_mask": [1] * len(row)} for row in calibration_ids()]
    model.quantize(calibration, batch_size=1, backend=backend)
    tool_dir = work / fixture.name
    if tool_dir.exists():
        shutil.rmtree(tool_dir)
    model.save(str(tool_dir))
    del model
    copy_checkpoint(tool_dir, out / fixture.name)

    loaded = GPTQModel.load(str(tool_dir), backend=backend, device="cpu", dtype=torch.float16)
    with torch.no_grad():
        logits = loaded.model(input_ids=input_ids()).logits.float()
    note = f"gptqmodel {backend.value} kernel (TorchLinear family), float16 on the CPU"
    if awq:
        dequantized = awq_dequantized(out / fixture.name, fixture.params["bits"], fixture.params["group_size"])
        how = ("AutoAWQ's awq.utils.packing_utils.dequantize_gemm (autoawq 0.2.9), equal to gptqmodel's "
               "quantization.awq.utils.packing_utils.dequantize_gemm; scales widened to float32")
    else:
        from gptqmodel.nn_modules.qlinear import PackableQuantLinear  # type: ignore[import-not-found]

        dequantized = {}
        for name, module in loaded.model.named_modules():
            if isinstance(module, PackableQuantLinear):
                module.scales = module.scales.float()  # exact: the products then need no float16 rounding
                # the class's own unpack-and-scale (the subclass wraps it in torch.compile)
                dequantized[name] = PackableQuantLinear.dequantize_weight(module).T.float().contiguous()
        how = "gptqmodel PackableQuantLinear.dequantize_weight of the loaded checkpoint, scales widened to float32"
    write_reference(out / fixture.name, dequantized, logits, note, how, f"gptqmodel {versions()['gptqmodel']}")


def awq_dequantized(folder: Path, bits: int, group_size: int) -> dict[str, Any]:
    import torch
    from gptqmodel.quantization.awq.utils import packing_utils as gptqmodel_awq  # type: ignore[import-not-found]

    autoawq = _autoawq_packing_utils()
    tensors = load_tensors(folder)
    dequantized = {}
    for name in linear_names():
        parts = [tensors[f"{name}.{part}"] for part in ("qweight", "qzeros", "scales")]
        qweight, qzeros, scales = parts[0], parts[1], parts[2].float()
        reference = autoawq.dequantize_gemm(qweight, qzeros, scales, bits, group_size)
        theirs = gptqmodel_awq.dequantize_gemm(qweight, qzeros, scales, bits, group_size)
        if not torch.equal(reference, theirs):
            raise SystemExit(f"{folder.name}: {name}: AutoAWQ's and gptqmodel's AWQ dequantization differ")
        dequantized[name] = reference.T.float().contiguous()  # [in, out] -> the HF weight's [out, in]
    return dequantized


def _autoawq_packing_utils() -> Any:
    """autoawq's awq/utils/packing_utils.py alone (plain torch): `import awq` pulls its CUDA-era dependencies."""
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("autoawq is not installed in this environment")
    path = Path(next(iter(spec.submodule_search_locations))) / "utils" / "packing_utils.py"
    module_spec = importlib.util.spec_from_file_location("autoawq_packing_utils", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- quant_method fp8


def write_transformers_fp8(fixture: Fixture, work: Path, out: Path) -> None:
    """transformers' FineGrainedFP8 quantizer (its Fp8Quantize: plain torch) quantizes on load, save_pretrained
    writes the checkpoint. Its environment check refuses a machine without a GPU, so it is bypassed for the write."""
    import torch
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    check = FineGrainedFP8HfQuantizer.validate_environment
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    try:
        model = AutoModelForCausalLM.from_pretrained(str(work / "base-bf16"), dtype=torch.bfloat16,
                                                     quantization_config=FineGrainedFP8Config(**fixture.params))
        tool_dir = work / fixture.name
        if tool_dir.exists():
            shutil.rmtree(tool_dir)
        model.save_pretrained(str(tool_dir))
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = check  # type: ignore[method-assign]
    copy_checkpoint(tool_dir, out / fixture.name)

    tensors = load_tensors(out / fixture.name)
    dequantize = Fp8Dequantize(hf_quantizer=None)
    dequantized = {}
    for name in linear_names():
        weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"]
        dequantized[name] = dequantize._dequantize_one(weight, scale, output_dtype=torch.float32)
    # without a GPU, transformers loads an FP8 checkpoint dequantized (Fp8Dequantize into the model's dtype)
    loaded = AutoModelForCausalLM.from_pretrained(str(out / fixture.name), dtype=torch.float32)
    with torch.no_grad():
        logits = loaded(input_ids=input_ids()).logits.float()
    write_reference(out / fixture.name, dequantized, logits,
                    "transformers on the CPU: FineGrainedFP8 dequantizes on load (float32), no activation quantization",
                    "transformers.integrations.finegrained_fp8.Fp8Dequantize._dequantize_one, float32 output",
                    f"transformers {versions()['transformers']} FineGrainedFP8")


def write_autofp8_format(fixture: Fixture, work: Path, out: Path) -> None:
    """Written by THIS FILE, not a tool: AutoFP8 (the writer of this format, deprecated) is not on PyPI, and
    neither transformers nor llm-compressor writes it. The format and the arithmetic follow AutoFP8's README
    ("Checkpoint structure explanation") and auto_fp8/quantize.py (github.com/neuralmagic/AutoFP8, commit 505a7ed):
    per tensor, scale = finfo(e4m3).max / amax(w) in the model's dtype, weight = clamp(w * scale).to(e4m3),
    weight_scale = 1 / scale (float32); input_scale = the largest amax(x) / finfo.max over the calibration rows,
    fed one at a time through the model whose linears already run FP8 (its FP8StaticLinearQuantizer); lm_head is
    left out (ignored_layers). The reference dequantization (weight * weight_scale) is this file's too; no tool
    runs the format on a CPU (vLLM needs a GPU), so there are no tool logits."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    finfo = torch.finfo(torch.float8_e4m3fn)

    def per_tensor(x: Any) -> tuple[Any, Any]:
        low, high = x.aminmax()
        scale = finfo.max / torch.maximum(low.abs(), high.abs()).clamp(min=1e-12)
        return (x * scale).clamp(min=finfo.min, max=finfo.max).to(torch.float8_e4m3fn), scale.float().reciprocal()

    class Calibrating(torch.nn.Module):
        def __init__(self, linear: torch.nn.Linear) -> None:
            super().__init__()
            self.weight, self.weight_scale = per_tensor(linear.weight.detach())
            self.input_scale: Any = None

        def forward(self, x: Any) -> Any:
            q, scale = per_tensor(x)
            self.input_scale = scale if self.input_scale is None else torch.maximum(self.input_scale, scale)
            a = q.to(x.dtype) * self.input_scale
            return torch.nn.functional.linear(a, self.weight.to(x.dtype) * self.weight_scale.to(x.dtype))

    model = AutoModelForCausalLM.from_pretrained(str(work / "base-bf16"), dtype=torch.bfloat16).eval()
    quantized: dict[str, Calibrating] = {}
    for name in linear_names():
        parent, child = name.rsplit(".", 1)
        quantized[name] = Calibrating(model.get_submodule(name))
        setattr(model.get_submodule(parent), child, quantized[name])
    with torch.no_grad():
        for row in calibration_ids():
            model(input_ids=torch.tensor([row]))
    tensors = dict(model.state_dict())  # embeddings, norms, lm_head: the Calibrating modules hold no state
    for name, module in quantized.items():
        tensors[f"{name}.weight"] = module.weight
        tensors[f"{name}.weight_scale"] = module.weight_scale.reshape(())
        tensors[f"{name}.input_scale"] = module.input_scale.float().reshape(())
    folder = out / fixture.name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    settings = json.loads((work / "base-bf16" / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static",
                                       "ignored_layers": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    dequantized = {name: m.weight.float() * m.weight_scale.float() for name, m in quantized.items()}
    write_reference(folder, dequantized, None,
                    "absent: no tool runs this format on a CPU (vLLM's fp8 needs a GPU)",
                    "this script: weight.float() * weight_scale (no tool dequantizes this format)",
                    "scripts/make_quantized_fixtures.py after AutoFP8 (neuralmagic/AutoFP8@505a7ed)")


# ---------------------------------------------------------------- llm-compressor: compressed-tensors


def write_llmcompressor(fixture: Fixture, work: Path, out: Path) -> None:
    import torch
    from compressed_tensors.compressors import BaseCompressor  # type: ignore[import-not-found]
    from compressed_tensors.quantization import (  # type: ignore[import-not-found]
        QuantizationConfig,
        apply_quantization_config,
    )
    from datasets import Dataset  # type: ignore[import-not-found]
    from llmcompressor import oneshot  # type: ignore[import-not-found]
    from llmcompressor.modifiers.quantization import (  # type: ignore[import-not-found]
        GPTQModifier,
        QuantizationModifier,
    )
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    params = dict(fixture.params)
    modifier = {"gptq": GPTQModifier, "rtn": QuantizationModifier}[params.pop("modifier")]
    if "scheme" in params:
        params["targets"] = "Linear"
    rows = calibration_ids()
    dataset = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(row) for row in rows]})
    model = AutoModelForCausalLM.from_pretrained(str(work / "base-bf16"), dtype=torch.bfloat16)
    # in order: the KV-cache observer's running average depends on the order of the rows
    oneshot(model=model, dataset=dataset, recipe=modifier(**params), num_calibration_samples=len(rows),
            max_seq_length=CALIBRATION_TOKENS, shuffle_calibration_samples=False)
    tool_dir = work / fixture.name
    if tool_dir.exists():
        shutil.rmtree(tool_dir)
    model.save_pretrained(str(tool_dir), save_compressed=True)
    del model
    copy_checkpoint(tool_dir, out / fixture.name)
    folder = out / fixture.name

    # compressed-tensors' own per-module decompress, on the checkpoint's tensors, its target/ignore matching
    # (apply_quantization_config) deciding which scheme each linear has
    settings = json.loads((folder / "config.json").read_text())
    config = QuantizationConfig.model_validate(settings["quantization_config"])
    skeleton = LlamaForCausalLM(LlamaConfig(**MODEL))
    apply_quantization_config(skeleton, config)
    tensors = load_tensors(folder)
    dequantized = {}
    for name, module in skeleton.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        local = {key[len(name) + 1:]: value for key, value in tensors.items() if key.startswith(name + ".")}
        for key, value in local.items():
            if key.endswith("_scale") and value.dtype in (torch.float16, torch.bfloat16):
                local[key] = value.float()  # exact: the dequantized products then need no bfloat16 rounding
        compressor = BaseCompressor.get_value_from_registry(scheme.format or config.format)
        dequantized[name] = compressor.decompress(local, scheme)["weight"].float()
    # the tool's forward: transformers' compressed-tensors integration decompresses on the CPU and runs the
    # schemes' activation quantization (fake-quantized) in float32
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        logits = loaded(input_ids=input_ids()).logits.float()
    write_reference(folder, dequantized, logits,
                    "transformers' compressed-tensors integration on the CPU, float32, activations fake-quantized "
                    "as the scheme says",
                    "compressed-tensors BaseCompressor.decompress (the config's format) per module, scales widened to "
                    "float32", f"llmcompressor {versions()['llmcompressor']}")


WRITERS: dict[str, Callable[[Fixture, Path, Path], None]] = {
    "gptqmodel": write_gptqmodel,
    "transformers-fp8": write_transformers_fp8,
    "autofp8-format": write_autofp8_format,
    "llmcompressor": write_llmcompressor,
}


# ---------------------------------------------------------------- the driver


def ensure_venv(root: Path, name: str, work: Path) -> Path:
    """root/name with torch (first, pinned) and VENVS[name]; reused while its recorded package list is the same.
    pip's output goes to work/pip-<name>.log."""
    venv = root / name
    python = venv / "bin" / "python"
    wanted = json.dumps([[TORCH], *VENVS[name]])
    marker = venv / "ferrum-fixtures-packages.json"
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    print(f"making the {name} environment in {venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    log = work / f"pip-{name}.log"
    with log.open("w") as sink:
        for packages in ([TORCH], *VENVS[name]):
            done = subprocess.run([str(python), "-m", "pip", "install", *packages], stdout=sink,
                                  stderr=subprocess.STDOUT)
            if done.returncode != 0:
                raise SystemExit(f"pip install {' '.join(packages)} failed in {venv} (see {log})")
    marker.write_text(wanted)
    return python


def run_stage(python: Path, stage: str, work: Path, out: Path) -> None:
    log = work / f"{stage}.log"
    started = time.monotonic()
    with log.open("w") as sink:
        done = subprocess.run([str(python), str(Path(__file__).resolve()), "--stage", stage, "--work", str(work),
                               "--out", str(out)], stdout=sink, stderr=subprocess.STDOUT,
                              env=os.environ | {"PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode != 0:
        tail = log.read_text().splitlines()[-30:]
        raise SystemExit(f"{stage} failed ({log}):\n" + "\n".join(tail))
    folder = out / stage
    size = f"{sum(p.stat().st_size for p in folder.iterdir()) / 1024:.0f} KiB " if folder.is_dir() else ""
    print(f"{stage}: {size}in {time.monotonic() - started:.0f} s", flush=True)


def describe(folder: Path) -> tuple[dict[str, Any], list[str]]:
    """The reference's metadata, and layer 0's stored tensors, one line per module: `module: part dtype [shape]`."""
    from safetensors import safe_open

    with safe_open(str(folder / "reference.safetensors"), "pt") as reference:
        metadata = json.loads((reference.metadata() or {})["reference"])
    prefix = "model.layers.0."
    modules: dict[str, list[str]] = {}
    with safe_open(str(folder / "model.safetensors"), "pt") as checkpoint:
        for key in sorted(checkpoint.keys()):
            if key.startswith(prefix) and "layernorm" not in key:
                module, part = key[len(prefix):].rsplit(".", 1)
                tensor = checkpoint.get_slice(key)
                modules.setdefault(module, []).append(f"`{part}` {tensor.get_dtype()} {list(tensor.get_shape())}")
    return metadata, [f"{module}: {', '.join(parts)}" for module, parts in modules.items()]


def write_readme(out: Path) -> None:
    lines = [
        "# Quantized checkpoint fixtures",
        "",
        "Written by `scripts/make_quantized_fixtures.py` (run it to rewrite them all; it makes its own virtual",
        "environments). Each folder is a tiny Llama (vocab 128, hidden 64, intermediate 128, 2 layers, 4 heads of 16,",
        "2 KV heads, untied embeddings) quantized by the tool named, from `base/` (bfloat16, the unquantized source;",
        "its float32 logits of `input_ids` in `base/reference.safetensors`). Calibration: 16 random sequences of 32",
        "tokens (seed 1). GPTQ and AWQ start from the float16 copy of base (same values), the rest from bfloat16.",
        "",
        "Each folder: the checkpoint as the tool wrote it (`config.json` with its `quantization_config`,",
        "`quantize_config.json` where the tool writes one, `model.safetensors`) and `reference.safetensors`:",
        "",
        "- `input_ids` int64 [1, 16], the same everywhere;",
        "- `<linear>.weight` float32 [out, in] for every quantized linear of layer 0 (e.g.",
        "  `model.layers.0.self_attn.q_proj.weight`): the tool's own dequantization, from the stored tensors with",
        "  their scales widened to float32 (exact); layer 1's go into `logits_dequantized` only;",
        "- `logits` float32 [1, 16, 128]: the tool's own forward on the CPU, where one runs;",
        "- `logits_dequantized` float32 [1, 16, 128]: transformers' Llama in float32 with the dequantized weights",
        "  and the checkpoint's own unquantized tensors (weights only, no activation quantization);",
        "- metadata key `reference`: JSON naming the tool, the package versions and how each reference was computed.",
        "",
        "| fixture | what | written by | `logits` |",
        "| --- | --- | --- | --- |",
    ]
    listings = ["", "## Layer 0 as stored (`model.layers.0.` omitted)", ""]
    for fixture in FIXTURES:
        folder = out / fixture.name
        if not (folder / "reference.safetensors").exists():
            continue
        metadata, modules = describe(folder)
        found = metadata["versions"]
        stack = ", ".join(f"{k} {v}" for k, v in found.items() if k in ("transformers", "compressed-tensors", "torch"))
        lines.append(f"| `{fixture.name}` | {fixture.summary} | {metadata.get('tool', '?')} ({stack}) | "
                     f"{metadata.get('logits', '?')} |")
        listings += [f"`{fixture.name}`:", ""] + [f"- {module}" for module in modules] + [""]
    lines += listings + [
        "## Notes",
        "",
        "- GPTQ: `qweight` [in/(32/bits), out] int32 (inputs packed along dim 0, lowest bits first), `qzeros`",
        "  [groups, out/(32/bits)] int32 (stored zero - 1 for `checkpoint_format` gptq, the zero itself for gptq_v2),",
        "  `scales` [groups, out] float16, `g_idx` [in] int32 (group of each input; permuted under desc_act). The",
        "  references equal scales[g_idx] * (q - zero) exactly.",
        "- AWQ: gptqmodel writes AutoAWQ's GEMM layout (`qweight` [in, out/8] int32, packed along the output dim in",
        "  the order 0,2,4,6,1,3,5,7, `qzeros` [in/group, out/8] likewise, the zero itself, `scales` [in/group, out]",
        "  float16; w = (q - zero) * scale); its",
        "  dequantization is checked equal to AutoAWQ 0.2.9's `dequantize_gemm`. AWQ folds its activation scales",
        "  into the preceding norms and linears, so compare with the fixture's own unquantized tensors, not base's.",
        "  The clipping search is off (it batches 64 output rows; k_proj/v_proj have 32), as AutoAWQ's",
        "  `apply_clip=False`. No `modules_to_not_convert`: gptqmodel writes none.",
        "- `fp8-tensor-static` is written by the script itself, to AutoFP8's documented format (README \"Checkpoint",
        "  structure explanation\" and auto_fp8/quantize.py of github.com/neuralmagic/AutoFP8): no tool that writes it",
        "  installs here; its dequantized reference is the script's own (weight * weight_scale) and it has no tool",
        "  logits.",
        "- `fp8-block32`: transformers' FineGrainedFP8 quantizer refuses to run without a GPU; the script bypasses",
        "  that check only (the quantization is transformers' own `Fp8Quantize`). `weight_scale_inv` multiplies.",
        "- compressed-tensors pack-quantized: `weight_packed` [out, in/8] int32, 8 inputs a word, lowest bits first,",
        "  each q + 8; `weight_zero_point` (asymmetric) [out/8, groups] int32, packed the same way along the output",
        "  dim, zero + 8; `weight_scale` [out, groups]; w = (q - zero) * scale. int-/float-quantized: `weight` int8 or",
        "  float8_e4m3fn [out, in], `weight_scale` [out, 1] (channel) or [1] (tensor), static `input_scale` [1],",
        "  `k_scale` / `v_scale` [1] on self_attn. Their `logits` include the schemes' activation quantization",
        "  (W8A8, FP8), so they differ from `logits_dequantized` there; for W4A16 they are equal.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "quantized")
    parser.add_argument("--venvs", type=Path, default=Path("/tmp/ferrum-quant-venvs"))
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: --venvs/work)")
    parser.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # set when the driver runs a venv's python
    args = parser.parse_args()
    out: Path = args.out.resolve()
    work: Path = (args.work or args.venvs / "work").resolve()
    if args.stage == "base":
        write_base(work, out)
        return
    if args.stage == "readme":
        write_readme(out)
        return
    if args.stage is not None:
        fixture = next(f for f in FIXTURES if f.name == args.stage)
        WRITERS[fixture.writer](fixture, work, out)
        return

    chosen = [f for f in FIXTURES if args.only is None or f.name in args.only]
    unknown = set(args.only or ()) - {f.name for f in FIXTURES}
    if unknown:
        raise SystemExit(f"unknown fixtures {sorted(unknown)}; known: {[f.name for f in FIXTURES]}")
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    # base/ and the README are written in the gptqmodel environment (any with transformers would do)
    pythons = {name: ensure_venv(args.venvs.resolve(), name, work) for name in sorted({"gptqmodel"} | {
        f.venv for f in chosen})}
    run_stage(pythons["gptqmodel"], "base", work, out)
    for fixture in chosen:
        run_stage(pythons[fixture.venv], fixture.name, work, out)
    run_stage(pythons["gptqmodel"], "readme", work, out)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {total / 1024:.0f} KiB in all")


if __name__ == "__main__":
    main()
