"""The Triton paged attention kernels (run under Triton's interpreter on the CPU)
against a float64 recompute over the same pages and against the torch path of
`rollout.model.attention`: GQA groups, scattered and forked block tables,
partial pages, sliding windows, poisoned memory past what a row owns, split-KV
and prefill chunks that start at 0 or continue a cached prefix.

Tolerances: float32 1e-5 absolute, float16 2e-3 absolute (16-bit dot operands,
float32 accumulation, the output rounded once to float16), against float64
computed from the same rounded inputs.
"""

from __future__ import annotations

import pytest
import torch

from rollout.kernels.triton import launches
from rollout.kernels.triton import paged_decode as decode_module
from rollout.kernels.triton.paged_decode import default_num_splits, paged_decode
from rollout.kernels.triton.paged_prefill import paged_prefill
from rollout.model.attention import AttentionMetadata, PrefillSpan, paged_attention
from workspace import KVPool

F32, F16 = torch.float32, torch.float16
ATOL = {F32: 1e-5, F16: 2e-3}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def paged_case(lens, hkv, dim, *, page_size, dtype=F32, pool_dtype=None, seed=0, poison=True):
    """Random q (strided rows) and a pool whose pages are scattered by a random permutation.

    Row 1 forks row 0: it shares row 0's first whole pages. With `poison`, table entries past
    a row's pages hold -1 or 10**9 and every pool slot no row owns (spare pages, the tail of
    a last partial page, the pages row 1 gave up by forking) holds NaN in K and inf in V.
    """
    g = torch.Generator().manual_seed(seed)
    need = [cdiv(n, page_size) for n in lens]
    num_pages = sum(need) + 4
    perm = torch.randperm(num_pages, generator=g)
    tables = torch.zeros(len(lens), max(need) + 5, dtype=torch.int64)
    if poison:
        tables[:, 0::2], tables[:, 1::2] = -1, 10**9
    for r, n in enumerate(need):
        tables[r, :n] = perm[sum(need[:r]) : sum(need[:r]) + n]
    if len(lens) > 1:
        shared = min(need[0], need[1]) - 1  # whole pages of both rows
        tables[1, :shared] = tables[0, :shared]
    k = torch.randn(num_pages, page_size, hkv, dim, generator=g).to(pool_dtype or dtype)
    v = torch.randn(num_pages, page_size, hkv, dim, generator=g).to(pool_dtype or dtype)
    if poison:
        owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
        for r, n in enumerate(lens):
            pos = torch.arange(n)
            owned[tables[r, pos // page_size] * page_size + pos % page_size] = True
        k.view(-1, hkv, dim)[~owned] = float("nan")
        v.view(-1, hkv, dim)[~owned] = float("inf")
    return k, v, tables, g


def strided_rows(rows, hq, dim, dtype, g, fill=None):
    """A `[rows, hq, dim]` view with a spare head on each side, as a slice of a fused projection."""
    if fill is None:
        return torch.randn(rows, hq + 2, dim, generator=g).to(dtype)[:, 1 : hq + 1]
    return torch.full((rows, hq + 2, dim), fill, dtype=dtype)[:, 1 : hq + 1]


def attend(q, k, v, q_pos, k_pos, scale, window):
    """Float64 attention of q `[L, Hq, D]` at positions q_pos over k, v `[n, Hkv, D]` at k_pos."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    group = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("lhd,nhd->hln", q.double(), kk) * scale
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hln,nhd->lhd", p, vv)


def owned_kv(k, v, table, n):
    """K, V `[n, Hkv, D]` of positions 0..n-1 read through one row of a block table."""
    pos = torch.arange(n)
    page, slot = table[pos // k.shape[1]], pos % k.shape[1]
    return k[page, slot], v[page, slot]


def reference_decode(q, k, v, tables, lens, scale, window):
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, n in enumerate(lens.tolist()):
        kr, vr = owned_kv(k, v, tables[r], n)
        out[r] = attend(q[r : r + 1], kr, vr, torch.tensor([n - 1]), torch.arange(n), scale, window)[0]
    return out


def reference_prefill(q, k, v, tables, starts, q_lens, lens, scale, window):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for c, (s, m, n) in enumerate(zip(starts.tolist(), q_lens.tolist(), lens.tolist(), strict=True)):
        kc, vc = owned_kv(k, v, tables[c], n)
        out[s : s + m] = attend(q[s : s + m], kc, vc, torch.arange(n - m, n), torch.arange(n), scale, window)
    return out


def assert_matches(out, expected, dtype):
    assert expected.abs().max() > 0.1  # a real result, not an empty or all-masked one
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=ATOL[dtype])


@pytest.mark.parametrize(
    "dtype, pool_dtype, hq, hkv, dim, page_size, window",
    [
        (F32, F32, 4, 4, 16, 4, 0),  # no GQA
        (F32, F32, 8, 4, 64, 16, 5),  # groups of 2, window shorter than most contexts
        (F32, F32, 8, 2, 16, 4, 100),  # groups of 4, window longer than every context
        (F16, F16, 8, 2, 64, 4, 0),
        (F32, F16, 4, 2, 16, 16, 7),  # a float16 pool under float32 queries
        (F32, F32, 6, 2, 24, 4, 3),  # groups of 3 and a head size that is no power of two
    ],
)
def test_decode_matches_a_float64_recompute(dtype, pool_dtype, hq, hkv, dim, page_size, window):
    lens = [21, 38, 1, page_size * 2, 9]  # a fork of row 0, one token, a whole last page
    k, v, tables, g = paged_case(lens, hkv, dim, page_size=page_size, dtype=dtype, pool_dtype=pool_dtype)
    q = strided_rows(len(lens), hq, dim, dtype, g)
    out = strided_rows(len(lens), hq, dim, dtype, g, fill=float("nan"))
    context_lens = torch.tensor(lens)
    paged_decode(q, k, v, tables, context_lens, out, dim**-0.5, window)
    assert_matches(out, reference_decode(q, k, v, tables, context_lens, dim**-0.5, window), dtype)
    assert out._base[:, [0, -1]].isnan().all()  # the neighbouring heads are not written


def test_a_window_shorter_than_the_context_changes_the_result():
    """The window cases above would not catch a window that is ignored unless it matters."""
    lens = torch.tensor([30, 30, 3])
    k, v, tables, g = paged_case(lens.tolist(), 2, 16, page_size=4)
    q = strided_rows(3, 4, 16, F32, g)
    windowed, full = torch.empty(3, 4, 16), torch.empty(3, 4, 16)
    paged_decode(q, k, v, tables, lens, windowed, 0.25, 5)
    paged_decode(q, k, v, tables, lens, full, 0.25, 0)
    assert (windowed[:2] - full[:2]).abs().max() > 0.1
    torch.testing.assert_close(windowed[2], full[2], rtol=0, atol=1e-6)  # 3 tokens fit in the window


@pytest.mark.parametrize("window", [0, 6])
def test_split_kv_equals_the_unsplit_result(window):
    """3 and 8 splits leave some splits empty for the short rows (and 8 for every row)."""
    lens = torch.tensor([45, 45, 1, 13])
    k, v, tables, g = paged_case(lens.tolist(), 2, 16, page_size=4, seed=1)
    q = strided_rows(4, 8, 16, F32, g)
    unsplit = torch.empty(4, 8, 16)
    paged_decode(q, k, v, tables, lens, unsplit, 0.25, window, num_splits=1)
    assert_matches(unsplit, reference_decode(q, k, v, tables, lens, 0.25, window), F32)
    for splits in (2, 3, 8):
        out = torch.empty(4, 8, 16)
        paged_decode(q, k, v, tables, lens, out, 0.25, window, num_splits=splits)
        torch.testing.assert_close(out, unsplit, rtol=0, atol=1e-6, msg=f"{splits} splits")


def test_split_kv_in_float16_writes_float16():
    lens = torch.tensor([40, 17])
    k, v, tables, g = paged_case(lens.tolist(), 1, 64, page_size=16, dtype=F16, seed=2)
    q, out = strided_rows(2, 4, 64, F16, g), strided_rows(2, 4, 64, F16, g, fill=0.0)
    paged_decode(q, k, v, tables, lens, out, 0.125, 0, num_splits=3)
    assert out.dtype == F16
    assert_matches(out, reference_decode(q, k, v, tables, lens, 0.125, 0), F16)


def test_launches_and_grids_do_not_depend_on_table_width_or_lengths(monkeypatch):
    grids, launch = [], decode_module.launch

    def recording_launch(kernel, grid, *args, **meta):
        grids.append(grid)
        launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(decode_module, "launch", recording_launch)
    for lens, slack in (([5, 9], 0), ([40, 2], 30)):
        k, v, tables, g = paged_case(lens, 2, 16, page_size=4)
        tables = torch.cat([tables, torch.full((2, slack), 10**9)], dim=1)
        q = strided_rows(2, 4, 16, F32, g)
        with launches() as names:
            paged_decode(q, k, v, tables, torch.tensor(lens), torch.empty(2, 4, 16), 0.25, 0, num_splits=1)
            paged_decode(q, k, v, tables, torch.tensor(lens), torch.empty(2, 4, 16), 0.25, 0, num_splits=3)
        assert names == ["paged_decode_kernel", "paged_decode_kernel", "merge_splits_kernel"]
    assert grids == [(2, 2, 1), (2, 2, 3), (2, 4)] * 2


def test_default_splits_favour_small_batches():
    cpu = torch.device("cpu")  # the interpreter stands in for 2 multiprocessors
    assert [default_num_splits(rows, 1, cpu) for rows in (1, 2, 3, 4, 100)] == [4, 2, 1, 1, 1]
    assert default_num_splits(1, 2, cpu) == 2


def prefill_case(chunks, hq, hkv, dim, *, page_size, dtype=F32, pool_dtype=None, seed=0):
    """chunks: (query_len, context_len) pairs; q has a spare row before, between and after them."""
    lens = [n for _, n in chunks]
    k, v, tables, g = paged_case(lens, hkv, dim, page_size=page_size, dtype=dtype, pool_dtype=pool_dtype, seed=seed)
    starts = torch.tensor([1 + sum(m + 1 for m, _ in chunks[:c]) for c in range(len(chunks))])
    q_lens, context_lens = torch.tensor([m for m, _ in chunks]), torch.tensor(lens)
    rows = int(starts[-1] + q_lens[-1]) + 1
    return q_lens, context_lens, starts, k, v, tables, strided_rows(rows, hq, dim, dtype, g)


@pytest.mark.parametrize(
    "dtype, pool_dtype, hq, hkv, dim, page_size, window",
    [
        (F32, F32, 2, 2, 16, 4, 0),  # no GQA
        (F32, F32, 4, 2, 64, 16, 0),  # groups of 2
        (F32, F32, 8, 2, 16, 4, 6),  # groups of 4, a window inside the chunks
        (F32, F32, 4, 1, 16, 4, 1000),  # a window longer than every context
        (F16, F16, 4, 2, 64, 4, 5),
        (F32, F16, 4, 2, 16, 16, 0),
    ],
)
def test_prefill_matches_a_float64_recompute(dtype, pool_dtype, hq, hkv, dim, page_size, window):
    # From position 0 (two query blocks when groups are small), continuing a cached prefix,
    # one token (a decode row), and continuing a prefix that was forked.
    chunks = [(19, 19), (6, 30), (1, 9), (5, 14)]
    q_lens, lens, starts, k, v, tables, q = prefill_case(
        chunks, hq, hkv, dim, page_size=page_size, dtype=dtype, pool_dtype=pool_dtype
    )
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, k, v, tables, starts, q_lens, lens, out, dim**-0.5, window, max_query_len=19)
    expected = reference_prefill(q, k, v, tables, starts, q_lens, lens, dim**-0.5, window)
    rows = torch.cat([torch.arange(s, s + m) for s, m in zip(starts.tolist(), q_lens.tolist(), strict=True)])
    assert_matches(out[rows], expected[rows], dtype)
    gaps = torch.ones(q.shape[0], dtype=torch.bool)
    gaps[rows] = False
    assert out[gaps].isnan().all()  # rows outside every chunk are left alone


def test_prefill_window_and_causality_matter():
    chunks = [(12, 12), (8, 20)]
    q_lens, lens, starts, k, v, tables, q = prefill_case(chunks, 4, 2, 16, page_size=4, seed=3)
    windowed, full = torch.zeros_like(q), torch.zeros_like(q)
    paged_prefill(q, k, v, tables, starts, q_lens, lens, windowed, 0.25, 4, max_query_len=12)
    paged_prefill(q, k, v, tables, starts, q_lens, lens, full, 0.25, 0, max_query_len=12)
    assert (windowed - full).abs().max() > 0.1
    # A chunk's first query attends to its own key alone at position 0.
    torch.testing.assert_close(full[1], v[tables[0, 0], 0].repeat_interleave(2, 0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("window", [None, 3])
def test_a_mixed_step_matches_the_torch_path(window):
    """Prefill chunks then decodes, through `paged_attention` (gather + SDPA) and the kernels."""
    page_size, hq, hkv, dim = 4, 4, 2, 16
    spans, decode_lens = [(0, 7, 7), (7, 5, 18)], [11, 3, 25]  # (token_start, length, context_len)
    k, v, tables, g = paged_case([n for *_, n in spans] + decode_lens, hkv, dim, page_size=page_size, poison=False)
    pool = KVPool(
        num_layers=1, num_pages=k.shape[0], page_size=page_size, num_kv_heads=hkv, head_dim=dim, dtype=F32, device="cpu"
    )
    pool.k[0], pool.v[0] = k, v
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(15, dtype=torch.int64),  # attention reads the pool only
        prefills=[PrefillSpan(s, m, n, tables[i, : cdiv(n, page_size)]) for i, (s, m, n) in enumerate(spans)],
        num_prefill_tokens=12,
        num_decodes=3,
        decode_block_tables=tables[2:],
        decode_context_lens=torch.tensor(decode_lens),
    )
    q = torch.randn(15, hq, dim, generator=g)
    expected = paged_attention(q, 0, pool, meta, dim**-0.5, window)
    out = torch.empty_like(q)
    starts, q_lens, lens = (torch.tensor(x) for x in zip(*spans, strict=True))
    paged_prefill(q, k, v, tables[:2], starts, q_lens, lens, out, dim**-0.5, window or 0, max_query_len=7)
    paged_decode(q[12:], k, v, tables[2:], meta.decode_context_lens, out[12:], dim**-0.5, window or 0)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_int32_index_tensors_give_the_int64_result():
    chunks = [(9, 9), (3, 20)]
    q_lens, lens, starts, k, v, tables, q = prefill_case(chunks, 4, 2, 16, page_size=4, seed=4)
    results = []
    for dtype in (torch.int64, torch.int32):
        index = [t.to(dtype) for t in (tables, starts, q_lens, lens)]
        prefill_out, decode_out = torch.zeros_like(q), torch.zeros(2, 4, 16)
        paged_prefill(q, k, v, *index, prefill_out, 0.25, 0, max_query_len=9)
        paged_decode(q[:2], k, v, index[0], index[3], decode_out, 0.25, 0, num_splits=2)
        results.append((prefill_out, decode_out))
    assert results[0][0].abs().max() > 0.1
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=torch.zeros(1, 3, 16), out=torch.zeros(1, 3, 16)), "multiple of its 2 kv heads"),
        (dict(out=torch.zeros(1, 2, 16, dtype=F16)), "must match q"),
        (dict(context_lens=torch.ones(2, dtype=torch.int64)), "context_lens"),
        (dict(num_splits=0), "num_splits must be at least 1"),
    ],
)
def test_bad_inputs_are_refused(change, message):
    pool = torch.zeros(4, 4, 2, 16)
    args = dict(q=torch.zeros(1, 2, 16), k_cache=pool, v_cache=pool, block_tables=torch.zeros(1, 1, dtype=torch.int64))
    args.update(context_lens=torch.ones(1, dtype=torch.int64), out=torch.zeros(1, 2, 16), scale=1.0, window=0)
    with pytest.raises(ValueError, match=message):
        paged_decode(**{**args, **change})
