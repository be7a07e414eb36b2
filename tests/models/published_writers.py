"""Test-only writers of published quantized checkpoints, byte-exact to each format's documented packing,
from random integer codes, scales and zero points, with the dense weights they stand for:

    GPTQ       AutoGPTQ / GPTQModel `pack()` (qweight [K*b/32, N], qzeros [G, N*b/32] holding z - 1 in
               checkpoint_format gptq, z in gptq_v2, scales [G, N] float16, g_idx [K])
    AWQ        AutoAWQ `WQLinear_GEMM.from_linear` (order map 0 2 4 6 1 3 5 7 along the outputs)
    compressed-tensors   compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32 (values + 2^(b-1),
               packed along K; zero points packed along N), int-quantized / float-quantized as stored tensors
    FP8        transformers' FP8 checkpoints: weight float8_e4m3fn, weight_scale float32 []

Each writer takes the tiny model folder's float weights only for their shapes and returns
{tensor name: tensor} for one module, and the dense float32 weight it stands for.
"""

from __future__ import annotations

import torch

ORDER_AWQ = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_along_last(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [..., M] -> int32 [..., M*bits/32], value j of a word at bits bits*j."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(per):
        word |= v[..., j] << (bits * j)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # as the signed int32 the tools store


def shared_input(module: str) -> int:
    """A seed shared by the modules that read one input (q/k/v; gate/up): GPTQ's act order comes from
    the input's statistics, so they share it."""
    leaf = module.split(".")[-1]
    key = module.rsplit(".", 1)[0] + {"k_proj": ".q_proj", "v_proj": ".q_proj", "up_proj": ".gate_proj"}.get(
        leaf, "." + leaf)
    return sum(key.encode()) * 7919 + len(key)


def gptq(n: int, k: int, g: int, bits: int, sym: bool, desc_act: bool, v2: bool,
         gen: torch.Generator, module: str = "") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    groups = 1 if g == -1 else k // g
    size = k if g == -1 else g
    q = torch.randint(0, 1 << bits, (k, n), generator=gen)
    mid = 1 << (bits - 1)
    # checkpoint_format gptq cannot store z = 0 (its z - 1 = -1 overflows into the next values of the word)
    z = torch.full((groups, n), mid) if sym else torch.randint(0 if v2 else 1, 1 << bits, (groups, n), generator=gen)
    s = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).half()
    g_idx = torch.arange(k) // size
    if desc_act:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(shared_input(module)))]
    w = (q - z[g_idx]).float() * s[g_idx].float()  # [K, N]
    stored_z = z if v2 else (z - 1) & ((1 << bits) - 1)
    tensors = {"qweight": pack_along_last(q.t(), bits).t().contiguous(),
               "qzeros": pack_along_last(stored_z, bits), "scales": s, "g_idx": g_idx.to(torch.int32)}
    return tensors, w.t().contiguous()


def awq(n: int, k: int, g: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    groups = k // g
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (groups, n), generator=gen)
    s = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).half()
    idx = torch.arange(k) // g
    w = (q - z[idx]).float() * s[idx].float()

    def pack(v: torch.Tensor) -> torch.Tensor:
        ordered = v.reshape(v.shape[0], -1, 8)[..., list(ORDER_AWQ)].reshape(v.shape[0], -1)
        return pack_along_last(ordered, 4)

    return {"qweight": pack(q), "qzeros": pack(z), "scales": s}, w.t().contiguous()


def compressed_pack(n: int, k: int, g: int | None, sym: bool, dtype: torch.dtype,
                    gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """W4A16 pack-quantized: groups of g (None: channel-wise)."""
    size = k if g is None else g
    groups = k // size
    q = torch.randint(-8, 8, (n, k), generator=gen)
    zp = torch.zeros(n, groups, dtype=torch.int64) if sym else torch.randint(-8, 8, (n, groups), generator=gen)
    s = (torch.rand(n, groups, generator=gen) * 0.02 + 0.005).to(dtype)
    idx = torch.arange(k) // size
    w = (q - zp[:, idx]).float() * s[:, idx].float()
    tensors = {"weight_packed": pack_along_last(q + 8, 4), "weight_scale": s,
               "weight_shape": torch.tensor([n, k])}
    if not sym:
        tensors["weight_zero_point"] = pack_along_last((zp + 8).t(), 4).t().contiguous()
    return tensors, w


def compressed_int8(n: int, k: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
    s = (torch.rand(n, 1, generator=gen) * 0.002 + 0.0005).to(torch.bfloat16)
    return {"weight": q, "weight_scale": s}, q.float() * s.float()


def fp8(n: int, k: int, gen: torch.Generator, per_tensor: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(() if per_tensor else (n, 1), generator=gen) * 0.001 + 0.0002
    return {"weight": q, "weight_scale": s}, q.float() * s


def fp8_static(n: int, k: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """fp8 with a per-tensor weight scale and a static input_scale [1] (AutoFP8's / vLLM's layout),
    a different one each module: 0.02-0.05, room for activations up to 9 (448 x 0.02)."""
    tensors, weight = fp8(n, k, gen, True)
    return {**tensors, "input_scale": torch.rand(1, generator=gen) * 0.03 + 0.02}, weight


def fp8_block(n: int, k: int, block: tuple[int, int], gen: torch.Generator) -> tuple[dict[str, torch.Tensor],
                                                                                   torch.Tensor]:
    """transformers' FineGrainedFP8 / DeepSeek layout: weight_scale_inv [ceil(N/bn), ceil(K/bk)]."""
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows, cols = -(-n // block[0]), -(-k // block[1])
    s = torch.rand(rows, cols, generator=gen) * 0.001 + 0.0002
    per = s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return {"weight": q, "weight_scale_inv": s}, q.float() * per


def gguf_q8_0(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's Q8_0 rows [N, K/32 * 34] (d float16, 32 int8 a block) and the weight they stand for."""
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).to(torch.int8)
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 0.001).half()
    rows = torch.cat((d.view(torch.uint8), q.view(torch.uint8)), dim=2).reshape(n, -1)
    return rows, (q.float() * d.float()).reshape(n, k)
