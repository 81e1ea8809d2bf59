"""Prefill attention read in place from the paged KV pool: causal (and
optionally windowed) attention of several query chunks at once, each over
its own sequence's pages, with no page gather and no repeated KV heads.

A program holds BLOCK_M query tokens times all G query heads of one KV head
as a single `[BLOCK_M * BLOCK_G, D]` tile (row r is token r // BLOCK_G, head
r % BLOCK_G), so each key tile read from the pool serves the whole group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .paged_tiles import LOG2E, check_queries_and_pool, kv_offsets, load_kv, pow2, softmax_step

BLOCK_N = 32  # keys per inner step
TILE_ROWS = 64  # query rows (tokens x padded heads) per program, at least 16 for tl.dot


@triton.jit(do_not_specialize=["window"])  # one compiled kernel for every window, 1 included
def paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, starts_ptr, qlens_ptr, lens_ptr, out_ptr,
    qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_tc, stride_tw,
    stride_page, stride_slot, stride_head,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (chunk, query block, kv head): BLOCK_M of the chunk's tokens, every head of
    the group, over keys from the first one any of them may see (window) to the last
    one's position (causal); programs past the chunk's length exit at once."""
    chunk = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_len = tl.load(qlens_ptr + chunk)
    if block * BLOCK_M >= q_len:
        return
    ctx = tl.load(lens_ptr + chunk)
    block_first = ctx - q_len + block * BLOCK_M  # position of the block's first query
    hi = tl.minimum(block_first + BLOCK_M, ctx)  # keys end before hi
    lo = tl.where(window > 0, tl.maximum(block_first - window + 1, 0), 0)
    lo = (lo // PAGE_SIZE) * PAGE_SIZE  # from the start of the window's first page

    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    index = block * BLOCK_M + offs_r // BLOCK_G  # token index in the chunk
    head = kv_head * G + offs_r % BLOCK_G
    row_mask = (index < q_len) & (offs_r % BLOCK_G < G)
    q_pos = ctx - q_len + index
    token = tl.load(starts_ptr + chunk) + index
    q_offsets = token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    table_row = tables_ptr + chunk * stride_tc
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        offsets = kv_offsets(
            table_row, stride_tw, pos, valid, kv_head, offs_d, PAGE_SIZE, stride_page, stride_slot, stride_head
        )
        k, v = load_kv(k_ptr, v_ptr, offsets, valid, d_mask, q.dtype)
        allowed = pos[None, :] <= q_pos[:, None]
        allowed &= (window == 0) | (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = softmax_step(q, k, v, allowed & valid[None, :], qk_scale, m_i, l_i, acc)

    # Every real row sees at least its own key; padding rows divide by 1 and are not stored.
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offsets = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_offsets, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _check(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, out) -> None:
    check_queries_and_pool(q, k_cache, v_cache, out, "T")
    chunks = block_tables.shape[0]
    if block_tables.dim() != 2 or any(t.shape != (chunks,) for t in (query_starts, query_lens, context_lens)):
        raise ValueError(
            f"block_tables must be [C, W] and query_starts, query_lens, context_lens [C], got "
            f"{tuple(block_tables.shape)}, {tuple(query_starts.shape)}, {tuple(query_lens.shape)}, "
            f"{tuple(context_lens.shape)}"
        )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int,
    max_query_len: int,
) -> None:
    """Write into `out` `[T, Hq, D]` the causal attention of the chunks' queries `q` `[T, Hq, D]`.

    Chunk c (of C) owns rows query_starts[c] .. + query_lens[c] - 1 of q and out, its queries
    at positions context_lens[c] - query_lens[c] .. context_lens[c] - 1; it attends to keys at
    positions 0 .. context_lens[c] - 1 already written to the pool (its own included), in pages
    block_tables[c, :ceil(context_len / page_size)] (`[C, W]`; later entries are never read).
    Query position p sees key positions k <= p, and with window > 0 only k > p - window.
    Index tensors are `[C]` int64 (or int32) on q's device. k_cache, v_cache and out as in
    `paged_decode`. max_query_len (host int) must be >= every query_lens[c]: it sizes the
    grid, which depends on nothing else read from the device. Rows of q outside every
    chunk are left untouched in out.
    """
    _check(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, out)
    q_heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    block_g = pow2(group)
    block_m = max(1, TILE_ROWS // block_g)
    chunks = block_tables.shape[0]
    if chunks == 0 or max_query_len <= 0:
        return
    launch(
        paged_prefill_kernel, (chunks, triton.cdiv(max_query_len, block_m), kv_heads),
        q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, out,
        scale * LOG2E, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), block_tables.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=group, BLOCK_G=block_g, BLOCK_M=block_m, HEAD_DIM=dim, BLOCK_D=pow2(dim, 16),
        PAGE_SIZE=k_cache.shape[1], BLOCK_N=BLOCK_N,
    )  # fmt: skip
