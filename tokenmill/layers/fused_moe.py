"""A sparse mixture-of-experts MLP: a router picks each token's top-k experts, and the experts' gated
MLPs run as one op over weights stored stacked.

Every expert's gate and up rows sit in one ``w13 [E, 2*I, H]`` (gate | up, as a dense MLP's
``gate_up_proj``) and its down projection in ``w2 [E, H, I]``, so one op (``ops.fused_experts``) takes
the whole layer: the torch reference today, a fused Triton kernel later, with no change here. The
routing (router matmul, softmax, top-k) stays on the device; nothing is read on the host.

Under tensor parallelism each expert is split as a dense MLP is: each rank holds its share of every
expert's ``I`` rows (column-parallel ``w13``, row-parallel ``w2``), the router is replicated, so every
rank routes alike, and one all-reduce sums the partial outputs. The checkpoint's per-expert tensors
are read straight into their slice of the stacked parameters (``FusedExperts.shard``).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed import all_reduce, current_group
from tokenmill.layers import ops
from tokenmill.layers.linear import Sharded, ShardRead, Split, whole

# The parts of ``w13`` a checkpoint stores apart, per expert: gate, then up.
GATE, UP = 0, 1


class Router(nn.Module):
    """The router's ``weight [E, H]``, replicated on every rank. Not an ``nn.Linear``, so that a
    quantization (``q8_0``, ``fp8``) leaves it dense: routing decisions are where rounding costs most."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The ``[T, E]`` router logits, in ``x``'s dtype."""
        return nn.functional.linear(x, self.weight)


class FusedExperts(nn.Module, Sharded):
    """Every expert's weights, stacked: ``w13 [E, 2*I_rank, H]`` and ``w2 [E, H, I_rank]`` with
    ``I_rank`` this rank's share of the intermediate rows."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp = current_group()
        self.num_experts = num_experts
        self.rows = Split(intermediate_size)
        local = self.rows.local_size(self.tp)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, local), requires_grad=False)

    @staticmethod
    def part(expert: int, piece: int = GATE) -> int:
        """The ``part`` of ``shard`` that one expert's checkpoint tensor fills: ``2 * expert + piece`` in
        ``w13`` (``GATE`` or ``UP``), ``expert`` in ``w2``."""
        return 2 * expert + piece

    def shard(self, param: str, part: int | None) -> ShardRead:
        """One expert's gate, up (``w13``) or down (``w2``) projection, this rank's rows (columns) of it;
        ``rows`` counts rows of the parameter seen as a matrix (``[E * 2 * I_rank, H]``, ``[E * H, I_rank]``),
        so the loader sees a parameter filled when every expert's parts are."""
        if part is None:
            return whole(getattr(self, param))
        local, hidden = self.rows.local_size(self.tp), self.w13.shape[-1]
        if param == "w13":
            expert, piece = divmod(part, 2)
            dest = self.w13.data[expert].narrow(0, piece * local, local)
            return ShardRead(dest, (self.rows.size, hidden), (self.rows.local_slice(self.tp),), local)
        if param == "w2":
            return ShardRead(
                self.w2.data[part], (hidden, self.rows.size), (slice(None), self.rows.local_slice(self.tp)), hidden
            )
        raise KeyError(param)


class SparseMoE(nn.Module):
    """The MLP of a sparse layer: ``gate`` (the router) and ``experts``, named as the checkpoints of
    Qwen3-MoE name them (Mixtral's names are mapped onto these by its model)."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be between 1 and the number of experts, {num_experts}")
        self.tp = current_group()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Router(num_experts, hidden_size)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for each row of ``x [T, H]`` (the normed stream), summed over the ranks."""
        topk_weights, topk_ids = ops.moe_routing(self.gate(x), self.top_k, self.renormalize)
        out = ops.fused_experts(x, self.experts.w13, self.experts.w2, topk_ids, topk_weights)
        return all_reduce(out, self.tp)
