"""The batched sampler against a float64 recompute and a chi-square test,
on the torch path and through the compiled `sample_rows` kernel
(`rollout.kernels`)."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from rollout.engine.sampler import MODE_CODES, SamplingBatch, counter_uniform, logprobs_of, sample
from rollout.kernels.build import cpu_ops
from tests.reference import processed_logprobs, top_p_edge_rows


@pytest.fixture(params=["torch", "compiled"])
def kernel(request):
    return cpu_ops().sample_rows if request.param == "compiled" else None


def _batch(rows: int, *, temperature, top_k, top_p, min_p, mode="processed", seed=0, index=None, pos=None):
    def col(values, dtype):
        t = torch.as_tensor(values, dtype=dtype)
        return t.expand(rows).clone() if t.dim() == 0 else t

    return SamplingBatch.of(
        col(temperature, torch.float32),
        col(top_k, torch.int64),
        col(top_p, torch.float32),
        col(min_p, torch.float32),
        col(MODE_CODES[mode], torch.int64) if isinstance(mode, str) else col(mode, torch.int64),
        seed=col(seed, torch.int64),
        sample_index=torch.arange(rows) if index is None else col(index, torch.int64),
        rng_pos=torch.zeros(rows, dtype=torch.int64) if pos is None else col(pos, torch.int64),
    )


def _run(logits, batch, kernel=None):
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    logprobs = torch.empty(logits.shape[0], dtype=torch.float32)
    sample(logits, batch, tokens, logprobs, kernel)
    return tokens, logprobs


def test_processed_logprobs_match_float64_recompute(kernel):
    g = torch.Generator().manual_seed(0)
    rows, vocab = 96, 50
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.3
    top_k = torch.randint(0, 12, (rows,), generator=g)
    top_p = torch.where(torch.rand(rows, generator=g) < 0.3, 1.0, torch.rand(rows, generator=g) * 0.9 + 0.05)
    min_p = torch.where(torch.rand(rows, generator=g) < 0.5, 0.0, torch.rand(rows, generator=g) * 0.3)
    batch = _batch(rows, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=3)
    tokens, logprobs = _run(logits, batch, kernel)
    for r in range(rows):
        ref = processed_logprobs(logits[r], temperature[r].item(), top_k[r].item(), top_p[r].item(), min_p[r].item())
        assert torch.isfinite(ref[tokens[r]]), f"row {r}: sampled a token the filters drop"
        assert abs(ref[tokens[r]].item() - logprobs[r].item()) < 2e-5, f"row {r}"


def test_raw_and_scaled_modes_and_greedy(kernel):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 30, generator=g) * 2
    temps = torch.tensor([0.7, 0.7, 0.7, 0.0, 0.0, 1.3])
    modes = torch.tensor([MODE_CODES[m] for m in ("raw", "scaled", "processed", "scaled", "processed", "scaled")])
    batch = _batch(6, temperature=temps, top_k=5, top_p=1.0, min_p=0.0, mode=modes)
    tokens, logprobs = _run(logits, batch, kernel)
    raw = torch.log_softmax(logits.double(), -1)
    scaled = torch.log_softmax(logits.double() / temps.clamp(min=1e-9).double()[:, None], -1)
    pick = tokens[:, None]
    expected = [raw[0], scaled[1], None, raw[3], raw[4], scaled[5]]
    for r, ref in enumerate(expected):
        if ref is not None:
            assert abs(ref.gather(0, pick[r]).item() - logprobs[r].item()) < 1e-5, f"row {r}"
    assert tokens[3] == logits[3].argmax() and tokens[4] == logits[4].argmax()


def test_all_greedy_batch(kernel):
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(2))
    logits[1, 7] = logits[1, 3] = logits[1].max() + 1  # a tie: the first maximum wins, as torch.argmax
    tokens, logprobs = _run(logits, _batch(4, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0), kernel)
    assert torch.equal(tokens, logits.argmax(-1))
    ref = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(logprobs.double(), ref, atol=1e-6)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.8, 6, 0.9, 0.0), (1.2, 0, 0.75, 0.05), (1.0, 0, 1.0, 0.1)],
)
def test_sampled_frequencies_follow_processed_distribution(temperature, top_k, top_p, min_p, kernel):
    logits = torch.tensor([2.0, 1.5, 1.2, 0.8, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0])
    draws = 40_000
    batch = _batch(draws, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=12345)
    tokens, _ = _run(logits.expand(draws, -1).contiguous(), batch, kernel)
    counts = torch.bincount(tokens, minlength=logits.numel()).double()
    ref = processed_logprobs(logits, temperature, top_k, top_p, min_p).exp()
    kept = ref > 0
    assert counts[~kept].sum() == 0, "sampled a token the filters drop"
    expected = ref[kept] * draws
    assert stats.chisquare(counts[kept], expected).pvalue > 1e-3
    # Power check: the same counts reject the unfiltered distribution when filters are on.
    if kept.sum() < logits.numel() or temperature != 1.0:
        unfiltered = torch.softmax(logits.double(), -1) * draws
        assert stats.chisquare(counts, unfiltered).pvalue < 1e-6


def test_counter_uniform_is_deterministic_and_uniform():
    n = 200_000
    seed = torch.full((n,), 987654321987, dtype=torch.int64)
    stream = torch.arange(n) % 8
    counter = torch.arange(n) // 8
    u = counter_uniform(seed, stream, counter)
    assert torch.equal(u, counter_uniform(seed, stream, counter))
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert stats.kstest(u.double().numpy(), "uniform").pvalue > 1e-3
    # Neighbouring streams and counters are uncorrelated.
    a, b = u[0::8].double(), u[1::8].double()
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.02
    other = counter_uniform(seed + 1, stream, counter)
    assert not torch.equal(u, other)


def test_compiled_counter_uniform_equals_the_torch_definition():
    """Bit for bit over the whole int64 range (negative seeds, counters past 2**32)."""
    g = torch.Generator().manual_seed(3)
    n = 100_000
    seed, stream, counter = (torch.randint(-(2**63), 2**63 - 1, (n,), generator=g) for _ in range(3))
    stream[:10], counter[:10], seed[:10] = 0, torch.arange(10), 0
    out = torch.empty(n)
    cpu_ops().counter_uniform(seed, stream, counter, out)
    assert torch.equal(out, counter_uniform(seed, stream, counter))
    with pytest.raises(RuntimeError, match="seed must be"):
        cpu_ops().counter_uniform(seed.float(), stream, counter, out)
    with pytest.raises(RuntimeError, match="counter must be"):
        cpu_ops().counter_uniform(seed, stream, counter[:5], out)


def _compiled(logits, temperature, mode, u, top_k=0, top_p=1.0, min_p=0.0):
    """`sample_rows` over `logits` `[R, V]` at the uniforms `u`; scalar settings apply to every row."""
    b = _batch(logits.shape[0], temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, mode=mode)
    tokens, logprobs = torch.empty(logits.shape[0], dtype=torch.int64), torch.empty(logits.shape[0])
    cpu_ops().sample_rows(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.mode, u, tokens, logprobs)
    return tokens, logprobs


def _inverse_cdf_float64(logits, temperature, mode, u):
    """Tokens and logprobs in float64: greedy rows take the first maximum and
    report the raw logprob; the others take the first token whose cumulative
    softmax(logits / T) mass exceeds u times the total."""
    tokens, logprobs = [], []
    for r in range(logits.shape[0]):
        x, t = logits[r].double(), float(temperature[r])
        raw = torch.log_softmax(x, -1)
        if t == 0:
            token = int(x.argmax())
            tokens.append(token)
            logprobs.append(float(raw[token]))
            continue
        scaled = torch.log_softmax(x / t, -1)
        cdf = scaled.exp().cumsum(-1)
        token = int(torch.searchsorted(cdf, float(u[r]) * cdf[-1], right=True))
        tokens.append(token)
        logprobs.append(float((raw if int(mode[r]) == MODE_CODES["raw"] else scaled)[token]))
    return torch.tensor(tokens), torch.tensor(logprobs, dtype=torch.float64)


@pytest.mark.parametrize("vocab", [50, 4096, 151936])  # 151936: Qwen2.5's vocabulary
def test_compiled_sampling_matches_a_float64_inverse_cdf(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 24
    logits = torch.randn(rows, vocab, generator=g) * (1 + 4 * torch.rand(rows, 1, generator=g))
    logits[5, : vocab // 2] = float("-inf")  # masked tokens: never drawn
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    temperature[:3], temperature[3:6] = 0.0, 1.0
    mode = torch.arange(rows) % 3
    u = torch.rand(rows, generator=g)
    tokens, logprobs = _compiled(logits, temperature, mode, u)
    expected_tokens, expected_logprobs = _inverse_cdf_float64(logits, temperature, mode, u)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logprobs.double(), expected_logprobs, rtol=0, atol=1e-5)
    assert tokens[5] >= vocab // 2


def test_compiled_sampling_walks_the_cdf_exactly_and_skips_impossible_tokens():
    """Weights exp(0) = 1 are exact, -inf and a logit 1000 below the top weigh 0: the mass
    after tokens 0..5 is 0, 1, 1, 2, 3, 4 of 4. u = 0 (target 0) skips the weightless token 0;
    u = 0.25 (target 1) passes over token 1 (mass not above 1) and token 2 (no mass)."""
    logits = torch.tensor([float("-inf"), 0.0, -1000.0, 0.0, 0.0, 0.0]).repeat(6, 1)
    u = torch.tensor([0.0, 0.2, 0.25, 0.5, 0.99, 1 - 2**-24])
    tokens, logprobs = _compiled(logits, 1.0, MODE_CODES["scaled"], u)
    assert tokens.tolist() == [1, 1, 3, 4, 5, 5]
    torch.testing.assert_close(logprobs, torch.full((6,), -torch.log(torch.tensor(4.0)).item()))


def test_a_uniform_of_zero_never_draws_a_token_far_below_the_top(kernel):
    """counter_uniform returns exactly 0 once in 2**24 draws; at T = 0.1 token 0 is
    e^200 times less likely than token 1 (float32 probability 0)."""
    logits = torch.tensor([[-20.0, 0.0], [float("-inf"), 0.0]])
    batch = _batch(2, temperature=0.1, top_k=0, top_p=1.0, min_p=0.0)
    batch.seed.zero_(), batch.sample_index.zero_()
    batch.rng_pos.fill_(8488778)  # the counter at which seed 0, stream 0 draws u = 0
    assert counter_uniform(batch.seed, batch.sample_index, batch.rng_pos).tolist() == [0.0, 0.0]
    tokens, logprobs = _run(logits, batch, kernel)
    assert tokens.tolist() == [1, 1]
    torch.testing.assert_close(logprobs, torch.zeros(2))


def test_greedy_rows_with_nan_take_the_nan_like_argmax(kernel):
    logits = torch.tensor([[0.0, 5.0, float("nan"), 9.0], [1.0, 3.0, 3.0, 2.0]])
    tokens, logprobs = _run(logits, _batch(2, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0), kernel)
    assert tokens.tolist() == [2, 1] == logits.argmax(-1).tolist()
    assert logprobs[0].isnan()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", -1.0, r"temperature\[1\] = -1 must be finite and >= 0"),
        ("temperature", float("nan"), r"temperature\[1\] = nan must be finite"),
        ("top_k", -1, r"top_k\[1\] = -1 must be >= 0"),
        ("top_p", 0.0, r"top_p\[1\] = 0 must be in \(0, 1\]"),
        ("min_p", 1.5, r"min_p\[1\] = 1.5 must be in \[0, 1\]"),
        ("mode", 3, r"mode\[1\] = 3 must be 0, 1 or 2"),
        ("uniform", 1.0, r"uniform\[1\] = 1 must be in \[0, 1\)"),
        ("logits", None, "logits must be a float32 CPU tensor"),
        ("out_tokens", None, "out_tokens must be a contiguous Long CPU tensor of 3 rows"),
    ],
)
def test_compiled_sampling_refuses_bad_inputs_before_writing(field, value, message):
    args = {
        "logits": torch.randn(3, 10),
        "temperature": torch.ones(3),
        "top_k": torch.zeros(3, dtype=torch.int64),
        "top_p": torch.ones(3),
        "min_p": torch.zeros(3),
        "mode": torch.zeros(3, dtype=torch.int64),
        "uniform": torch.full((3,), 0.5),
        "out_tokens": torch.full((3,), -7, dtype=torch.int64),
        "out_logprobs": torch.full((3,), 7.0),
    }
    if value is None:  # a wrong dtype
        args[field] = args[field].double()
    else:
        args[field][1] = value
    with pytest.raises(RuntimeError, match=message):
        cpu_ops().sample_rows(*args.values())
    assert args["out_logprobs"].tolist() == [7.0] * 3
    if field != "out_tokens":
        assert args["out_tokens"].tolist() == [-7] * 3


def _filtered_float64(logits, temperature, top_k, top_p, min_p, u):
    """Token and processed logprob per row in float64 (tests/reference.py's kept set,
    drawn by inverse CDF in vocabulary order)."""
    tokens, logprobs = [], []
    for r in range(logits.shape[0]):
        ref = processed_logprobs(logits[r], temperature, top_k, top_p, min_p)
        cdf = ref.exp().cumsum(-1)
        token = int(torch.searchsorted(cdf, float(u[r]) * cdf[-1], right=True))
        tokens.append(token)
        logprobs.append(float(ref[token]))
    return torch.tensor(tokens), torch.tensor(logprobs, dtype=torch.float64)


@pytest.mark.parametrize(
    "vocab, temperature, top_k, top_p, min_p",
    [
        (50, 0.8, 7, 1.0, 0.0),
        (50, 1.3, 0, 0.6, 0.0),
        (50, 1.0, 0, 1.0, 0.2),
        (50, 0.7, 10, 0.8, 0.05),
        (151936, 1.0, 50, 1.0, 0.0),  # Qwen2.5's vocabulary: candidates, not the whole row, are sorted
        (151936, 0.9, 0, 0.95, 0.0),
        (151936, 1.0, 0, 1.0, 0.01),
        (151936, 0.6, 200, 0.9, 0.02),
    ],
)
def test_compiled_filters_match_a_float64_reference(vocab, temperature, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(vocab + top_k)
    rows = 6
    logits = torch.randn(rows, vocab, generator=g) * torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0, 10.0])[:, None]
    u = torch.rand(rows, generator=g)
    tokens, logprobs = _compiled(logits, temperature, MODE_CODES["processed"], u, top_k, top_p, min_p)
    expected_tokens, expected_logprobs = _filtered_float64(logits, temperature, top_k, top_p, min_p, u)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logprobs.double(), expected_logprobs, rtol=0, atol=1e-5)


def test_compiled_filters_break_ties_by_token_id():
    """Tokens 1, 2 and 3 tie: top-k 2 keeps tokens 1 and 2, as a stable sort orders them."""
    logits = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0]).repeat(4, 1)
    tokens, logprobs = _compiled(logits, 1.0, MODE_CODES["processed"], torch.tensor([0.0, 0.4, 0.6, 0.99]), 2)
    assert tokens.tolist() == [1, 1, 2, 2]
    torch.testing.assert_close(logprobs, torch.full((4,), -torch.log(torch.tensor(2.0)).item()))


def test_compiled_rows_with_nan_or_inf_report_nan_at_the_nan_or_inf():
    """A corrupt row gets a NaN logprob on every path of the op, at the token
    torch.argmax would pick, instead of a finite logprob from a silently shrunk
    distribution."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, nan], [3.0, 2.0, inf, 0.0, 1.0]])
    for filters in [(0, 1.0, 0.0), (0, 0.3, 0.0), (2, 1.0, 0.0), (0, 1.0, 0.1)]:
        tokens, logprobs = _compiled(logits, 1.0, MODE_CODES["processed"], torch.tensor([0.99, 0.5]), *filters)
        assert tokens.tolist() == [4, 2] and logprobs.isnan().all(), filters


