"""Tiles shared by the paged attention kernels: keys and values read in place
from the pool through a block table, and one step of the online softmax.

Positions are token indices in a sequence; a position's page is
`table[pos // page_size]` and its slot in that page `pos % page_size`. Only
positions a caller marks valid are looked up, so table entries past a
sequence's pages (stale or out-of-range ids) and pool pages it does not own
are never read. Scores are kept in log2 units (the softmax scale times
log2(e) folded into one multiplier) so the kernels use `exp2`.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

LOG2E = 1.0 / math.log(2.0)  # scores * scale * LOG2E are base-2 logits


def check_queries_and_pool(q, k_cache, v_cache, out, rows: str) -> None:
    """Raise `ValueError` unless q and out are `[rows, Hq, D]` alike, contiguous in D, and
    k/v_cache one contiguous `[pages, page_size, Hkv, D]` pool layer with Hkv dividing Hq."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q must be [{rows}, Hq, D] and k/v_cache [pages, page_size, Hkv, D], got {q.shape}, "
            f"{k_cache.shape}, {v_cache.shape}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must be contiguous and share one dtype")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} must share head_dim with the pool and hold a multiple of its "
            f"{k_cache.shape[2]} kv heads"
        )
    if out.shape != q.shape or out.dtype != q.dtype or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype}; both contiguous in head_dim"
        )


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least): a block dimension covering n."""
    return max(triton.next_power_of_2(n), least)


@triton.jit
def kv_offsets(
    table_row_ptr,
    stride_tw,
    pos,
    valid,
    kv_head,
    offs_d,
    PAGE_SIZE: tl.constexpr,
    stride_page,
    stride_slot,
    stride_head,
):
    """Element offsets `[BLOCK_N, BLOCK_D]` into one layer's K (or V) pool of the keys at
    positions `pos` `[BLOCK_N]` of head `kv_head`; entries where `valid` is false point at
    page 0 and must be loaded masked."""
    page = tl.load(table_row_ptr + (pos // PAGE_SIZE) * stride_tw, mask=valid, other=0).to(tl.int64)
    token = page * stride_page + (pos % PAGE_SIZE) * stride_slot + kv_head * stride_head
    return token[:, None] + offs_d[None, :]


@triton.jit
def load_kv(k_ptr, v_ptr, offsets, valid, d_mask, DOT_DTYPE: tl.constexpr):
    """K and V tiles at `offsets`, zero where masked, converted to the dot operand type."""
    mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + offsets, mask=mask, other=0.0).to(DOT_DTYPE)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(DOT_DTYPE)
    return k, v


@triton.jit
def softmax_step(q, k, v, allowed, qk_scale, m_i, l_i, acc):
    """Fold one key block into the running softmax of every query row.

    q `[R, BLOCK_D]`, k and v `[BLOCK_N, BLOCK_D]` (dot operand type), allowed `[R, BLOCK_N]`
    bool; m_i (running max, log2 units) and l_i (running sum) `[R]` and acc `[R, BLOCK_D]`
    float32. A row that has seen no allowed key keeps m_i = -inf, l_i = 0 and acc = 0.
    """
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing allowed yet subtract 0 instead of -inf, which would give NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # Probabilities enter the PV product in the operand type (16-bit under 16-bit queries,
    # as flash attention does); the sum over keys accumulates in float32.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    return m_new, l_i, acc
