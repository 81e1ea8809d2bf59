"""Routing replay for mixture-of-experts training models (transformers'
Qwen3-MoE and Mixtral): the trainer's forward sends every token to the
experts the rollout engine routed it to (`RolloutBatch.routed_experts`),
instead of the experts its own router picks, so a near-tie that falls the
other way in the trainer's numerics does not change the model the logprobs
and gradients are taken under.

Only the choice is forced: the gate weights of the recorded experts are
recomputed from the trainer's router logits as the model computes them
(softmax in float32, renormalised over the chosen experts where the model
does so), so gradients still reach the router. Positions recorded as -1
(padding, a response's last token, which the engine never computed) keep
the trainer's own choice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def sparse_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of `model`'s sparse blocks in layer order: the `gate` of every
    module that has both a `gate` and `experts` (transformers' MoE blocks)."""
    return [
        m.gate for m in model.modules() if isinstance(getattr(m, "gate", None), nn.Module) and hasattr(m, "experts")
    ]


@contextmanager
def routing_replay(model: nn.Module, routed_experts: torch.Tensor) -> Iterator[None]:
    """Within the block, forwards of `model` on a `[B, T]` input use the experts
    `routed_experts` `[B, T, sparse layers, top_k]` (integer; -1: the model's own
    choice at that position), e.g. `batch.routed_experts` for `batch.input_ids`.

    Raises `TypeError`/`ValueError` naming the problem: not an integer tensor, a
    model without sparse blocks, a layer count or top-k that disagree with the
    model; a forward whose token count is not `B * T` raises `ValueError`.
    """
    routers = sparse_routers(model)
    if not isinstance(routed_experts, torch.Tensor) or routed_experts.is_floating_point():
        raise TypeError(f"routed_experts must be an integer torch.Tensor, got {type(routed_experts).__name__}")
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts blocks (modules with `gate` and `experts`)")
    if routed_experts.dim() != 4 or routed_experts.shape[2] != len(routers):
        raise ValueError(
            f"routed_experts must be [batch, tokens, {len(routers)} sparse layers, top_k], "
            f"got shape {tuple(routed_experts.shape)}"
        )
    top_k = routers[0].top_k
    if routed_experts.shape[3] != top_k:
        raise ValueError(f"routed_experts has top_k {routed_experts.shape[3]}; the model routes to {top_k} experts")
    flat = routed_experts.reshape(-1, len(routers), top_k)
    handles = [r.register_forward_hook(_replay_hook(flat[:, j])) for j, r in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _replay_hook(recorded: torch.Tensor):
    def hook(router: nn.Module, args, output):
        logits, _, own = output  # transformers' routers return (logits, top-k weights, top-k experts)
        if logits.shape[0] != recorded.shape[0]:
            raise ValueError(
                f"routing replay: the forward routes {logits.shape[0]} tokens, routed_experts holds "
                f"{recorded.shape[0]} (batch x tokens); replay the input the experts were recorded for"
            )
        chosen = recorded.to(own.device, own.dtype)
        experts = torch.where((chosen >= 0).all(-1, keepdim=True), chosen, own)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, experts)
        # Qwen3-MoE renormalises when its config says so and casts to the logits' dtype;
        # Mixtral always renormalises and keeps float32 (transformers' routers, as written).
        qwen_style = hasattr(router, "norm_topk_prob")
        if not qwen_style or router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype) if qwen_style else weights, experts

    return hook
