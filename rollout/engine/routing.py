"""Routed experts of mixture-of-experts models, per position.

The forward writes the experts each token went to into the KV pool's routing
pages, at the token's KV slot (`workspace.KVPool.write_routing`), so pages
carry their routing: a prefix-cache hit, a forked group's shared prompt and a
session's kept KV come with the routing of the computation whose keys and
values later tokens attend to. A sequence's routing is copied to the host
(`RoutingReader.save`) whenever it is about to lose its pages (finish,
preemption, recompute, restart) or keeps them for a session's next turn;
positions computed again overwrite what was saved, so a sample's routing is
that of the KV it ended with.
"""

from __future__ import annotations

import numpy as np
import torch

from workspace import KVPool

from ..model.config import ModelConfig
from .sequence import Sequence


def routing_dtype(num_experts: int) -> torch.dtype:
    """Expert ids fit a byte up to 256 experts, else int16 (`MoeConfig` caps experts at 2**15)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def pool_routing(mc: ModelConfig) -> tuple[int, int, torch.dtype] | None:
    """The KV pool's `routing` argument for a model: None for a dense one."""
    moe = mc.moe
    return None if moe is None else (moe.num_moe_layers, moe.top_k, routing_dtype(moe.num_experts))


class RoutingReader:
    """Copies sequences' routing from the pool's pages to the host, for the requests that ask."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size

    @classmethod
    def of(cls, pool: KVPool) -> RoutingReader | None:
        return None if pool.routing is None else cls(pool)

    def save(self, seq: Sequence) -> None:
        """Keep `seq`'s routing of its computed positions in `seq.routed` `[positions, layers, top_k]`;
        positions saved before and not computed since (a preempted tail) are kept."""
        if not seq.request.params.return_routed_experts or not seq.num_computed_tokens:
            return
        n, ps = seq.num_computed_tokens, self.page_size
        pages = torch.tensor(seq.block_table[: -(-n // ps)], dtype=torch.int64)
        slots = (pages[:, None] * ps + torch.arange(ps)).flatten()[:n]
        now = self.pool.read_routing(slots.to(self.pool.routing.device)).cpu().numpy()
        old = seq.routed
        seq.routed = now if old is None or len(old) <= n else np.concatenate([now, old[n:]])
