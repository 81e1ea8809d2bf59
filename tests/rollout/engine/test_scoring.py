"""`Engine.score` and `SamplingParams.prompt_logprobs`: teacher-forced logprobs
by prefill, against transformers' log-softmax over the same checkpoint's logits
(float32), in chunks, batched with decodes, through the prefix cache and across
weight pushes."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout import SamplingParams
from rollout.engine import score_requests, scoring
from rollout.engine.shared_scores import Share, plan_shares
from rollout.kernels import cpu_ops
from tests.conftest import make_engine
from tests.reference import processed_logprobs

SEQS = [list(range(3, 45)), [7, 9, 11] + list(range(20, 37)), [5, 6]]
TOL = 1e-5


def _reference(hf, ids, temperature=1.0):
    """float32 log-softmax `[len(ids), V]` of transformers' logits: row i scores token i + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, -1)


def _check(scored, ref, ids, k, start=1):
    assert scored.token_ids == ids and len(scored.logprobs) == len(ids)
    assert scored.logprobs[:start] == [None] * start
    for i in range(start, len(ids)):
        assert abs(scored.logprobs[i] - ref[i - 1, ids[i]].item()) < TOL, f"position {i}"
        if not k:
            continue
        top = scored.top_logprobs[i]
        values, best = ref[i - 1].topk(k)
        assert set(top) == set(best.tolist()) | {ids[i]}, f"position {i}"
        for token, value in top.items():
            assert abs(value - ref[i - 1, token].item()) < TOL
    if not k:
        assert scored.top_logprobs is None


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_score_equals_transformers_log_softmax_in_chunks(checkpoints, family):
    ckpt = checkpoints[family]
    engine = make_engine(ckpt.path, max_batch_size=4, max_step_tokens=16)  # chunks of 16: several per sequence
    k = 3 if family != "llama" else 0
    for scored, ids in zip(engine.score(SEQS, top_logprobs=k), SEQS, strict=True):
        _check(scored, _reference(ckpt.hf, ids), ids, k)
        assert scored.version == 0


@pytest.mark.parametrize("kernels", ["compiled", "torch"])
def test_score_batched_with_a_running_decode(qwen2, kernels):
    """The background driver steps a stream once, then waits in its step callback:
    every step of the score (on this thread) also decodes the stream's sample."""
    release, steps = threading.Event(), []

    def hold_background(info):
        steps.append(info)
        if threading.current_thread().name == "rollout-background-steps":
            assert release.wait(timeout=60)

    engine = make_engine(
        qwen2.path, kernels=kernels, max_batch_size=4, max_step_tokens=16, step_callback=hold_background
    )
    params = SamplingParams(max_tokens=20, ignore_eos=True, seed=1)
    stream = engine.stream([1, 2, 3], params)
    next(iter(stream))  # its first token: it is running
    scored = engine.score(SEQS, top_logprobs=2)
    release.set()
    for s, ids in zip(scored, SEQS, strict=True):
        _check(s, _reference(qwen2.hf, ids), ids, 2)
    assert all(info.num_sampled == 1 and info.num_tokens > 1 for info in steps[1:4])  # score chunks + its decode
    sample = [item for item in stream][-1].samples[0]
    alone = engine.generate([[1, 2, 3]], params)[0].samples[0]
    assert sample.token_ids == alone.token_ids  # scoring beside it changed nothing it sampled


def test_prompt_logprobs_in_generation(qwen2):
    engine = make_engine(qwen2.path, max_batch_size=4, max_step_tokens=32)
    prompt = SEQS[0]
    params = SamplingParams(n=3, max_tokens=6, ignore_eos=True, seed=5, prompt_logprobs=4)
    out = engine.generate([prompt], params)[0]
    ref = _reference(qwen2.hf, prompt)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i] - ref[i - 1, prompt[i]].item()) < TOL
        top = out.prompt_top_logprobs[i]
        assert set(top) == set(ref[i - 1].topk(4).indices.tolist()) | {prompt[i]}
    plain = engine.generate([prompt], SamplingParams(n=3, max_tokens=6, ignore_eos=True, seed=5))[0]
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in plain.samples]
    assert plain.prompt_logprobs is None and plain.prompt_top_logprobs is None
    zero = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert zero.prompt_logprobs == pytest.approx(out.prompt_logprobs, abs=TOL) and zero.prompt_top_logprobs is None


