"""Compiles the decode path's Triton kernels for a Hopper GPU (sm_90) with programmatic dependent
launch, on any machine: Triton's bundled ptxas needs no GPU. Run in its own process (the tests
set TRITON_INTERPRET=1, under which kernels are interpreted, not compiled):

    python -m tests.kernels.hopper_ptx [--ptx DIR]
    python -m tests.kernels.hopper_ptx --w4a16

Prints one JSON object: for each kernel, the order of its global loads and griddepcontrol
instructions in the PTX ("load", "wait", "trigger"), its registers per thread, and where ptxas put the
global loads of its longest loop (fractions of the loop body in the SASS). With --ptx,
also writes each kernel's PTX into DIR (to compare two versions of the kernels). With --w4a16, the
W4A16 GEMMs (planes; weight tiles) with their bf16-pair dequantization compiled for sm_80, 86, 89 and 90
instead: per kernel and target its bf16x2 fma and wgmma instructions in the PTX, and its registers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ferrum.kernels import gemv as tg
from ferrum.kernels import greedy, moe, paged_attention

GEMV_ARGS = ["X", "W", "S", "Z", "B", "R", "NW", "OUT", "IDX", "M", "N", "K",
             "stride_xm", "stride_wn", "stride_sn", "stride_rm", "stride_om", "eps", "magic"]
GEMV_TYPES = ["*bf16"] * 8 + ["*i64"] + ["i32"] * 8 + ["fp32", "i32"]
QKV_ARGS = ["X", "W", "S", "Z", "B", "NW", "POS", "COS", "SIN", "SLOTS", "QOUT", "KC", "VC", "IDX", "M", "K",
            "stride_xm", "stride_wn", "stride_sn", "stride_cs", "stride_qt", "stride_qh", "stride_kc", "stride_kh",
            "eps", "magic"]
QKV_TYPES = (["*bf16"] * 6 + ["*i64", "*fp32", "*fp32", "*i64", "*bf16", "*bf16", "*bf16", "*i64"] + ["i32"] * 10
             + ["fp32", "i32"])


def quantized(types: list[str], weight: str, scale: str) -> list[str]:
    """The signature with the weight (W) and its scale and zero (S, Z) of a quantized kind."""
    return [types[0], weight, scale, scale, *types[4:]]
PAIR_ARGS = ["X", "W", "S", "Z", "OUT", "CHOSEN", "N", "K", "rows_e", "stride_xm", "stride_wn", "stride_sn",
             "stride_om", "magic"]
PAIR_TYPES = ["*bf16"] * 5 + ["*i32"] + ["i32"] * 8
COMBINE_ARGS = ["X", "W", "S", "Z", "OUT", "CHOSEN", "RW", "R", "N", "K", "rows_e", "stride_xm", "stride_wn",
                "stride_sn", "stride_om", "stride_rm", "magic"]
COMBINE_TYPES = ["*bf16"] * 5 + ["*i32", "*fp32", "*bf16"] + ["i32"] * 9
DECODE_ARGS = ["Q", "KC", "VC", "OUT", "PART_ACC", "PART_ML", "TABLES", "LENS", "scale", "window", "step_keys",
               "stride_qt", "stride_qh", "stride_kc", "stride_kh", "stride_bt", "stride_ot", "stride_oh"]
DECODE_TYPES = ["*bf16"] * 4 + ["*fp32", "*fp32", "*i32", "*i32", "fp32"] + ["i32"] * 9


def compile_sm90(fn, names: list[str], types: list[str], consts: dict, num_warps: int = 4, capability: int = 90):
    """The kernel compiled for sm_90 with PDL (or for another compute capability, PDL from 90 on); pointers,
    strides and sizes taken as multiples of 16, as Triton's launcher specialises them for the 1B shapes (the
    block tables' stride is left unspecialised in the kernel)."""
    sig = dict(zip(names, types, strict=True))
    consts = {**{param.name: param.default for param in fn.params  # constexprs left out: their defaults
                 if param.is_constexpr and param.name not in consts and param.name not in sig}, **consts}
    aligned = [i for i, (name, ty) in enumerate(sig.items())
               if ty.startswith("*") or (name.startswith("stride") and name != "stride_bt") or name in ("N", "K", "V")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps, "launch_pdl": capability >= 90})


