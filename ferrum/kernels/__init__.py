"""Triton kernels of the GPU path, one job a module. Reached only through the layers of
`ferrum.models.layers` (and the decode graphs' greedy step): nothing else calls a kernel, and
nothing here reads the environment or probes hardware (what a kernel may use, such as programmatic
dependent launch, is decided once from the `Device` and the engine's `KernelConfig`).

    config.py           KernelConfig, GemvTable: the typed kernel settings (no triton import)
    pdl.py              programmatic dependent launch: the in-kernel wait, the launch option
    counts.py           the counts by which a launch's last program finds itself (zeros between launches)
    norm.py             RMSNorm (with the residual add), silu * mul
    rope.py             rope on q and k, the KV-cache write
    paged_attention.py  decode and prefill attention over the paged KV cache
    gemv.py             fused matrix-vector products for decode batches of 1-4 rows, bf16 or
                        quantized (int8, fp8, int4) weights
    quant_weight.py     QuantWeight: a quantized weight's storage as the kernels read it (no triton import)
    quant_matmul.py     products of many rows with a quantized weight (prefill, large batches)
    greedy.py           argmax and the next decode step's inputs, on the device
    all_reduce.py       one-shot sum across the GPUs of one host over peer-mapped buffers (TP decode)

Importing this package imports nothing; each module imports triton.

A `@triton.jit` function's parameters are annotated `tl.constexpr` or `tl.tensor` (what a pointer or
a runtime scalar is inside a kernel), never a Python type: Triton reads `int`, `float` and `bool` as
fixed argument types (i32, fp32, u1), which changes what a launch compiles.
"""