def test_scaled_and_processed_modes_follow_the_sampling_distribution(qwen2):
    engine = make_engine(qwen2.path)
    ids = SEQS[0]
    scaled = engine.score([ids], params=SamplingParams(temperature=0.7, logprobs_mode="scaled"))[0]
    ref = _reference(qwen2.hf, ids, temperature=0.7)
    assert all(abs(scaled.logprobs[i] - ref[i - 1, ids[i]].item()) < TOL for i in range(1, len(ids)))
    params = SamplingParams(temperature=0.7, top_k=6)
    processed = engine.score([ids], top_logprobs=3, params=params)[0]
    with torch.no_grad():
        logits = qwen2.hf(torch.tensor([ids])).logits[0]
    for i in range(1, len(ids)):
        expected = processed_logprobs(logits[i - 1], 0.7, 6, 1.0, 0.0)
        if torch.isfinite(expected[ids[i]]):  # a token the filters drop is scored as kept (`logprobs_of`)
            assert abs(processed.logprobs[i] - expected[ids[i]].item()) < 1e-4
        for token, value in processed.top_logprobs[i].items():
            if token != ids[i]:
                assert abs(value - expected[token].item()) < 1e-4


def test_prefix_cache_serves_the_unwanted_prefix_and_gives_cold_numbers(qwen2):
    prompt = list(range(3, 40))  # two full pages of 16, then the part scored
    answers = [prompt + [50, 51, 52, 53, 54], prompt + [60, 61, 62]]
    engine = make_engine(qwen2.path)
    cold = make_engine(qwen2.path).score(answers, top_logprobs=2, start=len(prompt))
    engine.generate([prompt], SamplingParams(max_tokens=1))  # fills the cache with the prompt's pages
    hits = engine.stats()["prefix_hit_tokens"]
    warm = engine.score(answers, top_logprobs=2, start=len(prompt))
    assert engine.stats()["prefix_hit_tokens"] - hits == 2 * 32  # both pages, for both sequences
    for w, c, ids in zip(warm, cold, answers, strict=True):
        assert w.logprobs[: len(prompt)] == [None] * len(prompt)
        assert w.logprobs[len(prompt) :] == pytest.approx(c.logprobs[len(prompt) :], abs=TOL)
        _check(w, _reference(qwen2.hf, ids), ids, 2, start=len(prompt))
    # Logits needed from position 0 on: nothing comes from the cache, and the score fills it.
    hits = engine.stats()["prefix_hit_tokens"]
    _check(engine.score([answers[0]])[0], _reference(qwen2.hf, answers[0]), answers[0], 0)
    assert engine.stats()["prefix_hit_tokens"] == hits
    fresh = make_engine(qwen2.path)
    fresh.score([answers[0]])
    fresh.generate([prompt + [70]], SamplingParams(max_tokens=1))
    assert fresh.stats()["prefix_hit_tokens"] == 32


def _perturbed(hf, scale=0.05):
    """New weights for the qwen2 checkpoint (its head tied to the embedding: not a name of its own)."""
    g = torch.Generator().manual_seed(7)
    state = {name: p.detach() + scale * torch.randn(p.shape, generator=g) for name, p in hf.state_dict().items()}
    del state["lm_head.weight"]
    return state


