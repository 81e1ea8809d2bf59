"""The compiled CPU kernels: paged decode attention against a float64
recompute over the same pages; the fused RMSNorm, rotary/KV-write and SiLU
ops against the torch ops they replace and float64; input checks; the build
cache; and the engine's choice of kernels (with the fallback when nothing can
be built). The compiled sampler is tested with the sampler, in
test_sampler.py."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from rollout import SamplingParams
from rollout.engine.config import EngineConfig, check_kernels
from rollout.kernels import build as cpu_kernels
from rollout.kernels import load_kernels
from rollout.kernels.build import KernelUnavailable, cpu_ops
from rollout.model.config import ModelConfig, RopeConfig
from rollout.model.decoder import rms_norm
from rollout.model.linear import GEMM_CHUNK, SKINNY_MAX_ROWS, gemm_plan, onednn_linear, pick_linear
from rollout.model.rope import RotaryTable
from tests.conftest import make_engine
from tests.factories import FAMILIES, CountingOps, hf_logprobs
from workspace import KVPool


def reference(q, k_cache, v_cache, tables, lens, scale, window):
    """Decode attention in float64, one row at a time, from the pages each row names."""
    rows, hq, _ = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(rows):
        n = int(lens[r])
        pages = tables[r, : -(-n // page_size)]
        k = k_cache[pages].reshape(-1, hkv, k_cache.shape[3])[:n].double()
        v = v_cache[pages].reshape(-1, hkv, v_cache.shape[3])[:n].double()
        first = max(0, n - window) if window else 0
        k, v = k[first:], v[first:]
        for h in range(hq):
            kv_head = h // (hq // hkv)
            p = torch.softmax(k[:, kv_head] @ q[r, h].double() * scale, dim=0)
            out[r, h] = p @ v[:, kv_head]
    return out


def random_case(rows, hq, hkv, dim, *, page_size=4, pages=64, dtype=torch.float32, seed=0, width_slack=2):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pages, page_size, hkv, dim, generator=g).to(dtype)
    v_cache = torch.randn(pages, page_size, hkv, dim, generator=g).to(dtype)
    lens = torch.randint(1, 6 * page_size, (rows,), generator=g)
    lens[0] = 1
    if rows > 1:
        lens[1] = 3 * page_size  # ends exactly on a page boundary
    width = int(-(-lens.max() // page_size)) + width_slack
    # A wider buffer viewed down to `width` columns, as the workspace hands it over.
    buffer = torch.randint(0, pages, (rows, width + 3), generator=g)
    buffer[:, 1] = buffer[:, 0]  # rows may list one page twice and share pages with other rows
    tables = buffer[:, :width]
    # q and out are views with gaps between rows, as slices of the step's fused projections.
    q = torch.randn(rows, hq + 2, dim, generator=g).to(dtype)[:, 1 : hq + 1]
    out = torch.full((rows, hq + 2, dim), float("nan"), dtype=dtype)[:, 1 : hq + 1]
    return q, k_cache, v_cache, tables, lens, out


@pytest.mark.parametrize(
    "rows, hq, hkv, dim, window, page_size",
    [
        (3, 4, 4, 64, 0, 4),  # few rows: heads split across threads; no GQA
        (17, 8, 2, 64, 0, 4),  # many rows: whole rows per work item; GQA groups of 4
        (17, 6, 3, 128, 7, 4),  # sliding window
        (5, 4, 2, 24, 0, 4),  # a head size without a specialised loop
        (9, 2, 1, 32, 100, 4),  # window wider than any context
        # Contexts past 16 tokens, whole and partial blocks of the intrinsics loops' reductions
        # (16 tokens with AVX-512, 8 with AVX2), and query groups wider than their pass 2 holds in
        # registers at once (AVX-512: 4 heads of 64, 2 of 128; AVX2: 6 heads of either):
        (7, 14, 2, 64, 0, 16),  # Qwen2.5-0.5B's heads, groups of 7 as 4 + 3 (AVX2: 6 + 1); 2 threads: items per KV head
        (9, 14, 2, 64, 0, 16),  # the same, whole rows per item
        (10, 12, 2, 128, 0, 16),  # groups of 6 as 2 + 2 + 2
        (10, 16, 2, 128, 0, 16),  # groups of 8 as 2 + 2 + 2 + 2 (AVX2: 6 + 2)
    ],
)
def test_float32_matches_a_float64_recompute(rows, hq, hkv, dim, window, page_size):
    q, k, v, tables, lens, out = random_case(rows, hq, hkv, dim, page_size=page_size, seed=rows + dim)
    cpu_ops().paged_decode(q, k, v, tables, lens, out, dim**-0.5, window)
    expected = reference(q, k, v, tables, lens, dim**-0.5, window)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("hq, hkv, dim", [(8, 4, 64), (14, 2, 64), (12, 2, 128), (4, 2, 24)])
def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch(hq, hkv, dim):
    """Rows computed together (whole rows per work item) and one at a time (KV heads split
    across threads) agree bit for bit: a sequence's logprobs do not depend on its batch."""
    q, k, v, tables, lens, out = random_case(12, hq, hkv, dim, page_size=16, seed=hq + dim)
    cpu_ops().paged_decode(q, k, v, tables, lens, out, dim**-0.5, 0)
    for r in range(12):
        alone = torch.empty(1, hq, dim)
        cpu_ops().paged_decode(q[r : r + 1], k, v, tables[r : r + 1], lens[r : r + 1], alone, dim**-0.5, 0)
        assert torch.equal(alone[0], out[r]), f"row {r}"


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_half_precisions_accumulate_in_float32(dtype, atol):
    q, k, v, tables, lens, out = random_case(11, 8, 4, 64, dtype=dtype, seed=3)
    cpu_ops().paged_decode(q, k, v, tables, lens, out, 0.125, 0)
    expected = reference(q, k, v, tables, lens, 0.125, 0)  # of the same rounded inputs
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=atol)