def order(kernel) -> list[str]:
    events = []
    for line in kernel.asm["ptx"].splitlines():
        if "ld.global" in line:
            events.append("load")
        elif "griddepcontrol.wait" in line:
            events.append("wait")
        elif "griddepcontrol.launch_dependents" in line:
            events.append("trigger")
    return events


def _cubin_tool(kernel, tool: str, *args: str) -> str | None:
    """What Triton's bundled `tool` (cuobjdump, nvdisasm) prints for the kernel's cubin; None where it is missing."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if not os.path.exists(path):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([path, *args, f.name], capture_output=True, text=True).stdout


def registers(kernel) -> int | None:
    out = _cubin_tool(kernel, "cuobjdump", "-res-usage")
    if out is None:
        return None
    for word in out.split():
        if word.startswith("REG:"):
            return int(word[4:])
    return None


def loop_loads(kernel) -> list[float] | None:
    """Where the global loads sit in the kernel's longest loop (the K loop of a multi-slice GEMV) in the SASS
    ptxas made: each load's position as a fraction of the loop body (None: no nvdisasm, or no loop)."""
    sass = _cubin_tool(kernel, "nvdisasm", "-c")
    if sass is None:
        return None
    lines = sass.splitlines()
    body: list[str] = []
    for i, line in enumerate(lines):
        branch = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if branch is None:
            continue
        start = next((j for j, x in enumerate(lines) if x.startswith(branch.group(1) + ":")), len(lines))
        loop = [x for x in lines[start:i + 1] if re.search(r"/\*[0-9a-f]{4}\*/", x)]
        if start < i and len(loop) > len(body):  # a backward branch: a loop (the longest; not the trap's)
            body = loop
    if not body:
        return None
    return [n / len(body) for n, x in enumerate(body) if "LDG" in x]


def w4a16_for(capability: int, tiles: bool = False):
    """The W4A16 GEMM (16 rows a program, int4 in groups of 128, bf16 x, scales and zeros: the planes in
    bf16 pairs by inline PTX) compiled for compute capability `capability` (80 = sm_80); `tiles`: the
    weight-tiles kernel instead (64 x 64 tiles, the planes joined into the MMA's shared-memory operand)."""
    from ferrum.kernels import quant_matmul as qm

    if tiles:
        fn = qm._w4a16_tiles_kernel
        types = {"X": "*bf16", "W": "*i32", "S": "*bf16", "Z": "*bf16", "B": "*bf16", "OUT": "*bf16", "P": "*fp32"}
        names = [p.name for p in fn.params if not p.is_constexpr]
        consts = dict(GROUP=128, BIAS=False, SPLIT_K=2, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8,
                      QUANT=qm.INT4, BF16X2=True)
        return compile_sm90(fn, names, [types.get(name, "i32") for name in names], consts, capability=capability)
    fn = qm._w4a16_kernel
    types = {"X": "*bf16", "W": "*i32", "S": "*bf16", "Z": "*bf16", "B": "*bf16", "OUT": "*bf16", "P": "*fp32",
             "COUNTS": "*i32"}
    names = [p.name for p in fn.params if not p.is_constexpr and p.name != "stride_x_word"]
    consts = dict(GROUP=128, BIAS=False, EVEN_K=True, SPLIT_K=4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8,
                  QUANT=qm.INT4, BF16X2=True, LAST_SUMS=True,
                  stride_x_word=1)  # x permuted: Triton specialises the stride of 1
    return compile_sm90(fn, names, [types.get(name, "i32") for name in names], consts, capability=capability)


