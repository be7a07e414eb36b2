"""The Python heap of a long-running server.

What a server builds at start-up (the model's modules, compiled kernels and graphs, the
tokenizer, the routes) lives as long as the process. Left in the collector's generations, every
full collection that request traffic triggers walks all of it, and a step waits: hundreds of
milliseconds in an engine process holding a model and its CUDA graphs. Frozen, those objects
leave the generations and a full collection walks only what requests allocated since.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Freeze every object alive now. No full collection first: it would cost a server's start
    about 0.15 s; what start-up garbage is frozen with the rest is freed by `thaw_heap` and the
    collection the engine's release runs."""
    gc.freeze()


def thaw_heap() -> None:
    """Undo `freeze_startup_heap` (before releasing what was frozen, so it can be collected)."""
    gc.unfreeze()