def test_only_each_rows_own_pages_are_read():
    """Poisoning every page a row does not own (and the padding past its length) changes nothing."""
    q, k, v, tables, lens, out = random_case(6, 4, 2, 64, seed=5, width_slack=0)
    cpu_ops().paged_decode(q, k, v, tables, lens, out, 0.125, 0)
    expected = out.clone()
    used = torch.zeros(k.shape[0] * k.shape[1], dtype=torch.bool)
    for r in range(6):
        n = int(lens[r])
        slots = tables[r, torch.arange(n) // 4] * 4 + torch.arange(n) % 4
        used[slots] = True
    k.view(-1, 2, 64)[~used] = float("nan")
    v.view(-1, 2, 64)[~used] = float("inf")
    cpu_ops().paged_decode(q, k, v, tables, lens, out, 0.125, 0)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(lens=a["lens"].clone().fill_(0)), r"context_lens\[0\] = 0 must be in \[1, "),
        (lambda a: a.update(lens=a["lens"] + 1000), r"block table width"),
        (lambda a: a.update(tables=a["tables"].clone().fill_(64)), r"is not a page of the pool \(0..63\)"),
        (lambda a: a.update(tables=a["tables"].int()), "must be int64"),
        (lambda a: a.update(k=a["k"].double(), v=a["v"].double()), "share one dtype"),
        (lambda a: a.update(q=a["q"][:, :3]), "must match q"),
        (lambda a: a.update(q=a["q"][:, :3], out=a["out"][:, :3]), "multiple of kv_heads"),
        (lambda a: a.update(k=a["k"][:, :, :0], v=a["v"][:, :, :0]), "kv_heads and head_dim of at least 1"),
    ],
)
def test_bad_inputs_are_refused_before_anything_is_written(change, message):
    q, k, v, tables, lens, out = random_case(4, 4, 2, 64)
    args = dict(q=q, k=k, v=v, tables=tables, lens=lens, out=out)
    change(args)
    before = args["out"].clone()
    with pytest.raises(RuntimeError, match=message):
        cpu_ops().paged_decode(*args.values(), 0.125, 0)
    assert torch.equal(args["out"].isnan(), before.isnan())


def test_build_is_cached_by_content(tmp_path, monkeypatch):
    """The build path on two small sources (the engine's own sources compile wherever their
    hash is new: every test that loads the kernels builds them then): compiled side by side,
    linked into one library named by the sources' hash, reused while they are unchanged and
    built anew beside the old one when one changes."""
    sources = tmp_path / "src"
    sources.mkdir()
    for name, value in (("one.cpp", 1), ("two.cpp", 2)):
        (sources / name).write_text(f'extern "C" int rollout_test_{name[:-4]}() {{ return {value}; }}\n')
    (sources / "header.h").write_text("#pragma once\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (sources / "one.cpp", sources / "two.cpp"))
    monkeypatch.setattr(cpu_kernels, "HEADERS", (sources / "header.h",))
    out = tmp_path / "kernels"
    monkeypatch.setenv("ROLLOUT_KERNEL_DIR", str(out))
    library = cpu_kernels._build()
    assert library.parent == out and library.suffix == ".so"
    built = ctypes.CDLL(str(library))
    assert (built.rollout_test_one(), built.rollout_test_two()) == (1, 2)  # both objects linked in
    mtime = library.stat().st_mtime_ns
    assert cpu_kernels._build() == library and library.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert sorted(p.name for p in out.iterdir()) == [library.name, library.name + ".lock"]  # no build leftovers
    (sources / "header.h").write_text("#pragma once\n// changed\n")
    rebuilt = cpu_kernels._build()
    assert rebuilt != library and rebuilt.parent == out and library.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [library.name, library.name + ".lock", rebuilt.name, rebuilt.name + ".lock"]
    )


