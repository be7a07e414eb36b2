"""`MoE`: a mixture of experts' MLPs (Qwen3-MoE, Qwen2-MoE, Mixtral), as ModelConfig.moe describes it.

The router runs in float32: softmax over every expert's logit, the top k kept (renormalised to sum to 1
where the model does), cast to the activations' dtype as HF does. Each expert is a gated MLP; its weights
are stacked, expert after expert, in two parameters that the checkpoint's per-expert tensors fill by rows:

    experts_gate_up   [E * 2I, H]   expert e's gate rows e*2I .. e*2I+I, its up rows after them
    experts_down      [E * H, I]    expert e's rows e*H .. (e+1)*H

Quantized on load (int8, int4, fp8), each stack is one quantized weight (`QuantizedExperts`): rows are
quantized one by one, so an expert's rows of the storage are that expert quantized; the GPU's per-pair
kernels read the chosen experts' rows as they lie (larger steps dequantize the stacks for the grouped
products), the plain path dequantizes each chosen expert's rows as it runs it.

How the experts compute is chosen once from the layer ops (`ExpertsMethod`):

    plain     (the CPU, any device without Triton) the step's tokens grouped by expert in PyTorch, each
              chosen expert run once over its tokens: correct everywhere, its speed not a target
    triton    (GPUs; Triton's interpreter in tests) ferrum.kernels.moe: the router's top k in one
              kernel, then the experts' products reading only the chosen experts' rows (per pair at
              decode sizes, grouped by expert for larger steps), every shape static, so decode steps
              stay inside their CUDA graphs

A shared expert (Qwen2-MoE) runs on every token, scaled by sigmoid of its gate.

Under tensor parallelism (`tp`) each rank holds every expert's share of the intermediate dimension (and
of the shared expert's): the router runs whole on every rank (the same choices), each rank's experts give
partial sums, and one all-reduce adds them, the shared expert's included.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ferrum.kernels.config import GemvTable
from ferrum.kernels.quant_weight import QuantWeight
from ferrum.models.config import MoeConfig
from ferrum.models.layers.linear import LinearFactory
from ferrum.models.layers.mlp import GatedMLP
from ferrum.models.layers.ops import LayerOps
from ferrum.models.layers.parallel import TensorParallel
from ferrum.models.layers.quantized_linear import QuantizedExperts


class ExpertsMethod(Protocol):
    def __call__(self, moe: MoE, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum for each token of x [T, H] (this rank's part under tensor
        parallelism, before the all-reduce), in x's dtype; plus `residual` [T, H] where given (rounded
        after the sum)."""
        ...


