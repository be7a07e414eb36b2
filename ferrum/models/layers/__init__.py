"""Building blocks shared by every decoder. Each has its implementation chosen once, when the
model is built for a `Device` (`LayerOps`: plain torch, or the Triton kernels of `ferrum.kernels`),
never per call from where a tensor happens to live.

    ops.py            LayerOps: RMSNorm and silu * mul, torch or Triton
    norm.py           RMSNorm (with the residual add)
    rotary.py         rotary embedding tables and the rotation
    mlp.py            the gated MLP (gate and up fused in one projection)
    linear.py         LinearFactory: every linear layer, plain or quantized, from its path
    quantized_linear.py   QuantizedLinear: int8 / int4 / fp8 storage and its kernels (CPU ops, GPU)
    packed_linear.py  CPU: linears with oneDNN-prepacked bf16 weights
    greedy.py         GPU: the decode graphs' argmax and next inputs, on the device
"""

from ferrum.models.layers.mlp import GatedMLP
from ferrum.models.layers.norm import RMSNorm
from ferrum.models.layers.ops import LayerOps, layer_ops, torch_ops, triton_ops
from ferrum.models.layers.rotary import RotaryEmbedding, apply_rotary, rope_inverse_frequencies

__all__ = [
    "GatedMLP",
    "LayerOps",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "layer_ops",
    "rope_inverse_frequencies",
    "torch_ops",
    "triton_ops",
]
