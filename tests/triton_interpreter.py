"""Runs the GPU path's Triton kernels on the CPU, in Triton's interpreter, where there is no GPU.

Call `use_interpreter()` before anything imports a `ferrum.kernels` module: the interpreter is
chosen when the kernels are defined (TRITON_INTERPRET=1). `gpu_path_device()` is the `Device` the
GPU path runs on in a test: the GPU when there is one, else the CPU's own Device with Triton on
(no CUDA graphs, no PDL), so that the engine picks the Triton attention, the Triton layer ops and
the GPU runner, all interpreted.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from ferrum.backends.device import Device

ON_GPU = torch.cuda.is_available()


def use_interpreter() -> None:
    """Triton compiled on a GPU, interpreted elsewhere (skips the test without triton)."""
    if not ON_GPU:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton", reason="the GPU kernels are Triton (pip install triton)")
    if not ON_GPU:
        _patch_interpreter_index()


def gpu_path_device() -> Device:
    use_interpreter()
    if ON_GPU:
        from ferrum.backends.cuda import create_backends

        return create_backends()[0].device()
    from ferrum.backends.cpu import CPUBackend

    return dataclasses.replace(CPUBackend().device(), triton=True, packed_bf16_linears=False)


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