def plain_experts(moe: MoE, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    chosen, weights = moe.route(x)
    out = torch.zeros_like(x)
    for e in torch.unique(chosen).tolist():
        tokens, slot = torch.where(chosen == e)
        y = moe.expert(e, x[tokens]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out if residual is None else out + residual


def triton_experts(moe: MoE, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    from ferrum.kernels import moe as kernels

    config = moe.moe
    chosen, weights = kernels.route(x, moe.gate.weight, config.top_k, config.normalize)
    small = kernels.per_pair_fits(x.shape[0], config.top_k, config.num_experts)
    return kernels.experts(x, chosen, weights, _kernel_stack(moe.experts_gate_up, small, x.dtype),
                           _kernel_stack(moe.experts_down, small, x.dtype), config.num_experts, per_pair=small,
                           residual=residual)


def _kernel_stack(stack: torch.Tensor | QuantizedExperts, per_pair: bool,
                  dtype: torch.dtype) -> torch.Tensor | QuantWeight:
    """A stack as the kernels take it: a quantized one's storage for the per-pair products, or (larger steps,
    which take the grouped tensor-core products) dequantized for the call: its bytes are read once a step
    either way, and the products then run at the tensor cores' rate."""
    if not isinstance(stack, QuantizedExperts):
        return stack
    return stack.kernel_weight() if per_pair else stack.rows_dequantized(0, stack.out_features, dtype)


def experts_method(ops: LayerOps) -> ExpertsMethod:
    """The Triton kernels where the layer ops are Triton's (the device compiles them), else the plain path."""
    return triton_experts if ops.name == "triton" else plain_experts


def _rows(stack: torch.Tensor | QuantizedExperts, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(stack, QuantizedExperts):
        return stack.rows_dequantized(start, end, dtype)
    return stack[start:end]


class MoE(nn.Module):
    def __init__(self, hidden: int, moe: MoeConfig, ops: LayerOps, linears: LinearFactory, prefix: str,
                 tp: TensorParallel | None = None) -> None:
        """`moe`: this rank's (its share of each expert's intermediate dimension under `tp`)."""
        super().__init__()
        self.moe = moe
        self.hidden = hidden
        self.tp = tp or TensorParallel.single()
        e, i = moe.num_experts, moe.intermediate_size
        self.gate = nn.Linear(hidden, e, bias=False)  # the router (its checkpoint name)
        # the stacks: quantized where the served model's quantization says (their paths name them, e.g.
        # "layers.3.mlp.experts_down", which `skip` may list), else parameters in the serving dtype
        self.experts_gate_up: nn.Parameter | QuantizedExperts = linears.experts(
            f"{prefix}.experts_gate_up", hidden, e * 2 * i) or nn.Parameter(torch.empty(e * 2 * i, hidden),
                                                                            requires_grad=False)
        self.experts_down: nn.Parameter | QuantizedExperts = linears.experts(
            f"{prefix}.experts_down", i, e * hidden, self.tp) or nn.Parameter(torch.empty(e * hidden, i),
                                                                              requires_grad=False)
        self.compute: ExpertsMethod = experts_method(ops)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden, moe.shared_intermediate_size, False, ops, linears,
                                          f"{prefix}.shared_expert")
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts [T, k] and their weights [T, k] (x's dtype) of each token of x [T, H]."""
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.moe.top_k, dim=-1)
        if self.moe.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's gated MLP of x [T, H] (a quantized stack's rows dequantized for it)."""
        i, h = self.moe.intermediate_size, self.hidden
        gate, up = F.linear(x, _rows(self.experts_gate_up, e * 2 * i, (e + 1) * 2 * i, x.dtype)).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, _rows(self.experts_down, e * h, (e + 1) * h, x.dtype))

    @property
    def stack_bytes(self) -> int:
        """The bytes both expert stacks take as stored (this rank's)."""
        stacks = (self.experts_gate_up, self.experts_down)
        return sum(s.storage().nbytes if isinstance(s, QuantizedExperts) else s.numel() * s.element_size()
                   for s in stacks)

    def destination(self, stack: str) -> str:
        """Where the loader writes stack `stack` ("experts_gate_up", "experts_down"), below this module: the
        parameter itself, or a quantized stack's storage ("experts_down.weight")."""
        return f"{stack}.weight" if isinstance(getattr(self, stack), QuantizedExperts) else stack

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for x [T, H] (the normed hidden states), plus `residual` where given: in the
        experts' last kernel when nothing comes after them (no shared expert, no all-reduce)."""
        alone = self.shared_expert is None and self.tp.size == 1
        out = self.compute(self, x, residual if alone else None)
        if alone:
            return out
        return self.after_experts(out, x, residual)

    def decode(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, pdl: bool,
               table: GemvTable | None = None) -> torch.Tensor:
        """The GPU's fused decode chain (ferrum.models.fused_decode): the block's output plus its residual
        `h` [T, H] (the hidden states before the block's RMSNorm, weight `norm_weight`). The norm runs in
        the router's kernel, which hands the normed rows to the experts; `pdl`: the per-pair experts' kernels
        launched with programmatic dependent launch (the router is not: ferrum.kernels.moe); `table`: the
        per-pair products' slicing (ferrum.kernels.moe.experts)."""
        from ferrum.kernels import moe as kernels

        config = self.moe
        routed = kernels.route_normed(h, self.gate.weight, config.top_k, config.normalize, norm_weight, eps)
        small = kernels.per_pair_fits(h.shape[0], config.top_k, config.num_experts)
        alone = self.shared_expert is None and self.tp.size == 1
        out = kernels.experts(routed.x, routed.chosen, routed.weights,
                              _kernel_stack(self.experts_gate_up, small, h.dtype),
                              _kernel_stack(self.experts_down, small, h.dtype), config.num_experts, per_pair=small,
                              residual=h if alone else None, pdl=pdl and small, table=table)
        if alone:
            return out
        return self.after_experts(out, routed.x, h)

    def after_experts(self, out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The routed experts' sum `out` plus the shared expert of x (the normed rows), summed across ranks,
        plus `residual` where given."""
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out = self.tp.all_reduce(out)
        return out if residual is None else out + residual

    def checkpoint_rows(self) -> list[tuple[str, str, tuple[int, int]]]:
        """(this module's parameter, the checkpoint tensor's name below the block, rows) for every
        expert's projections, e.g. ("experts_gate_up", "experts.3.gate_proj.weight", (192, 224))."""
        gate, up, down = self.moe.expert_names
        i, h = self.moe.intermediate_size, self.hidden
        rows = []
        for e in range(self.moe.num_experts):
            rows.append(("experts_gate_up", f"experts.{e}.{gate}.weight", (e * 2 * i, e * 2 * i + i)))
            rows.append(("experts_gate_up", f"experts.{e}.{up}.weight", (e * 2 * i + i, (e + 1) * 2 * i)))
            rows.append(("experts_down", f"experts.{e}.{down}.weight", (e * h, (e + 1) * h)))
        return rows
