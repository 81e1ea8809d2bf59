"""The Triton sampler (rollout/kernels/triton/sampling.py) against the torch
definition, rollout.engine.sampler, under Triton's interpreter: the same
uniforms bit for bit; the same tokens wherever u is not within rounding of a
CDF boundary (that margin measured per row from a float64 recompute); logprobs
to float32 rounding; the rows flagged inexact re-sampled by the definition."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from rollout.engine import sampler as reference
from rollout.engine.sampler import MODE_CODES, SamplingBatch
from rollout.kernels.triton import sampling as triton_sampling
from rollout.kernels.triton import uniform as triton_uniform

# The interpreter sorts slowly: small candidate counts keep the file fast, and
# make rows whose kept set reaches past the candidates easy to build.
FEW = 16


def _batch(rows, g, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, mode=None, greedy=0.0) -> SamplingBatch:
    def col(value, dtype):
        return torch.as_tensor(value, dtype=dtype).expand(rows).clone()

    temperature = col(temperature, torch.float32)
    temperature[torch.rand(rows, generator=g) < greedy] = 0
    mode = torch.randint(0, 3, (rows,), generator=g) if mode is None else col(MODE_CODES[mode], torch.int64)
    return SamplingBatch.of(
        temperature,
        col(top_k, torch.int64),
        col(top_p, torch.float32),
        col(min_p, torch.float32),
        mode,
        seed=torch.randint(-(2**62), 2**62, (rows,), generator=g),
        sample_index=torch.randint(0, 8, (rows,), generator=g),
        rng_pos=torch.randint(0, 2**20, (rows,), generator=g),
    )


def _logits(rows, vocab, g, *, scale=3.0, bf16=False):
    logits = torch.randn(rows, vocab, generator=g) * scale
    return logits.bfloat16().float() if bf16 else logits


def _run(sample, logits, p, **kwargs):
    rows = logits.shape[0]
    tokens = torch.full((rows,), -1, dtype=torch.int64)
    logprobs = torch.full((rows,), float("nan"))
    if sample is reference.sample:
        sample(logits, p, tokens, logprobs)
        return tokens, logprobs
    exact = torch.zeros(rows, dtype=torch.bool)
    sample(logits, p, tokens, logprobs, exact, **kwargs)
    return tokens, logprobs, exact


def _boundary_rows(logits, p, tokens):
    """Rows whose u lies within rounding of a CDF boundary next to the token the
    float64 CDF picks: there the definition's float32 cumsum and the kernel's
    float64 running sums may each pick a neighbour. The margin is the
    definition's measured float32 cumsum error plus the kernel's float32 weights'."""
    _, final = reference._distributions(logits, p)
    u = reference.counter_uniform(p.seed, p.sample_index, p.rng_pos).double()
    weight = torch.exp(final.double() - final.double().max(dim=-1, keepdim=True).values)
    cdf = weight.cumsum(-1) / weight.sum(-1, keepdim=True)
    margin = (torch.softmax(final, -1).cumsum(-1).double() - cdf).abs().amax(-1) + 1e-6
    exact_token = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp(max=logits.shape[1] - 1)
    below = cdf.gather(1, (exact_token - 1).clamp(min=0)[:, None]).squeeze(1).where(exact_token > 0, 0.0)
    above = cdf.gather(1, exact_token[:, None]).squeeze(1)
    near = ((u - below).abs() < margin) | ((above - u).abs() < margin)
    return near & (p.temperature != 0)