def test_rms_norm_and_the_residual_add_match_torch():
    g = torch.Generator().manual_seed(7)
    h = torch.randn(37, 96, generator=g) * 3
    delta = torch.randn(37, 200, generator=g)[:, 50:146]  # a view with a row stride
    weight = torch.randn(96, generator=g)
    out = torch.empty(37, 96)
    cpu_ops().rms_norm(h, weight, 1e-6, out)
    torch.testing.assert_close(out, rms_norm(h, weight, 1e-6), rtol=2e-6, atol=1e-6)
    expected_h = h + delta
    cpu_ops().add_rms_norm_(h, delta, weight, 1e-6, out)
    assert torch.equal(h, expected_h)  # the residual is updated in place, bit for bit
    x = expected_h.double()
    reference = weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.double(), reference, rtol=2e-6, atol=1e-6)


def test_head_rms_norm_normalises_each_head_of_a_strided_view_in_place():
    """qwen3's q/k norms on views of the fused qkv output: each head over its own width,
    against a float64 recompute; the columns outside the view stay as they were."""
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(13, 5 * 24 + 7, generator=g) * 3
    before = qkv.clone()
    heads = qkv[:, 7:].view(13, 5, 24)  # row stride 127, head stride 24
    weight = torch.randn(24, generator=g)
    cpu_ops().head_rms_norm_(heads, weight, 1e-6)
    x = before[:, 7:].double().view(13, 5, 24)
    reference = weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(heads.double(), reference, rtol=2e-6, atol=1e-6)
    assert torch.equal(qkv[:, :7], before[:, :7])
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous float32 \[24\]"):
        cpu_ops().head_rms_norm_(heads, weight[:12], 1e-6)


def test_rope_and_cache_matches_the_rotary_table_and_pool_write():
    """q is rotated in place and rotated k and plain v land in the pool, bit for bit as the torch path."""
    g = torch.Generator().manual_seed(8)
    tokens, hq, hkv, dim = 13, 6, 2, 32
    table = RotaryTable(RopeConfig(theta=10000.0, type="default"), dim, 64, torch.float32, "cpu")
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=g)
    q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    q, k, v = q.view(tokens, hq, dim), k.view(tokens, hkv, dim), v.view(tokens, hkv, dim)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    slots = torch.randperm(5 * 4, generator=g)[:tokens]
    pools = [
        KVPool(
            num_layers=2, num_pages=5, page_size=4, num_kv_heads=hkv, head_dim=dim, dtype=torch.float32, device="cpu"
        )
        for _ in range(2)
    ]
    q_ref, k_ref = table.apply(q, k, positions)
    pools[0].write(1, slots, k_ref, v)
    cpu_ops().rope_and_cache_(q, k, v, positions, table.cos, table.sin, pools[1].k[1], pools[1].v[1], slots)
    assert torch.equal(q, q_ref)
    assert torch.equal(pools[1].k, pools[0].k) and torch.equal(pools[1].v, pools[0].v)


@pytest.mark.parametrize(
    "positions, slots, message",
    [
        ([0, 64], [0, 1], r"positions\[1\] = 64 is outside the table \(0..63\)"),
        ([0, 1], [0, 20], r"slots\[1\] = 20 is outside the pool \(0..19\)"),
    ],
)
def test_rope_and_cache_refuses_indices_outside_before_writing(positions, slots, message):
    table = RotaryTable(RopeConfig(theta=10000.0, type="default"), 8, 64, torch.float32, "cpu")
    q, k, v = torch.ones(2, 2, 8), torch.ones(2, 1, 8), torch.ones(2, 1, 8)
    k_cache, v_cache = torch.zeros(5, 4, 1, 8), torch.zeros(5, 4, 1, 8)
    with pytest.raises(RuntimeError, match=message):
        cpu_ops().rope_and_cache_(
            q, k, v, torch.tensor(positions), table.cos, table.sin, k_cache, v_cache, torch.tensor(slots)
        )
    assert torch.equal(q, torch.ones(2, 2, 8)) and not k_cache.any() and not v_cache.any()


