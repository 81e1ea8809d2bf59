"""Decode attention read in place from the paged KV pool: one query token per
row, every query head of a KV head in one program, optionally split along
the context (split-KV) and merged by log-sum-exp.

Same contract as the CPU op `torch.ops.rollout.paged_decode`. The launch grid
depends only on the number of rows, the heads and `num_splits`, never on the
block table's width or the context lengths, and nothing is read back to the
host, so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import launch
from .paged_tiles import LOG2E, check_queries_and_pool, kv_offsets, load_kv, pow2, softmax_step

BLOCK_N = 32  # keys per inner step (any page size: pages are looked up per key)
MAX_SPLITS = 16  # beyond this the merge costs more than the extra parallelism gains
CPU_MULTIPROCESSORS = 2  # stand-in for the interpreter: small batches still get split


@triton.jit(do_not_specialize=["window"])  # one compiled kernel for every window, 1 included
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr,
    qk_scale, window,
    stride_qn, stride_qh, stride_tn, stride_tw,
    stride_page, stride_slot, stride_head,
    stride_on, stride_oh, stride_os, stride_ln, stride_lh,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Program (row, kv head, split): attention of the row's G query heads over the split's
    share of the row's pages. Writes `out[row, head, split]` (the final output cast to its
    type, or a float32 partial) and, with WRITE_LSE, the log2-sum-exp per head (-inf when the
    split is empty)."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + row)
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # first position the window keeps
    first_page = first // PAGE_SIZE
    end_page = (ctx + PAGE_SIZE - 1) // PAGE_SIZE
    per_split = (end_page - first_page + tl.num_programs(2) - 1) // tl.num_programs(2)
    lo_page = first_page + split * per_split
    hi = tl.minimum(tl.minimum(lo_page + per_split, end_page) * PAGE_SIZE, ctx)  # keys end before hi

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask, d_mask = offs_g < G, offs_d < HEAD_DIM
    head = kv_head * G + offs_g
    q_offsets = row * stride_qn + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = tables_ptr + row * stride_tn
    for start in range(lo_page * PAGE_SIZE, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = (pos >= first) & (pos < hi)
        offsets = kv_offsets(
            table_row, stride_tw, pos, valid, kv_head, offs_d, PAGE_SIZE, stride_page, stride_slot, stride_head
        )
        k, v = load_kv(k_ptr, v_ptr, offsets, valid, d_mask, q.dtype)
        m_i, l_i, acc = softmax_step(q, k, v, valid[None, :], qk_scale, m_i, l_i, acc)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split writes zeros and lse -inf
    o = acc / l_safe[:, None]
    out_offsets = row * stride_on + head[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(out_ptr + out_offsets, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if WRITE_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + row * stride_ln + head * stride_lh + split, lse, mask=g_mask)


@triton.jit
def merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pn, stride_ph, stride_ps, stride_ln, stride_lh, stride_on, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Program (row, query head): the splits' partial outputs `[S, D]` weighted by their
    share of the softmax mass, 2^(lse_s - max lse); empty splits (lse -inf) weigh 0."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + row * stride_ln + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    # At least one split holds the row's current token, so the max is finite.
    weight = tl.exp2(lse - tl.max(lse, 0))
    part_offsets = row * stride_pn + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    part = tl.load(part_ptr + part_offsets, mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    o = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + row * stride_on + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM
    )


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """Splits per (row, kv head) so that about two programs run per multiprocessor:
    `clamp(2 * multiprocessors // (rows * kv_heads), 1, MAX_SPLITS)`.

    Small batches get up to 16 splits (an H200's 132 multiprocessors: 16 at 1 row of 8 KV
    heads, 2 at 16 rows, 1 from 33 rows); on the CPU the interpreter stands in for 2
    multiprocessors, so 1 to 3 (row, kv head) pairs are split. The rule reads no tensor, so
    it is fixed for a batch size and safe under graph capture.
    """
    return max(1, min(MAX_SPLITS, 2 * _multiprocessors(torch.device(device)) // max(1, rows * kv_heads)))


def _check(q, k_cache, v_cache, block_tables, context_lens, out) -> None:
    check_queries_and_pool(q, k_cache, v_cache, out, "N")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(
            f"block_tables must be [N, W] and context_lens [N], got {tuple(block_tables.shape)}, "
            f"{tuple(context_lens.shape)} for N = {q.shape[0]}"
        )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int,
    num_splits: int | None = None,
) -> None:
    """Write into `out` `[N, Hq, D]` the attention of `q` `[N, Hq, D]`, one query token per row.

    k_cache, v_cache: one layer of the pool, `[pages, page_size, Hkv, D]`, contiguous, in q's
    dtype or another float type (converted on load). block_tables `[N, W]` and context_lens
    `[N]` (int64 or int32): row n attends to positions 0 .. context_lens[n] - 1 (>= 1, the
    current token's K/V already written), held in pages block_tables[n, :ceil(len / page_size)];
    entries past those are never read. window: 0 for none, else only positions
    > context_len - 1 - window. `out` must have q's dtype; rows may be strided.
    num_splits: programs per (row, kv head) along the context (default `default_num_splits`).
    Above 1, float32 partials `[N, Hq, S, D]` and log-sum-exps `[N, Hq, S]` are allocated per
    call (allowed in graph capture) and merged by a second launch.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens, out)
    rows, q_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    splits = default_num_splits(rows, kv_heads, q.device) if num_splits is None else num_splits
    if splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if rows == 0:
        return
    if splits == 1:
        target, lse, target_strides = out, out, (out.stride(0), out.stride(1), 0, 0, 0)
    else:
        target = torch.empty(rows, q_heads, splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows, q_heads, splits, dtype=torch.float32, device=q.device)
        target_strides = (target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1))
    group = q_heads // kv_heads
    launch(
        paged_decode_kernel, (rows, kv_heads, splits),
        q, k_cache, v_cache, block_tables, context_lens, target, lse,
        scale * LOG2E, window,
        q.stride(0), q.stride(1), block_tables.stride(0), block_tables.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *target_strides,
        G=group, BLOCK_G=pow2(group, 16), HEAD_DIM=dim, BLOCK_D=pow2(dim, 16),
        PAGE_SIZE=k_cache.shape[1], BLOCK_N=BLOCK_N, WRITE_LSE=splits > 1,
    )  # fmt: skip
    if splits > 1:
        launch(
            merge_splits_kernel, (rows, q_heads),
            target, lse, out, splits,
            target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=dim, BLOCK_D=pow2(dim, 16), BLOCK_S=pow2(splits),
        )  # fmt: skip