def main() -> None:
    if "--w4a16" in sys.argv:  # the W4A16 GEMM's bf16 pairs for every GPU that serves bf16 (cc >= 8.0)
        out = {}
        for cc in (80, 86, 89, 90):
            for name, tiles in (("planes", False), ("tiles", True)):
                kernel = w4a16_for(cc, tiles)
                out[f"{name} {cc}"] = dict(bf16x2_fma=kernel.asm["ptx"].count("fma.rn.bf16x2"),
                                           wgmma=kernel.asm["ptx"].count("wgmma.mma_async"),
                                           registers=registers(kernel))
        print(json.dumps(out))
        return
    gemv = dict(ROWS=1, BLOCK_N=2, BIAS=False, PDL=1)
    kernels = {
        # 1B o_proj: all of K in one slice, residual rows from the embedding table (first layer)
        "gemv o_proj": compile_sm90(tg._gemv_kernel, GEMV_ARGS, GEMV_TYPES, dict(
            gemv, BLOCK_K=2048, NORM=False, GATED=False, RESIDUAL=True, WHOLE_K=True, R_GATHER=True)),
        # 1B gate/up: the norm in the prologue, silu*mul in the epilogue
        "gemv gate_up": compile_sm90(tg._gemv_kernel, GEMV_ARGS, GEMV_TYPES, dict(
            gemv, BLOCK_K=2048, NORM=True, GATED=True, RESIDUAL=False, WHOLE_K=True)),
        # 1B down_proj: K = 8192 in 2048-wide slices
        "gemv down_proj": compile_sm90(tg._gemv_kernel, GEMV_ARGS, GEMV_TYPES, dict(
            gemv, BLOCK_K=2048, NORM=False, GATED=False, RESIDUAL=True, WHOLE_K=False)),
        "qkv rope": compile_sm90(tg._qkv_rope_kernel, QKV_ARGS, QKV_TYPES, dict(
            H=32, KV=8, D=64, ROWS=1, BLOCK_H=1, BLOCK_K=1024, NORM=True, BIAS=False, WHOLE_K=False, PDL=1,
            X_GATHER=True)),
        # quantized weights (KernelConfig's tables): int4 gate/up and int8 down_proj in chunks of 4
        # words a thread (one row, gemv_chunks; int4 with x as int8 and dp4a, as served on a GPU), int4
        # down_proj one word a thread (several rows, or groups of 16), fp8 o_proj as tiles, the q/k/v
        # projection with int4
        "gemv int4 gate_up": compile_sm90(tg._gemv_kernel, GEMV_ARGS, quantized(GEMV_TYPES, "*i32", "*bf16"), dict(
            gemv, BLOCK_N=4, BLOCK_K=2048, NORM=True, GATED=True, RESIDUAL=False, WHOLE_K=False, QUANT=tg.INT4,
            GROUP=128, PLANES=8, WPT=4, A8=True, ASM=True), num_warps=2),
        "gemv int4 down_proj one word a thread": compile_sm90(
            tg._gemv_kernel, GEMV_ARGS, quantized(GEMV_TYPES, "*i32", "*bf16"), dict(
                gemv, BLOCK_N=4, BLOCK_K=2048, NORM=False, GATED=False, RESIDUAL=True, WHOLE_K=False, QUANT=tg.INT4,
                GROUP=16, PLANES=8)),
        # 8B down_proj (K = 14336 in 2048-wide slices): int4 with bf16 scales and zeros, and GGUF Q4_K's
        # own factors (INT4_K: int16 sub-scales, int64 super-block factors)
        "gemv int4 down_proj": compile_sm90(tg._gemv_kernel, GEMV_ARGS, quantized(GEMV_TYPES, "*i32", "*bf16"), dict(
            gemv, BLOCK_N=4, BLOCK_K=2048, NORM=False, GATED=False, RESIDUAL=True, WHOLE_K=False, QUANT=tg.INT4,
            GROUP=128, PLANES=8, WPT=4, A8=True, ASM=True), num_warps=2),
        "gemv int4-k down_proj": compile_sm90(
            tg._gemv_kernel, GEMV_ARGS, [*GEMV_TYPES[:1], "*i32", "*i16", "*i64", *GEMV_TYPES[4:]], dict(
                gemv, BLOCK_N=4, BLOCK_K=2048, NORM=False, GATED=False, RESIDUAL=True, WHOLE_K=False,
                QUANT=tg.INT4_K, GROUP=32, PLANES=8, WPT=4, A8=True, ASM=True), num_warps=2),
        "gemv int8 down_proj": compile_sm90(tg._gemv_kernel, GEMV_ARGS, quantized(GEMV_TYPES, "*i32", "*fp32"), dict(
            gemv, BLOCK_N=4, BLOCK_K=2048, NORM=False, GATED=False, RESIDUAL=True, WHOLE_K=False, QUANT=tg.INT8,
            PLANES=4, WPT=4)),
        "gemv fp8 o_proj": compile_sm90(tg._gemv_kernel, GEMV_ARGS, quantized(GEMV_TYPES, "*fp8e4nv", "*fp32"), dict(
            gemv, BLOCK_N=4, BLOCK_K=2048, NORM=False, GATED=False, RESIDUAL=True, WHOLE_K=True,
            QUANT=tg.PER_CHANNEL)),
        "qkv rope int4": compile_sm90(tg._qkv_rope_kernel, QKV_ARGS, quantized(QKV_TYPES, "*i32", "*bf16"), dict(
            H=32, KV=8, D=64, ROWS=1, BLOCK_H=4, BLOCK_K=1024, NORM=True, BIAS=False, WHOLE_K=False, PDL=1,
            QUANT=tg.INT4, GROUP=128, PLANES=8, WPT=4, A8=True, ASM=True), num_warps=1),
        "decode attention": compile_sm90(paged_attention._decode_kernel, DECODE_ARGS, DECODE_TYPES, dict(
            G=4, BLOCK_G=16, D=64, PAGE=16, BLOCK_N=32, SPLITS=32, PRECISION="tf32", PDL=1)),
        # Qwen3's: its per-head norms, rope and the cache write folded in (paged_decode_rope)
        "decode attention rope": compile_sm90(
            paged_attention._decode_kernel,
            DECODE_ARGS + ["POS", "COS", "SIN", "SLOTS", "QNW", "KNW", "eps", "stride_cs"],
            DECODE_TYPES + ["*i64", "*fp32", "*fp32", "*i64", "*bf16", "*bf16", "fp32", "i32"],
            dict(G=8, BLOCK_G=16, D=128, PAGE=16, BLOCK_N=32, SPLITS=32, PRECISION="tf32", PDL=1, ROPE=True,
                 QK_NORM=True)),
        "decode reduce": compile_sm90(paged_attention._decode_reduce_kernel,
                                      ["PART_ACC", "PART_ML", "OUT", "stride_ot", "stride_oh"],
                                      ["*fp32", "*fp32", "*bf16", "i32", "i32"],
                                      dict(D=64, SPLITS=32, BLOCK_S=32, PDL=1), num_warps=1),
        # Qwen3-30B-A3B's MoE experts at batch 1 (the router is launched plainly: ferrum.kernels.moe)
        "moe pair gate_up": compile_sm90(moe._pair_gemv_kernel, PAIR_ARGS, PAIR_TYPES, dict(
            TOP_K=8, BLOCK_N=4, BLOCK_K=2048, WHOLE_K=True, QUANT=tg.PLAIN, GROUP=1, PLANES=1, ASM=True, PDL=1)),
        "moe combine down": compile_sm90(moe._combine_down_kernel, COMBINE_ARGS, COMBINE_TYPES, dict(
            TOP_K=8, BLOCK_N=4, BLOCK_K=1024, WHOLE_K=True, QUANT=tg.PLAIN, GROUP=1, PLANES=1, ASM=True,
            RESIDUAL=True, PDL=1)),
        "argmax": compile_sm90(greedy._argmax_chunks_kernel, ["LOGITS", "VALS", "IDX", "stride_l", "V"],
                               ["*fp32", "*fp32", "*i32", "i32", "i32"], dict(CHUNK=4008, BLOCK=1024, PDL=1)),
    }
    if "--ptx" in sys.argv:
        folder = sys.argv[sys.argv.index("--ptx") + 1]
        os.makedirs(folder, exist_ok=True)
        for name, kernel in kernels.items():
            with open(os.path.join(folder, name.replace(" ", "_") + ".ptx"), "w") as f:
                f.write(kernel.asm["ptx"])
    print(json.dumps({name: dict(order=order(k), registers=registers(k), loop_loads=loop_loads(k))
                      for name, k in kernels.items()}))


if __name__ == "__main__":
    main()