def _check(logits, p, *, candidates=triton_sampling.CANDIDATES, min_exact=1.0):
    """The kernel against the definition; returns the exactness flags."""
    tokens, logprobs, exact = _run(triton_sampling.sample, logits, p, candidates=candidates)
    expected_tokens, expected_logprobs = _run(reference.sample, logits, p)
    near = _boundary_rows(logits, p, expected_tokens)
    assert near.sum() <= max(1, len(near) // 50), f"{int(near.sum())} rows within rounding of a CDF boundary"
    compared = exact & ~near
    sampled = p.temperature != 0
    assert not sampled.any() or exact[sampled].float().mean() >= min_exact, f"exact: {exact.tolist()}"
    assert torch.equal(tokens[compared], expected_tokens[compared]), (tokens, expected_tokens, exact)
    # float32 logprobs; the definition's logsumexp may reduce in another order with another thread count.
    torch.testing.assert_close(logprobs[compared], expected_logprobs[compared], rtol=1e-6, atol=1e-5)
    redo = (~exact).nonzero().squeeze(1)
    if len(redo):  # the caller's fallback: the definition on the flagged rows alone
        again_tokens, again_logprobs = _run(reference.sample, logits[redo], p.rows(redo))
        assert torch.equal(again_tokens, expected_tokens[redo])
        assert torch.equal(again_logprobs, expected_logprobs[redo])
    return exact


def test_counter_uniform_is_the_definition_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    rows = 3000
    seed, stream, counter = (torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g) for _ in range(3))
    edges = torch.tensor([0, -1, 2**32 - 1, 2**32, -(2**31), 2**63 - 1, -(2**63), 8488778])
    seed[: len(edges)], stream[-len(edges) :], counter[100 : 100 + len(edges)] = edges, edges, edges
    out = torch.full((rows,), float("nan"))
    triton_uniform.counter_uniform(seed, stream, counter, out)
    assert torch.equal(out, reference.counter_uniform(seed, stream, counter))


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize(
    "params, scale, candidates",
    [
        (dict(temperature=0.7, greedy=0.3), 3.0, FEW),
        (dict(temperature=1.3, mode="raw"), 3.0, FEW),
        (dict(temperature=0.5, top_k=12, greedy=0.2), 3.0, 32),  # top-k within the candidates
        (dict(top_k=100, top_p=0.8), 8.0, FEW),  # top-k past the candidates: top-p must end the set among them
        (dict(top_k=2000, min_p=0.2), 3.0, FEW),  # top-k of the whole vocabulary or more, min-p ends the set
        (dict(temperature=0.9, top_p=0.6, greedy=0.2), 4.0, FEW),
        (dict(temperature=2.0, min_p=0.1), 10.0, FEW),
        (dict(top_k=8, top_p=0.9, min_p=0.05, greedy=0.1), 3.0, FEW),
    ],
    ids=lambda value: ",".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value),
)
def test_sample_is_the_definition(params, scale, candidates, bf16):
    g = torch.Generator().manual_seed(hash(tuple(params.items())) % 2**31 + bf16)
    rows, vocab = 16, 600
    logits = _logits(rows, vocab, g, scale=scale, bf16=bf16)
    _check(logits, _batch(rows, g, **params), candidates=candidates, min_exact=0.75)


def test_an_all_greedy_batch_and_a_nan_row_take_torch_argmax():
    g = torch.Generator().manual_seed(1)
    logits = _logits(6, 300, g, bf16=True)
    logits[1, 7] = logits[1, 9] = float("nan")
    p = _batch(6, g, temperature=0.0, top_p=0.5)
    tokens, logprobs, exact = _run(triton_sampling.sample, logits, p, candidates=FEW)
    expected_tokens, expected_logprobs = _run(reference.sample, logits, p)
    assert torch.equal(tokens, expected_tokens) and tokens[1] == 7 and exact.all()
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=1e-6, atol=2e-6, equal_nan=True)


def test_ties_at_the_top_k_and_top_p_edges_follow_the_lower_token_id():
    """Logits on a grid tie in runs: which of the tied tokens top-k keeps, and
    where the top-p edge falls inside a run, follow the stable order."""
    g = torch.Generator().manual_seed(2)
    rows, vocab = 12, 400
    logits = (torch.randn(rows, vocab, generator=g) * 6).round() * 0.25
    p = _batch(rows, g, top_k=torch.randint(1, 30, (rows,), generator=g), top_p=0.7)
    _check(logits, p, candidates=32)
    # Every token a candidate, so long runs of ties cannot straddle the candidates' edge.
    coarse = torch.randint(0, 4, (8, 64), generator=g).float()
    p = _batch(8, g, top_k=torch.randint(1, 40, (8,), generator=g), top_p=0.5)
    _check(coarse, p, candidates=64)
    four = torch.tensor([[1.0, 2.0, 2.0, 2.0, 2.0, 0.0]]).repeat(8, 1)  # top_p 0.5: exactly two of four
    _check(four, _batch(8, g, top_p=0.5), candidates=6)


