"""Attention over the paged KV pool for one flattened step.

A step's tokens are laid out prefill chunks first, then one token per
decoding sequence. Prefill chunks attend per chunk (a few per step, long).
Decodes attend as one batch: through `decode_kernel` when the step has one
(the compiled CPU kernel or the Triton one, `rollout.kernels`, reads each
row's pages in place), else over pages gathered into a padded copy and SDPA.
With `prefill_kernel` (Triton) all chunks attend to their pages in place in
one launch; without, each gathers its pages and runs SDPA. Masks and the
chunks' device tables are built once per step and shared by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workspace import KVPool


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk inside the flattened step."""

    token_start: int  # first row of the chunk in the step's token rows
    length: int  # tokens computed in this chunk
    context_len: int  # tokens in the sequence's context once the chunk is written
    block_table: torch.Tensor  # [pages] int64: the pages holding positions < context_len


@dataclass(slots=True)
class AttentionMetadata:
    """Where the step's keys go and what each query may attend to."""

    slot_mapping: torch.Tensor  # [T] KV slot (page * page_size + offset) of every step token
    prefills: list[PrefillSpan]  # chunks, in token order, before the decodes
    num_prefill_tokens: int  # rows [0, num_prefill_tokens) are prefill tokens
    num_decodes: int  # rows after the prefills: one token per decoding sequence
    decode_block_tables: torch.Tensor | None  # [num_decodes, P] pages of each decoding sequence
    decode_context_lens: torch.Tensor | None  # [num_decodes] tokens in context incl. the new one
    decode_kernel: Callable[..., None] | None = None  # paged decode attention in place (rollout.kernels)
    prefill_kernel: Callable[..., None] | None = None  # every chunk's attention in place, one launch
    _masks: dict = field(default_factory=dict)  # (kind, index, window) -> bool mask, built lazily

    def prefill_batch(self) -> PrefillBatch:
        """The chunks as device tensors for `prefill_kernel`, built on first use."""
        if "batch" not in self._masks:
            self._masks["batch"] = PrefillBatch.of(self.prefills)
        return self._masks["batch"]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """Bool `[length, context_len]` mask of chunk i; None when plain causal from 0 applies."""
        span = self.prefills[i]
        start = span.context_len - span.length
        if start == 0 and window is None:
            return None
        key = ("prefill", i, window)
        if key not in self._masks:
            device = span.block_table.device
            q_pos = torch.arange(start, span.context_len, device=device)[:, None]
            k_pos = torch.arange(span.context_len, device=device)[None, :]
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= k_pos > q_pos - window
            self._masks[key] = allowed
        return self._masks[key]

    def decode_mask(self, window: int | None, num_keys: int) -> torch.Tensor:
        """Bool `[num_decodes, 1, 1, num_keys]` mask over the gathered pages."""
        key = ("decode", window, num_keys)
        if key not in self._masks:
            lens = self.decode_context_lens
            k_pos = torch.arange(num_keys, device=lens.device)[None, :]
            allowed = k_pos < lens[:, None]
            if window is not None:
                allowed &= k_pos > (lens[:, None] - 1 - window)
            self._masks[key] = allowed[:, None, None, :]
        return self._masks[key]


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """A step's prefill chunks for one kernel launch: chunk c's queries are rows
    `[query_starts[c], query_starts[c] + query_lens[c])`, at the last positions of
    its `context_lens[c]` tokens, whose pages are `block_tables[c]`."""

    query_starts: torch.Tensor  # [C] int64
    query_lens: torch.Tensor  # [C] int64
    context_lens: torch.Tensor  # [C] int64
    block_tables: torch.Tensor  # [C, max pages] int64, rows zero-padded past their pages
    max_query_len: int  # the longest chunk, which sizes the launch grid

    @classmethod
    def of(cls, spans: list[PrefillSpan]) -> PrefillBatch:
        device = spans[0].block_table.device
        tables = torch.nn.utils.rnn.pad_sequence([s.block_table for s in spans], batch_first=True)
        counts = torch.tensor([(s.token_start, s.length, s.context_len) for s in spans], dtype=torch.int64)
        starts, lens, context = counts.t().contiguous().to(device)  # each row contiguous, as the kernel reads it
        return cls(starts, lens, context, tables, max(s.length for s in spans))


def paged_attention(
    q: torch.Tensor,
    layer: int,
    kv: KVPool,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Attention output `[T, Hq, D]` for queries `q` `[T, Hq, D]`.

    The step's own keys and values must already be written to `kv`.
    """
    out = torch.empty_like(q)
    if meta.prefills and meta.prefill_kernel is not None:
        b = meta.prefill_batch()
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        args = (b.block_tables, b.query_starts, b.query_lens, b.context_lens)
        meta.prefill_kernel(q, k_cache, v_cache, *args, out, scale, window or 0, b.max_query_len)
    for i, span in enumerate(meta.prefills if meta.prefill_kernel is None else ()):
        rows = slice(span.token_start, span.token_start + span.length)
        out[rows] = _prefill(q[rows], layer, kv, span, meta.prefill_mask(i, window), scale)
    if meta.num_decodes:
        rows = slice(meta.num_prefill_tokens, meta.num_prefill_tokens + meta.num_decodes)
        if meta.decode_kernel is not None:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            meta.decode_kernel(q[rows], kv.k[layer], kv.v[layer], tables, lens, out[rows], scale, window or 0)
        else:
            out[rows] = _decode(q[rows], layer, kv, meta, window, scale)
    return out


def _prefill(q, layer: int, kv: KVPool, span: PrefillSpan, mask, scale: float) -> torch.Tensor:
    k, v = kv.gather(layer, span.block_table)
    k, v = k[: span.context_len].to(q.dtype), v[: span.context_len].to(q.dtype)  # a bfloat16 pool under float32
    groups = q.shape[1] // kv.num_kv_heads
    if groups > 1:
        # On the CPU, SDPA with enable_gqa falls back to its math kernel, which
        # is far slower on long prompts; repeated heads keep the flash kernel.
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # 4-D inputs (a batch of one) select the flash kernel; 3-D ones do not.
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    return o[0].transpose(0, 1)


def _decode(q, layer: int, kv: KVPool, meta: AttentionMetadata, window: int | None, scale: float) -> torch.Tensor:
    # Decode keeps enable_gqa: at one query per sequence it beats repeating heads.
    k, v = kv.gather(layer, meta.decode_block_tables)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k.transpose(1, 2).to(q.dtype),
        v.transpose(1, 2).to(q.dtype),
        attn_mask=meta.decode_mask(window, k.shape[1]),
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(2)
