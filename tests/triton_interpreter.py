"""Runs the GPU path's Triton kernels on the CPU, in Triton's interpreter, where there is no GPU.

Import `triton_kernels()` from here before anything imports ferrum.models.triton_kernels: the
interpreter is chosen when the kernels are defined (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch

ON_GPU = torch.cuda.is_available()


def triton_kernels() -> ModuleType:
    """ferrum.models.triton_kernels, compiled on a GPU, interpreted elsewhere (skips without triton)."""
    if not ON_GPU:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton", reason="the GPU kernels are Triton (pip install triton)")
    if not ON_GPU:
        _patch_interpreter_index()
    from ferrum.models import triton_kernels as kernels

    return kernels


def _patch_interpreter_index() -> None:
    # Triton 3.6's interpreter turns a loaded scalar (a 1-element numpy array) into a loop bound with
    # int(array), which numpy >= 2.4 refuses; give its tensors an __index__ that numpy accepts.
    from triton.runtime import interpreter

    if getattr(interpreter, "_ferrum_patched", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._ferrum_patched = True
