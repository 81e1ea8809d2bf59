"""Mixture-of-experts layers (qwen3_moe, mixtral): the experts' weights, their
checkpoint names, and the sparse block's forward.

A sparse layer keeps its experts stacked along rows: `experts_gate_up`
`[E * 2I, H]` (expert e's gate then up projection at rows `e * 2I`) and
`experts_down` `[E * H, I]`, plus the router `[E, H]`. One expert, or the
router alone, is then a row range of one parameter, so the loader and weight
pushes (`weight_slots.py`) copy a slice, and transformers' fused
`[E, 2I, H]` / `[E, H, I]` tensors are the same memory seen with another shape.

The forward routes as transformers does (softmax over the router logits in
float32, top-k, renormalised when the config says so), then groups the
token-expert pairs by expert: one gather, one gate/up and one down GEMM per
expert that received tokens, and one `index_add_` back, in expert order as the
reference accumulates. No loop runs over tokens; the loop over experts reads
their counts on the host once per layer. On the CPU with the compiled kernels
the whole layer is one op (`moe_block`, `csrc/moe_block.cpp`): routing,
grouping, the experts and the combine, the threads sharing the experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .moe_config import MoeConfig

if TYPE_CHECKING:
    from .config import ModelConfig
    from .weight_slots import WeightSlot


class SparseMLP(nn.Module):
    """The router and stacked experts of one sparse layer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        moe, h = cfg.moe, cfg.hidden_size
        e, i = moe.num_experts, moe.intermediate_size

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.router = empty(e, h)
        self.experts_gate_up = empty(e * 2 * i, h)
        self.experts_down = empty(e * h, i)


def sparse_mlp(x: torch.Tensor, block: SparseMLP, moe: MoeConfig, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse block on `x` `[T, H]`: its output `[T, H]` in `x`'s dtype and the
    experts each token went to, `[T, top_k]` int64 in descending gate order.

    `ops`: the model's `layer_ops` backend, or None for torch's ops. Where it
    has `moe_block` (the compiled CPU kernels) the whole layer is that op on
    float32; elsewhere its `silu_mul(gate_up, out)` takes the activation.
    """
    t, h = x.shape
    e, k, inter = moe.num_experts, moe.top_k, moe.intermediate_size
    whole = getattr(ops, "moe_block", None)
    if whole is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        return whole(x.contiguous(), block.router, block.experts_gate_up, block.experts_down, k, moe.norm_topk_prob)
    logits = F.linear(x, block.router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if moe.weights_in_model_dtype:
        weights = weights.to(x.dtype)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)  # token-expert pairs grouped by expert, tokens in order
    tokens = order // k
    counts = torch.bincount(flat, minlength=e)
    pair_weights = weights.flatten().index_select(0, order)
    rows = x.index_select(0, tokens)
    gate_up = block.experts_gate_up.view(e, 2 * inter, h)
    down = block.experts_down.view(e, h, inter)
    silu_mul = None if ops is None else ops.silu_mul
    if use_grouped_mm(x, moe):
        out = grouped_experts(rows, gate_up, down, counts, silu_mul)
        scaled = (out * pair_weights[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, scaled), experts
    out = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            act = _act(F.linear(rows[start : start + n], gate_up[expert]), silu_mul)
            out[start : start + n] = F.linear(act, down[expert])
            start += n
    scaled = (out * pair_weights[:, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, scaled), experts


# Whether CUDA models run their experts as two grouped GEMMs (`grouped_experts`)
# where `use_grouped_mm` allows; False keeps the per-expert loop (to compare them).
GROUPED_MM = True


def use_grouped_mm(x: torch.Tensor, moe: MoeConfig) -> bool:
    """`torch._grouped_mm` for the experts: on CUDA, for bfloat16, on a GPU of
    compute capability 9.0 or later (its kernels are built for those), and
    with rows of 16-byte multiples (H and the expert width multiples of 8)."""
    return (
        GROUPED_MM
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and x.shape[1] % 8 == 0
        and moe.intermediate_size % 8 == 0
    )


def grouped_experts(
    rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor, silu_mul=None
) -> torch.Tensor:
    """Every expert's output for `rows` `[P, H]` grouped by expert (`counts` per
    expert), as two grouped GEMMs (`torch._grouped_mm`, with `gate_up`
    `[E, 2I, H]` and `down` `[E, H, I]` seen transposed) and one activation:
    no loop over experts and no read of the counts on the host. Plain torch,
    so it also runs on the CPU, where the tests check it."""
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    act = _act(torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets), silu_mul)
    return torch._grouped_mm(act, down.transpose(1, 2), offs=offsets)


def _act(gate_up: torch.Tensor, silu_mul) -> torch.Tensor:
    if silu_mul is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    silu_mul(gate_up, out)
    return out


def expert_slots(cfg: ModelConfig, i: int, block: SparseMLP) -> dict[str, WeightSlot]:
    """The checkpoint names of layer `i`'s router and experts: per expert
    (qwen3_moe `mlp.experts.N.{gate,up,down}_proj`, mixtral
    `block_sparse_moe.experts.N.{w1,w3,w2}`), and the names transformers' own
    modules carry (`mlp.gate`, fused `mlp.experts.gate_up_proj` `[E, 2I, H]` and
    `mlp.experts.down_proj` `[E, H, I]`), which its `state_dict()` pushes."""
    from .weight_slots import WeightSlot

    moe, h = cfg.moe, cfg.hidden_size
    e, inter = moe.num_experts, moe.intermediate_size
    p, lp = f"model.layers.{i}.", f"layers.{i}.mlp."
    gate_up, down = (lp + "experts_gate_up", block.experts_gate_up), (lp + "experts_down", block.experts_down)
    router = WeightSlot(lp + "router", block.router, 0, e)
    slots = {
        p + "mlp.gate.weight": router,
        p + "mlp.experts.gate_up_proj": WeightSlot(*gate_up, 0, e * 2 * inter, (e, 2 * inter, h)),
        p + "mlp.experts.down_proj": WeightSlot(*down, 0, e * h, (e, h, inter)),
    }
    if cfg.model_type == "mixtral":
        prefix, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
        slots[prefix + "gate.weight"] = router
    else:
        prefix, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    for n in range(e):
        expert = f"{prefix}experts.{n}."
        slots[expert + f"{names[0]}.weight"] = WeightSlot(*gate_up, n * 2 * inter, inter)
        slots[expert + f"{names[1]}.weight"] = WeightSlot(*gate_up, n * 2 * inter + inter, inter)
        slots[expert + f"{names[2]}.weight"] = WeightSlot(*down, n * h, h)
    return slots