def test_top_p_edge_where_float32_sums_round_onto_top_p_keeps_the_engine_token():
    """Ten logits 2**-30 apart: distinct, ordered by id, each weighing exp(0) = 1 in float32.
    float32(0.1) lies above 1/10, so the mass before token 1, exactly a tenth, is below top_p:
    tokens 0 and 1 are kept. A float32 probability of 1/10 rounds to float32(0.1) itself,
    which is not below top_p: a float32 cumulative sum keeps token 0 alone and scores token 1,
    which the engine draws at u >= 0.5, as -inf."""
    logits = (-torch.arange(10, dtype=torch.float32) * 2**-30).repeat(4, 1)
    top_p = 0.1
    assert torch.softmax(logits[0], -1)[0] == torch.tensor(top_p)  # the float32 trap
    u = torch.tensor([0.0, 0.4, 0.6, 0.99])
    tokens, logprobs = _compiled(logits, 1.0, MODE_CODES["processed"], u, top_p=top_p)
    assert tokens.tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(logprobs, torch.full((4,), -torch.log(torch.tensor(2.0)).item()))
    batch = _batch(4, temperature=1.0, top_k=0, top_p=top_p, min_p=0.0)
    torch.testing.assert_close(logprobs_of(logits, tokens, batch), logprobs, rtol=0, atol=1e-6)
    # The torch path keeps the same two tokens: its draws and logprobs are the op's.
    u_tokens, u_logprobs = torch.empty_like(tokens), torch.empty_like(logprobs)
    sample(logits, batch, u_tokens, u_logprobs, None)  # uniforms of counter_uniform, not `u`
    assert set(u_tokens.tolist()) <= {0, 1}
    torch.testing.assert_close(u_logprobs, logprobs, rtol=0, atol=1e-6)