def test_top_p_edge_where_float32_sums_round_onto_top_p_keeps_the_definition_tokens():
    """Weights all exactly 1: the mass before token 1, a tenth, lies below float32(0.1)."""
    logits = (-torch.arange(10, dtype=torch.float32) * 2**-30).repeat(16, 1)
    g = torch.Generator().manual_seed(3)
    tokens = _run(triton_sampling.sample, logits, _batch(16, g, top_p=0.1), candidates=4)[0]
    assert set(tokens.tolist()) == {0, 1}
    _check(logits, _batch(16, g, top_p=0.1), candidates=4)


def test_rows_whose_kept_set_may_pass_the_candidates_are_flagged():
    g = torch.Generator().manual_seed(4)
    rows, vocab = 8, 500
    peaked = _logits(rows, vocab, g, scale=8.0)
    assert _check(peaked, _batch(rows, g, top_p=0.9), candidates=FEW).all()
    flat = _logits(rows, vocab, g, scale=0.01)
    assert not _check(flat, _batch(rows, g, top_p=0.99), candidates=FEW, min_exact=0.0).any()
    # Top-k past the candidates with no other filter ending the set, and a top-k edge tied past them.
    assert not _check(peaked, _batch(rows, g, top_k=50, min_p=1e-30), candidates=FEW, min_exact=0.0).any()
    tied = torch.zeros(rows, 40)
    assert not _check(tied, _batch(rows, g, top_k=FEW), candidates=FEW, min_exact=0.0).any()
    assert _check(tied, _batch(rows, g, top_k=FEW), candidates=40).all()


def test_a_uniform_of_zero_skips_the_weightless_tokens():
    """At T = 0.1 tokens 1 and 2 weigh exp(-2010) and exp(-110): 0 in float32."""
    logits = torch.tensor([[float("-inf"), -200.0, -10.0, 1.0]]).repeat(4, 1)
    p = _batch(4, torch.Generator().manual_seed(5), temperature=0.1, top_k=torch.tensor([0, 0, 3, 3]))
    p.seed.zero_(), p.sample_index.zero_(), p.rng_pos.fill_(8488778)  # u = 0
    tokens, logprobs, exact = _run(triton_sampling.sample, logits, p, candidates=4)
    assert tokens.tolist() == [3, 3, 3, 3] == _run(reference.sample, logits, p)[0].tolist() and exact.all()


class _TorchOps(TorchDispatchMode):
    """Records the torch ops run inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_one_launch_and_topk_only_when_a_row_filters(monkeypatch):
    """The wrapper's own work per batch: the kernel's launch, and `torch.topk`
    when a sampled row filters. (The launch is recorded, not run: the
    interpreter's own copies would count as torch ops.)"""
    g = torch.Generator().manual_seed(6)
    logits = _logits(4, 100, g)
    launched = []
    monkeypatch.setattr(triton_sampling, "launch", lambda kernel, grid, *args, **meta: launched.append(kernel))
    for params, torch_ops in [
        (dict(temperature=0.8, greedy=0.5), []),
        (dict(top_p=0.5), ["topk.default"]),
        (dict(temperature=0.0, top_k=3), []),  # all greedy
    ]:
        p = _batch(4, g, **params)
        outputs = torch.empty(4, dtype=torch.int64), torch.empty(4), torch.empty(4, dtype=torch.bool)
        launched.clear()
        with _TorchOps() as recorded:
            triton_sampling.sample(logits, p, *outputs, candidates=FEW)
        assert launched == [triton_sampling._sample_rows]
        assert recorded.ops == torch_ops


@settings(max_examples=25, deadline=None)
@given(
    vocab=st.integers(2, 80),
    candidates=st.sampled_from([1, 4, 16]),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.integers(0, 90),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.01, 0.3]),
    grid=st.sampled_from([0.0, 0.25, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_random_settings_are_the_definition(vocab, candidates, temperature, top_k, top_p, min_p, grid, seed):
    g = torch.Generator().manual_seed(seed)
    logits = _logits(4, vocab, g, bf16=True)
    if grid:
        logits = (logits / grid).round() * grid
    p = _batch(4, g, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, greedy=0.25)
    _check(logits, p, candidates=candidates, min_exact=0.0)
