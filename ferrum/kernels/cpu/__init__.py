"""C++ kernels of the CPU path, built once per machine with the system's C++ compiler against the
installed torch and registered as `torch.ops.ferrum_cpu.*` (build.py says where they are cached and
when they are rebuilt). Reached only through the CPU's attention backend and layer ops.

    attention.cpp   attention over the paged KV cache, reading the cache blocks in place (decode and
                    prefill, split over the keys where the batch leaves cores idle)
    layer_ops.cpp   RMSNorm (with the residual add), silu * mul, rope on q and k with the KV-cache write
    int4_fit.cpp    int4 quantization on load (the loader's, through LayerOps.quantize)
    library.cpp     the ops' schemas
    build.py        compile (g++ -O3 -march=native), cache on disk, load

Importing this package imports nothing.
"""