def test_stable_tie_rule_on_both_paths_including_signed_zeros(kernel):
    """Tokens 1 and 3 tie at -0 and +0 (equal, as comparisons see them): top-k 2 keeps the
    top token and the lower id of the tie, token 1, on both paths."""
    logits = torch.tensor([1.0, -0.0, -1.0, 0.0, -2.0]).repeat(4, 1)
    batch = _batch(4, temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=5)
    tokens, logprobs = _run(logits, batch, kernel)
    assert set(tokens.tolist()) <= {0, 1}
    final = logits[0].double().clone()
    final[[2, 3, 4]] = float("-inf")
    expected = torch.log_softmax(final, -1)[tokens]
    torch.testing.assert_close(logprobs.double(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(logprobs_of(logits, tokens, batch), logprobs, rtol=0, atol=1e-6)


def test_logprobs_of_scores_a_token_past_the_edge_among_the_kept_tokens_and_itself():
    """A token these logits' filters drop (another model's logits sampled it) gets its
    probability among the kept tokens and itself, with a gradient, never -inf; a kept token
    scores as `sample` reports it."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(3, 1).requires_grad_()
    batch = _batch(3, temperature=1.0, top_k=0, top_p=torch.tensor([0.5, 0.5, 1.0]), min_p=0.0)
    got = logprobs_of(logits, torch.tensor([0, 2, 2]), batch)  # top_p 0.5 keeps token 0 (p = 0.64)
    x = logits.detach()[0].double()
    expected = [0.0, float(x[2] - torch.logsumexp(x[[0, 2]], 0)), float(torch.log_softmax(x, -1)[2])]
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
    got[1].backward()
    assert logits.grad[1].tolist() == pytest.approx(
        [-torch.sigmoid(x[0] - x[2]).item(), 0.0, torch.sigmoid(x[0] - x[2]).item(), 0.0]
    )


@pytest.mark.parametrize("vocab", [16, 64, 1000])
def test_every_token_the_compiled_sampler_draws_at_the_top_p_edge_scores_finite(vocab):
    """Rows whose top_p sits where rounding decides the edge token. Uniforms near 1 draw the
    op's last kept tokens; the recompute scores each finite, and as the engine did but in a
    rare row where the two exps' last bits differ. Logits perturbed as a trainer's would be
    move the edge; the recompute stays finite. Both paths keep the same set: their processed
    logprobs agree."""
    g = torch.Generator().manual_seed(vocab)
    rows = 2000
    rare = rows // 100  # the two exps differ in a last bit in a few rows
    logits, temperature, top_p = top_p_edge_rows(rows, vocab, g)
    batch = _batch(rows, temperature=temperature, top_k=0, top_p=top_p, min_p=0.0, seed=vocab)
    u = (1 - torch.rand(rows, generator=g) ** 4).clamp(max=1 - 2**-24)
    tokens, logprobs = torch.empty(rows, dtype=torch.int64), torch.empty(rows)
    op = cpu_ops().sample_rows
    op(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.mode, u, tokens, logprobs)
    recomputed = logprobs_of(logits, tokens, batch)
    assert torch.isfinite(recomputed).all()
    trainer = logits + torch.randn(logits.shape, generator=g) * 1e-5
    assert torch.isfinite(logprobs_of(trainer, tokens, batch)).all()
    assert ((recomputed - logprobs).abs() > 1e-5).sum() <= rare

    _, compiled_logprobs = _run(logits, batch, op)
    _, torch_logprobs = _run(logits, batch)
    assert ((compiled_logprobs - torch_logprobs).abs() > 1e-5).sum() <= rare