def test_silu_mul_matches_float64_over_a_wide_range():
    gate = torch.linspace(-120, 120, 1001)
    up = torch.randn(1001, generator=torch.Generator().manual_seed(9))
    gate_up = torch.stack([torch.cat([gate, up]), torch.cat([-gate, up])])
    out = torch.empty(2, 1001)
    cpu_ops().silu_mul(gate_up, out)
    g64, u64 = gate_up[:, :1001].double(), gate_up[:, 1001:].double()
    torch.testing.assert_close(out.double(), g64 * torch.sigmoid(g64) * u64, rtol=3e-6, atol=1e-30)
    torch.testing.assert_close(
        out, torch.nn.functional.silu(gate_up[:, :1001]) * gate_up[:, 1001:], rtol=3e-6, atol=1e-30
    )


def test_without_a_compiler_auto_falls_back_and_compiled_refuses(qwen2, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_KERNEL_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    with pytest.raises(KernelUnavailable, match="no-such-compiler"):
        make_engine(qwen2.path, kernels="compiled")
    with pytest.warns(RuntimeWarning, match="falls back to kernels='torch'"):
        engine = make_engine(qwen2.path)
    assert engine.config.kernels == "torch" and engine.model._ops is None
    assert engine.stepper.decode_kernel is None and engine.stepper.sample_kernel is None
    out = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].samples[0].token_ids) == 4


def test_kernel_choice_per_device():
    assert check_kernels("auto", torch.device("cuda")) == "auto"  # Triton where installed, decided at load
    assert check_kernels("torch", torch.device("cpu")) == "torch"
    assert check_kernels("auto", torch.device("cpu")) == "auto"  # decided when the engine loads them
    assert check_kernels("compiled", torch.device("cpu")) == "compiled"
    with pytest.raises(ValueError, match="needs device 'cpu'"):
        check_kernels("compiled", torch.device("cuda"))
    with pytest.raises(ValueError, match=r"one of \('auto', 'compiled', 'triton', 'torch'\)"):
        check_kernels("fast", torch.device("cpu"))
    with pytest.raises(TypeError, match="kernels must be a str"):
        check_kernels(None, torch.device("cpu"))
    assert load_kernels("torch") is None
    assert load_kernels("auto").lib is cpu_ops() is load_kernels("compiled").lib  # this machine compiles them


