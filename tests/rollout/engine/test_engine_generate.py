"""Engine.generate behaviour: seeds, groups, prefill sharing, preemption,
stop conditions, text, concurrency."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout import SamplingParams
from tests.conftest import make_engine
from tests.factories import hf_logprobs
from tests.reference import processed_logprobs

LONG = list(range(3, 40))  # 37 tokens: two full pages and a partial one
SHORT = [5, 6, 7, 8, 9, 10, 11]


def _tokens(outs):
    return [[s.token_ids for s in o.samples] for o in outs]


def test_seeded_request_identical_alone_and_in_a_mixed_batch(qwen2):
    engine = make_engine(qwen2.path)
    seeded = SamplingParams(n=2, max_tokens=25, seed=42, ignore_eos=True)
    alone = engine.generate([LONG], seeded)[0]
    in_batch = engine.generate([SHORT, LONG, [9, 9, 9]], seeded)[1]
    assert _tokens([alone]) == _tokens([in_batch])

    # Now beside another caller's unseeded batch with other sampling settings, sharing steps.
    started, results = threading.Event(), {}
    engine2 = make_engine(qwen2.path, step_callback=lambda info: started.set())

    def other():
        results["other"] = engine2.generate([SHORT] * 6, SamplingParams(n=3, max_tokens=60, top_k=5, ignore_eos=True))

    t = threading.Thread(target=other)
    t.start()
    assert started.wait(30)
    mixed = engine2.generate([LONG], seeded)[0]
    t.join(60)
    assert not t.is_alive()
    assert _tokens([mixed]) == _tokens([alone])
    for a, b in zip(alone.samples, mixed.samples, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_samples_within_a_group_differ_and_unseeded_runs_repeat_per_engine_seed(qwen2):
    params = SamplingParams(n=4, max_tokens=20, ignore_eos=True)
    first = make_engine(qwen2.path, seed=1).generate([SHORT], params)
    again = make_engine(qwen2.path, seed=1).generate([SHORT], params)
    other = make_engine(qwen2.path, seed=2).generate([SHORT], params)
    samples = _tokens(first)[0]
    assert len({tuple(s) for s in samples}) == 4
    assert _tokens(first) == _tokens(again)
    assert _tokens(first) != _tokens(other)


def test_prompt_prefilled_once_per_group(qwen2):
    engine = make_engine(qwen2.path)
    outs = engine.generate([LONG, SHORT, [4]], SamplingParams(n=8, max_tokens=10, ignore_eos=True, seed=0))
    stats = engine.stats()
    assert stats["prompt_tokens"] == len(LONG) + len(SHORT) + 1
    # 24 samples x 10 tokens; each sample's last token is sampled but never fed back.
    assert stats["computed_tokens"] == stats["prompt_tokens"] + 24 * 9
    assert stats["kv_pages_used"] == 0  # everything released
    for out in outs:
        for s in out.samples:
            assert torch.allclose(
                torch.tensor(s.logprobs, dtype=torch.float64),
                hf_logprobs(qwen2.hf, out.prompt_token_ids, s.token_ids),
                atol=1e-4,
            )


def test_tiny_kv_budget_preempts_and_matches_unconstrained_run(qwen2):
    params = SamplingParams(n=4, max_tokens=40, ignore_eos=True)
    prompts = [LONG, SHORT, LONG[:20]]
    free = make_engine(qwen2.path, seed=9).generate(prompts, params)
    # The debug mode also checks each step's device-built slots and block tables against the host's:
    # pages cross every 16 tokens, forks copy their last page on write, preemptions and finishes move rows.
    tight_engine = make_engine(qwen2.path, seed=9, kv_cache_tokens=10 * 16, debug_decode_cache=True)
    tight = tight_engine.generate(prompts, params)
    assert tight_engine.stats()["preemptions"] > 0
    tables = tight_engine.workspace.tables
    decode_rows = sum(info.num_sampled for info in tight_engine.step_log() if info.num_tokens == info.num_sampled)
    assert 0 < tables.rows_written < decode_rows / 4  # rows are written when they change, not every step
    assert _tokens(tight) == _tokens(free)
    for a, b in zip(free, tight, strict=True):
        for sa, sb in zip(a.samples, b.samples, strict=True):
            assert torch.allclose(torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-5)
            assert sa.finish_reason == sb.finish_reason == "length"


def test_engine_processed_logprobs_with_filters_match_float64_recompute(qwen2):
    engine = make_engine(qwen2.path)
    params = SamplingParams(
        n=3, max_tokens=20, temperature=0.7, top_k=20, top_p=0.85, min_p=0.02, ignore_eos=True, seed=5
    )
    out = engine.generate([LONG], params)[0]
    for s in out.samples:
        ids = torch.tensor([out.prompt_token_ids + s.token_ids])
        with torch.no_grad():
            logits = qwen2.hf(ids).logits[0]
        start = len(out.prompt_token_ids) - 1
        for i, (token, lp) in enumerate(zip(s.token_ids, s.logprobs, strict=True)):
            ref = processed_logprobs(logits[start + i], 0.7, 20, 0.85, 0.02)
            assert abs(ref[token].item() - lp) < 1e-4, f"token {i}"


def test_stop_conditions_and_finish_reasons(qwen2):
    engine = make_engine(qwen2.path)
    stop_ids = list(range(10, 14))
    outs = engine.generate([LONG, SHORT], SamplingParams(n=8, max_tokens=30, stop_token_ids=stop_ids, seed=1))
    reasons = set()
    for out in outs:
        for s in out.samples:
            reasons.add(s.finish_reason)
            stops = set(stop_ids) | {2}  # eos from config.json
            assert not stops & set(s.token_ids[:-1])
            if s.finish_reason == "stop":
                assert s.token_ids[-1] in stops
            else:
                assert s.finish_reason == "length" and len(s.token_ids) == 30
    assert reasons == {"stop", "length"}

    ignore = engine.generate([SHORT], SamplingParams(n=4, max_tokens=30, ignore_eos=True, seed=1))
    assert all(len(s.token_ids) == 30 for s in ignore[0].samples)


def test_max_tokens_capped_by_context(qwen2):
    engine = make_engine(qwen2.path, max_seq_len=48)
    out = engine.generate([LONG], SamplingParams(max_tokens=1000, ignore_eos=True))[0]
    assert len(out.samples[0].token_ids) == 48 - len(LONG)
    assert out.samples[0].finish_reason == "length"


def test_text_in_text_out_and_stop_strings(text_checkpoint):
    engine = make_engine(text_checkpoint.path)
    params = SamplingParams(n=2, max_tokens=40, ignore_eos=True, seed=3)
    out = engine.generate(["hello world"], params)[0]
    codec = engine.tokenizer
    assert out.prompt == "hello world"
    assert out.prompt_token_ids == codec.encode("hello world") and out.prompt_token_ids[0] == 1  # BOS
    for s in out.samples:
        assert s.text == codec.decode(s.token_ids)
    text = out.samples[0].text
    stop = text[10:12]
    cut = text.index(stop)
    stopped = engine.generate(
        ["hello world"], SamplingParams(n=2, max_tokens=40, ignore_eos=True, seed=3, stop=[stop, "\x7f\x7f"])
    )[0]
    s = stopped.samples[0]
    assert s.finish_reason == "stop"
    assert s.text == text[:cut]
    assert s.token_ids == out.samples[0].token_ids[: len(s.token_ids)]
    assert stop in codec.decode(s.token_ids) and stop not in codec.decode(s.token_ids[:-1])


def test_eos_from_tokenizer_config_when_config_has_none(tmp_path):
    from tests.factories import make_checkpoint

    make_checkpoint(tmp_path, "llama", seed=4, tokenizer=True, eos_token_id=None)
    engine = make_engine(tmp_path)
    assert engine.tokenizer.eos_token_ids == (2,)


def test_concurrent_callers_share_the_engine(qwen2):
    engine = make_engine(qwen2.path)
    jobs = [([LONG], 11), ([SHORT, LONG[:9]], 12), ([SHORT[:3]], 13)]
    expected = [
        _tokens(make_engine(qwen2.path).generate(p, SamplingParams(n=3, max_tokens=20, seed=s, ignore_eos=True)))
        for p, s in jobs
    ]
    barrier, results = threading.Barrier(len(jobs)), {}

    def call(i, prompts, seed):
        barrier.wait(10)
        results[i] = engine.generate(prompts, SamplingParams(n=3, max_tokens=20, seed=seed, ignore_eos=True))

    threads = [threading.Thread(target=call, args=(i, p, s)) for i, (p, s) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [_tokens(results[i]) for i in range(len(jobs))] == expected


def test_empty_prompt_list_returns_nothing(qwen2):
    assert make_engine(qwen2.path).generate([], SamplingParams()) == []


@pytest.mark.parametrize("n", [1, 3])
def test_debug_decode_cache_checks_every_step(qwen2, n):
    engine = make_engine(qwen2.path, debug_decode_cache=True)
    outs = engine.generate([LONG, SHORT], SamplingParams(n=n, max_tokens=30, stop_token_ids=[20, 21], seed=4))
    stats = engine.stats()
    assert stats["decode_cache_hits"] > 10 and stats["decode_cache_misses"] >= 1
    reference = make_engine(qwen2.path).generate(
        [LONG, SHORT], SamplingParams(n=n, max_tokens=30, stop_token_ids=[20, 21], seed=4)
    )
    assert _tokens(outs) == _tokens(reference)


def test_eos_from_generation_config_stops_too(tmp_path):
    import json

    from tests.factories import make_checkpoint

    make_checkpoint(tmp_path, "qwen2", seed=5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [40, 41]}))
    engine = make_engine(tmp_path)
    assert set(engine.model_config.eos_token_ids) == {2, 40, 41}
    outs = engine.generate([SHORT, LONG], SamplingParams(n=8, max_tokens=40, seed=2))
    stopped = [s for o in outs for s in o.samples if s.finish_reason == "stop"]
    assert stopped and all(s.token_ids[-1] in (2, 40, 41) for s in stopped)
    assert all(not {2, 40, 41} & set(s.token_ids[:-1]) for o in outs for s in o.samples)


def test_generate_iter_yields_in_completion_order_and_early_close_aborts(qwen2):
    engine = make_engine(qwen2.path)
    params = SamplingParams(n=2, max_tokens=30, seed=6, stop_token_ids=list(range(10, 16)))
    prompts = [LONG, SHORT, [4, 4], [9, 8, 7, 6]]
    full = engine.generate(prompts, params)
    items = list(engine.generate_iter(prompts, params))
    assert sorted(i for i, _ in items) == [0, 1, 2, 3]
    for i, out in items:
        assert out.index == i and _tokens([out]) == _tokens([full[i]])
    # All prompts start in the first step, so a prompt finishes with its longest sample.
    finish_steps = [max(len(s.token_ids) for s in out.samples) for _, out in items]
    assert finish_steps == sorted(finish_steps) and len(set(finish_steps)) > 1
    it = engine.generate_iter(prompts, params)
    next(it)
    it.close()
    assert not engine.scheduler.requests and engine.stats()["kv_pages_used"] == 0
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate_iter([[1000]], params)  # validated eagerly, before iteration


def test_stop_string_found_late_in_a_long_output(text_checkpoint):
    engine = make_engine(text_checkpoint.path)
    params = dict(n=1, max_tokens=120, ignore_eos=True, seed=11)
    text = engine.generate(["go"], SamplingParams(**params))[0].samples[0].text
    # A 3-character string whose first occurrence is far past the decode window (4 * 3 + 8 tokens).
    stop = next(text[i : i + 3] for i in range(60, len(text) - 3) if text.index(text[i : i + 3]) >= 60)
    cut = text.index(stop)
    s = engine.generate(["go"], SamplingParams(**params, stop=[stop])).pop().samples[0]
    assert s.finish_reason == "stop" and s.text == text[:cut]
    assert stop in engine.tokenizer.decode(s.token_ids) and stop not in engine.tokenizer.decode(s.token_ids[:-1])