def _load(hf, state):
    model = type(hf)(hf.config).eval()
    model.load_state_dict({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    return model


def test_a_weight_push_between_two_scores(qwen2):
    engine = make_engine(qwen2.path)
    before = engine.score(SEQS, top_logprobs=2)
    state = _perturbed(qwen2.hf)
    engine.update_weights(state)
    after = engine.score(SEQS, top_logprobs=2)
    new = _load(qwen2.hf, state)
    for b, a, ids in zip(before, after, SEQS, strict=True):
        assert (b.version, a.version) == (0, 1)
        _check(b, _reference(qwen2.hf, ids), ids, 2)
        _check(a, _reference(new, ids), ids, 2)


@pytest.mark.parametrize("inflight", ["keep", "recompute"])
def test_a_commit_mid_score_leaves_every_logprob_of_one_version(qwen2, inflight):
    state = _perturbed(qwen2.hf)
    pushed = []

    def push_once(info):
        if not pushed:
            pushed.append(engine.update_weights(state, inflight=inflight))

    engine = make_engine(qwen2.path, max_batch_size=4, max_step_tokens=8, step_callback=push_once)
    (scored,) = engine.score([SEQS[0]], top_logprobs=1)
    assert pushed == [1] and scored.version == 1
    _check(scored, _reference(_load(qwen2.hf, state), SEQS[0]), SEQS[0], 1)


def test_bad_score_arguments_name_the_field(qwen2):
    engine = make_engine(qwen2.path, max_seq_len=64)
    cases = [
        (dict(sequences=[[1, 2]], top_logprobs=21), ValueError, "top_logprobs"),
        (dict(sequences=[[1, 2]], top_logprobs=-1), ValueError, "top_logprobs"),
        (dict(sequences=[[1, 2]], start=0), ValueError, "start"),
        (dict(sequences=[[1, 2]], start=3), ValueError, "start"),
        (dict(sequences=[[1, 2], [3]], start=[1]), TypeError, "start"),
        (dict(sequences=[list(range(65))]), ValueError, "max_seq_len"),
        (dict(sequences=[[]]), ValueError, "sequences"),
        (dict(sequences=[[1, 10**6]]), ValueError, "sequences"),
        (dict(sequences=[[1, 2]], params="raw"), TypeError, "params"),
        (dict(sequences=["text"]), ValueError, "tokenizer"),
    ]
    for kwargs, error, field in cases:
        with pytest.raises(error, match=field):
            engine.score(**kwargs)
    assert engine.stats()["computed_tokens"] == 0
    for bad, error in ((-1, ValueError), (21, ValueError), (1.5, TypeError)):
        with pytest.raises(error, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_text_and_chat_sequences(text_checkpoint):
    engine = make_engine(text_checkpoint.path)
    codec = engine.tokenizer
    (scored,) = engine.score(["hello there"])
    ids = codec.encode("hello there")
    assert scored.text == "hello there"
    _check(scored, _reference(text_checkpoint.hf, ids), ids, 0)


def test_score_through_the_triton_kernels(qwen2):
    """The Triton path (under the interpreter here): its prefill kernels, the head and
    the log-softmax in torch ops."""
    engine = make_engine(qwen2.path, kernels="triton", max_batch_size=4, max_step_tokens=16, max_seq_len=64)
    assert engine.config.kernels == "triton"
    (scored,) = engine.score([SEQS[1]], top_logprobs=2)
    _check(scored, _reference(qwen2.hf, SEQS[1]), SEQS[1], 2)


def test_score_block_folds_vocabulary_slices_into_the_float64_log_softmax():
    """The compiled fold of `_fused_scores`, slice by slice (the last one shorter), against
    a float64 log-softmax of the whole rows: the running maximum rescales its sum when a
    later slice holds the maximum, ties rank by lower id, a NaN row reports NaN."""
    g = torch.Generator().manual_seed(3)
    rows, vocab, k = 8, 203, 6
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[1] = logits[1].round()  # many ties: the lower id first
    logits[2, 180:] += 60.0  # the maximum in the last slice
    logits[3] *= 25.0  # nearly one-hot
    logits[7, 17] = float("nan")
    targets = torch.randint(0, vocab, (rows,), generator=g)
    divisor = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.5, 1.0, 0.3, 1.0])
    slices = ((first, logits[:, first : first + 50]) for first in range(0, vocab, 50))
    lp, ids, values = scoring._fused_scores(slices, targets, divisor, k, cpu_ops().score_block)
    ref = torch.log_softmax(logits.double() / divisor.double()[:, None], -1)
    best, order = ref.sort(dim=-1, descending=True, stable=True)
    assert torch.allclose(lp[:7].double(), ref[:7].gather(1, targets[:7, None]).squeeze(1), atol=1e-5, rtol=1e-6)
    assert torch.equal(ids[:7], order[:7, :k])
    assert torch.allclose(values[:7].double(), best[:7, :k], atol=1e-5, rtol=1e-6)
    assert lp[7].isnan() and values[7].isnan().all()
    with pytest.raises(RuntimeError, match="divisor"):
        scoring._fused_scores([(0, logits)], targets, torch.zeros(rows), k, cpu_ops().score_block)


def test_fused_scoring_in_slices_and_row_blocks_equals_transformers(qwen2, monkeypatch):
    """The engine's fused path with slices of 40 token ids and blocks of 7 rows (every
    sequence spans blocks, every row three slices), under the scaled and the greedy (raw)
    distributions, against transformers; the compiled fold ran."""
    monkeypatch.setattr(scoring, "FUSED_VOCAB", 40)
    monkeypatch.setattr(scoring, "FUSED_ROWS", 7)
    engine = make_engine(qwen2.path)
    calls = []
    fold = engine.stepper.score_kernel
    engine.stepper.score_kernel = lambda *args: calls.append(args[1]) or fold(*args)
    scaled = engine.score(SEQS, top_logprobs=3, params=SamplingParams(temperature=0.7))  # unfiltered "processed"
    for scored, ids in zip(scaled, SEQS, strict=True):
        _check(scored, _reference(qwen2.hf, ids, 0.7), ids, 3)
    assert sorted(set(calls)) == [0, 40, 80]
    (greedy,) = engine.score(SEQS[:1], top_logprobs=2, params=SamplingParams(temperature=0.0))
    _check(greedy, _reference(qwen2.hf, SEQS[0]), SEQS[0], 2)


def test_plan_shares_finds_the_longest_prefix_an_earlier_sequence_covers():
    """Hand-worked: a sequence takes its wanted positions below the common prefix's length
    from the earlier sequence with the longest such prefix whose `start` is not later."""
    a = [1, 2, 3, 4, 5]
    seqs = [a, a[:3] + [9, 9], a[:4], [7, 8], a[:3] + [9, 9, 6], a[:2] + [4], a]
    starts = [2, 1, 2, 1, 3, 2, 4]
    assert plan_shares(seqs, starts) == [
        None,  # the first
        None,  # shares 3 tokens with 0, but wants position 1, which 0 does not
        Share(0, 4),  # positions 2, 3 from 0: inside it, no request
        None,  # no common prefix
        Share(1, 5),  # 1 (start 1) shares 5 tokens: positions 3, 4; its own from 5
        None,  # shares 2 tokens with 0: position 1 only, below its start
        Share(0, 5),  # identical to 0: every position
    ]


def test_sequences_sharing_a_prefix_score_it_once(qwen2):
    """GRPO-like samples of one prompt, one inside another and one identical: every result
    equals transformers'; the shared prompt's pages come from the prefix cache and its
    positions are not computed again."""
    prompt = list(range(3, 40))  # two full pages of 16
    seqs = [prompt + [50, 51, 52], prompt + [60, 61], prompt[:30], prompt + [50, 51, 52], [5, 6] + prompt]
    starts = [1, 1, 2, 1, 1]
    engine = make_engine(qwen2.path, max_batch_size=4, max_step_tokens=24)  # the samples in different steps
    before = engine.stats()
    scored = engine.score(seqs, top_logprobs=2, start=starts)
    after = engine.stats()
    for s, ids, b in zip(scored, seqs, starts, strict=True):
        _check(s, _reference(qwen2.hf, ids), ids, 2, start=b)
        assert s.version == 0
    assert [s.index for s in scored] == list(range(len(seqs)))
    # Computed: 0 and 4 whole; 1 from position 36 (its page at 32: 32 cached); 2 and 3 nothing.
    assert after["computed_tokens"] - before["computed_tokens"] == 40 + (39 - 32) + 39
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 32


def test_a_commit_between_a_donor_and_its_sharer_scores_the_sharer_alone(qwen2, monkeypatch):
    """The donor finishes under version 0, then a commit: the sharer's own positions come
    from version 1, so it is scored again alone, every logprob of version 1."""
    state, pushed, made = _perturbed(qwen2.hf), [], []
    make = score_requests._request
    monkeypatch.setattr(score_requests, "_request", lambda *args: made.append(make(*args)) or made[-1])

    def push_after_donor(info):
        if not pushed and made[0].prompt_scores.done:
            pushed.append(engine.update_weights(state, inflight="keep"))

    engine = make_engine(qwen2.path, max_batch_size=4, max_step_tokens=8, step_callback=push_after_donor)
    seqs = [SEQS[0][:10], SEQS[0]]
    donor, sharer = engine.score(seqs, top_logprobs=1)
    assert pushed == [1] and (donor.version, sharer.version) == (0, 1)
    assert [r.prompt_scores.start for r in made] == [1, 10, 1]  # the two requests, then the sharer alone
    _check(donor, _reference(qwen2.hf, seqs[0]), seqs[0], 1)
    _check(sharer, _reference(_load(qwen2.hf, state), seqs[1]), seqs[1], 1)


def test_an_abort_mid_score_yields_every_sharing_sequence_once(qwen2):
    """Aborted after the first step: every sequence is yielded once, the sharing ones with
    what their donor computed, each computed logprob transformers' and the rest None."""
    generations = []

    def abort_once(info):
        if len(generations) == 1:
            generations.append(generations[0].abort())

    engine = make_engine(qwen2.path, max_batch_size=4, max_step_tokens=8, step_callback=abort_once)
    seqs = [SEQS[0], SEQS[0][:20] + [90, 91], SEQS[0][:10]]
    generations.append(score_requests.score_iter(engine, seqs, 1))
    out = list(generations[0])
    assert sorted(i for i, _ in out) == [0, 1, 2]
    for i, scored in out:
        ids, ref = seqs[i], _reference(qwen2.hf, seqs[i])
        assert scored.index == i and scored.logprobs[9:] == [None] * (len(ids) - 9)  # the first step's 8 rows
        for p in range(1, 9):
            assert abs(scored.logprobs[p] - ref[p - 1, ids[p]].item()) < TOL