def test_resolving_a_config_compiles_nothing(qwen2, tmp_path, monkeypatch):
    """Validation is pure: with no compiler and nothing built, "compiled" still
    resolves; only loading the kernels (as the engine does next) fails."""
    monkeypatch.setenv("ROLLOUT_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    sizes = dict(max_batch_size=4, max_seq_len=64, kv_cache_tokens=256, seed=0, page_size=16, max_step_tokens=None)
    mc = ModelConfig.from_dir(qwen2.path)
    for kernels in ("auto", "compiled"):
        assert EngineConfig.resolve(mc, device="cpu", dtype="float32", kernels=kernels, **sizes).kernels == kernels
    with pytest.raises(ValueError, match="page_size"):  # a bad argument raises before any build is tried
        make_engine(qwen2.path, kernels="compiled", page_size=0)
    assert cpu_kernels._loaded == {} and list(tmp_path.iterdir()) == []
    with pytest.raises(KernelUnavailable, match="no-such-compiler"):
        load_kernels("compiled")
    with pytest.warns(RuntimeWarning, match="falls back to kernels='torch'"):
        assert load_kernels("auto") is None


@pytest.mark.parametrize("family", FAMILIES)  # qwen3: q/k norms; mistral: sliding window, head_dim 32
def test_engine_compiled_kernels_match_the_torch_path(checkpoints, family):
    """Same tokens and logprobs through both paths, with shared prompt pages
    and preemption (a KV pool of 10 pages for 12 sequences of 3-5 pages)."""
    params = SamplingParams(n=4, max_tokens=40, seed=1, ignore_eos=True)
    prompts = [list(range(3, 3 + k)) for k in (5, 23, 40)]
    results, preemptions = {}, {}
    for kernels in ("compiled", "torch"):
        engine = make_engine(checkpoints[family].path, kernels=kernels, kv_cache_tokens=16 * 10)
        assert engine.config.kernels == kernels and (engine.model._ops is not None) == (kernels == "compiled")
        results[kernels] = engine.generate(prompts, params)
        preemptions[kernels] = engine.stats()["preemptions"]
    assert preemptions["compiled"] == preemptions["torch"] > 0
    for ours, theirs in zip(results["compiled"], results["torch"], strict=True):
        for a, b in zip(ours.samples, theirs.samples, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)  # qwen2: q/k/v biases; qwen3: q/k norms; mistral: sliding window
# 21 rows per step (padded to 22 for oneDNN) and 9; 2 and 1: skinny_linear's steps (SKINNY_MAX_ROWS)
@pytest.mark.parametrize("n", [7, 3, 2, 1])
def test_decode_layers_op_equals_the_python_layer_loop(checkpoints, family, n):
    """Pure-decode steps run every layer in one op, bit for bit as the Python
    loop (q/k norms too); prefill steps keep the loop."""
    params = SamplingParams(n=n, max_tokens=30, seed=5, ignore_eos=True)
    prompts = [list(range(3, 3 + k)) for k in (4, 19, 33)][: 3 if n > 2 else 1]
    results, calls = {}, {}
    for one_op in (True, False):
        engine = make_engine(checkpoints[family].path)
        engine.model._one_op &= one_op
        engine.model._cpu = counting = CountingOps(engine.model._cpu)
        results[one_op] = [(s.token_ids, s.logprobs) for out in engine.generate(prompts, params) for s in out.samples]
        calls[one_op] = counting.calls["decode_layers"]
        # Steps of one or two rows project through skinny_linear: the LM head at least, on both paths.
        assert (counting.calls["skinny_linear"] > 0) == (n * len(prompts) <= SKINNY_MAX_ROWS)
    assert results[True] == results[False]
    decode_steps = max(len(tokens) for tokens, _ in results[True]) - 1  # the first step prefills
    assert calls == {True: decode_steps, False: 0}


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("k", [64, 100, 1408])  # 100: a tail past the 32-lane blocks
def test_skinny_linear_matches_a_float64_recompute(rows, k):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(300, k, generator=g), torch.randn(300, generator=g)
    expected = x.double() @ w.double().T
    ops = cpu_ops()
    torch.testing.assert_close(ops.skinny_linear(x, w, None).double(), expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(ops.skinny_linear(x, w, b).double(), expected + b.double(), rtol=0, atol=1e-4)
    wide = torch.randn(rows, k + 7, generator=g)[:, 3 : 3 + k]  # rows with gaps between them
    expected = wide.double() @ w.double().T
    torch.testing.assert_close(ops.skinny_linear(wide, w, None).double(), expected, rtol=0, atol=1e-4)


def test_skinny_linear_refuses_what_it_cannot_compute():
    ops, w = cpu_ops(), torch.randn(8, 16)
    with pytest.raises(RuntimeError, match=f"1 to {SKINNY_MAX_ROWS} rows, got {SKINNY_MAX_ROWS + 1}"):
        ops.skinny_linear(torch.randn(SKINNY_MAX_ROWS + 1, 16), w, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.skinny_linear(torch.randn(1, 16, dtype=torch.float64), w.double(), None)
    with pytest.raises(RuntimeError, match=r"weight \[N, K\]"):
        ops.skinny_linear(torch.randn(1, 15), w, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.skinny_linear(torch.randn(1, 16), w, torch.randn(7))
    if torch.backends.mkldnn.is_available():
        with pytest.raises(RuntimeError, match="MkldnnCPU"):  # packed: not the [N, K] layout it reads
            ops.skinny_linear(torch.randn(1, 16), torch.ops.mkldnn._reorder_linear_weight(w, None), None)


def test_a_step_that_samples_nothing_runs_on_the_compiled_kernels(qwen2):
    """A prompt longer than the step budget prefills over several steps; those before its
    last chunk sample no row, so the LM head gets none."""
    engine = make_engine(qwen2.path, kernels="compiled", max_batch_size=8, max_step_tokens=8)
    prompt = list(range(3, 33))
    out = engine.generate([prompt], SamplingParams(max_tokens=5, seed=4, ignore_eos=True, logprobs_mode="raw"))[0]
    sample = out.samples[0]
    ref = hf_logprobs(qwen2.hf, prompt, sample.token_ids)
    torch.testing.assert_close(torch.tensor(sample.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)


def test_batch_one_decoding_through_skinny_linear_matches_transformers(qwen2):
    engine = make_engine(qwen2.path)
    engine.model._cpu = counting = CountingOps(engine.model._cpu)
    prompt = list(range(3, 20))
    out = engine.generate([prompt], SamplingParams(max_tokens=20, seed=2, ignore_eos=True, logprobs_mode="raw"))[0]
    assert counting.calls["skinny_linear"] > 0
    sample = out.samples[0]
    ref = hf_logprobs(qwen2.hf, prompt, sample.token_ids)
    torch.testing.assert_close(torch.tensor(sample.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)


def test_half_precision_engines_keep_the_torch_elementwise_ops(qwen2):
    """bf16 keeps the reference's rounding steps: only decode attention and the
    sampler (over float32 logits) are compiled."""
    engine = make_engine(qwen2.path, dtype="bfloat16")
    assert engine.config.kernels == "compiled" and engine.stepper.decode_kernel is not None
    assert engine.stepper.sample_kernel is not None and engine.model._ops is None


@pytest.mark.parametrize("rows", [37, 1100])  # 37: padded to 40; 1100: two chunks of 512 and 76 rows padded to 80
def test_onednn_linear_matches_a_float64_recompute(rows):
    g = torch.Generator().manual_seed(10)
    x, w, b = torch.randn(rows, 96, generator=g), torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    expected = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(onednn_linear(x, w, b).double(), expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(onednn_linear(x, w).double(), expected - b.double(), rtol=0, atol=1e-4)


# The row counts oneDNN multiplies at, by hand: every count below 16, eight sizes
# per doubling from 16 to GEMM_CHUNK (each the top of its eighth), and 0.
GEMM_SIZES = (
    set(range(16))
    | set(range(16, 33, 2))
    | set(range(36, 65, 4))
    | set(range(72, 129, 8))
    | set(range(144, 257, 16))
    | set(range(288, 513, 32))
)


def test_gemm_plan_covers_the_rows_with_a_bounded_set_of_shapes():
    """Every row in order, at most 1/8 padding, and the hand-counted 57 sizes whatever the rows."""
    assert GEMM_CHUNK == 512 and len(GEMM_SIZES) == 57
    for rows in range(3000):
        plan = gemm_plan(rows)
        assert sum(r for r, _ in plan) == rows and all(p in GEMM_SIZES for _, p in plan), rows
        assert all(r <= p <= max(r * 9 / 8, r) for r, p in plan), (rows, plan)
        assert all(r == p == GEMM_CHUNK for r, p in plan[:-1]), (rows, plan)


def test_onednn_builds_a_bounded_set_of_shapes(capfd):
    """oneDNN keeps a primitive per shape it multiplies (up to 1024, 0.6-2 MB each): GEMMs of
    every row count from 1 to 1100 run at the hand-counted sizes alone, read from oneDNN's own
    log of what it executed. Unpadded, each count was a shape of its own."""
    w = torch.randn(24, 40)  # a weight shape no other test multiplies
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        for rows in range(1, 1101):
            onednn_linear(torch.ones(rows, 40), w)
    executed = {int(m) for m in re.findall(r"mb(\d+)ic40oc24\b", capfd.readouterr().out)}
    assert executed == GEMM_SIZES - {0}


def test_the_picked_linear_computes_a_linear_without_touching_the_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    name, linear = pick_linear(64)
    assert torch.equal(torch.rand(3), expected)
    assert (name, linear) == (
        ("onednn", onednn_linear) if torch.backends.mkldnn.is_available() else ("blas", torch.nn.functional.linear)
    )
    x, w = torch.randn(5, 64), torch.randn(128, 64)
    torch.testing.assert_close(linear(x, w).double(), x.double() @ w.double().T, rtol=0, atol=1e-4)


def test_engines_name_their_gemm_and_leave_the_global_rng_alone(qwen2):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert make_engine(qwen2.path).model.gemm in ("blas", "onednn")
    assert torch.equal(torch.rand(3), expected)
    assert make_engine(qwen2.path, kernels="torch").model.gemm == "torch"


def test_a_compiler_with_arguments_is_split_like_a_shell(monkeypatch):
    monkeypatch.setenv("CXX", "ccache g++ -pipe")
    assert cpu_kernels._compiler() == ["ccache", "g++", "-pipe"]
    monkeypatch.delenv("CXX")
    assert cpu_kernels._compiler() == ["c++"]
