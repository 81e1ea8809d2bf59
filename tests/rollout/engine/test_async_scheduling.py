"""Overlapped scheduling (`async_scheduling=True`) against the synchronous engine.

On the CPU nothing overlaps, but every lag path runs: each step's tokens are
applied one step late, a step is planned while its predecessor's tokens are
still "on the device", and tokens sampled past a stop are computed and
dropped. Seeded results must be the synchronous engine's, token for token and
logprob for logprob, with the same versions and finish reasons."""

from __future__ import annotations

import threading

import pytest

from rollout import SamplingParams
from tests.conftest import make_engine
from tests.factories import fail_launch

PROMPTS = [list(range(3, 30)), [5, 6, 7], list(range(40, 49)), [11] * 17]
WAIT = 60


def _snapshot(outs):
    return [[(s.token_ids, s.logprobs, s.versions, s.finish_reason) for s in o.samples] for o in outs]


def _assert_close(got, expected, tol=1e-5):
    strip = [[(t, v, r) for t, _, v, r in o] for o in _snapshot(got)]
    assert strip == [[(t, v, r) for t, _, v, r in o] for o in _snapshot(expected)]
    for o, e in zip(got, expected, strict=True):
        for s, es in zip(o.samples, e.samples, strict=True):
            assert max((abs(a - b) for a, b in zip(s.logprobs, es.logprobs, strict=True)), default=0) <= tol


def _pair(path, **kwargs):
    return make_engine(path, async_scheduling=False, **kwargs), make_engine(path, async_scheduling=True, **kwargs)


def _stop_ids(engine, params):
    """Token ids that some samples sample midway (seeded): stopping on them ends samples at different steps."""
    outs = engine.generate(PROMPTS, params)
    mids = [s.token_ids[4] for o in outs for s in o.samples[:2]]
    return sorted(set(mids))[:3]


def test_async_scheduling_is_checked_and_resolved(qwen2):
    with pytest.raises(ValueError, match="async_scheduling must be 'auto', True or False"):
        make_engine(qwen2.path, async_scheduling="on")
    with pytest.raises(TypeError, match="async_scheduling must be"):
        make_engine(qwen2.path, async_scheduling=1)
    assert make_engine(qwen2.path).config.async_scheduling is False  # "auto" on the CPU: nothing to overlap
    assert make_engine(qwen2.path, async_scheduling=True).config.async_scheduling is True


@pytest.mark.parametrize(
    "case",
    ["stops_forks_top_logprobs", "penalties_raw", "preemption", "graphs_debug_cache"],
)
def test_generate_equals_the_synchronous_engine(qwen2, case):
    kwargs, extra = {}, {}
    if case == "preemption":
        kwargs = dict(kv_cache_tokens=160, page_size=8)  # 20 pages for 12 samples of up to ~60 tokens
    if case == "graphs_debug_cache":
        kwargs = dict(decode_graphs="eager", debug_decode_cache=True)
    sync, lagged = _pair(qwen2.path, **kwargs)
    base = dict(n=3, max_tokens=28, seed=5, ignore_eos=True)
    base["stop_token_ids"] = _stop_ids(sync, SamplingParams(**base))
    assert _stop_ids(lagged, SamplingParams(**base)) == base["stop_token_ids"]  # and both caches hold the prompts
    if case == "stops_forks_top_logprobs":
        extra = dict(top_logprobs=3)
    if case == "penalties_raw":
        extra = dict(frequency_penalty=0.5, presence_penalty=0.2, logprobs_mode="raw")
    params = SamplingParams(**base, **extra)
    expected = sync.generate(PROMPTS, params)
    got = lagged.generate(PROMPTS, params)
    if case == "preemption":
        # Exact tokens; the logprobs of a recomputed prefix carry its recompute's rounding (a
        # prefill's kernels, not a decode's), and the two engines preempt at different steps.
        _assert_close(got, expected)
    else:
        assert _snapshot(got) == _snapshot(expected)
    reasons = {s.finish_reason for o in expected for s in o.samples}
    assert reasons == {"stop", "length"}  # samples end at different steps, mid-batch
    if extra.get("top_logprobs"):
        top = [[[s.top_logprobs for s in o.samples] for o in outs] for outs in (got, expected)]
        assert top[0] == top[1]
    if case == "preemption":
        assert sync.stats()["preemptions"] > 0 and lagged.stats()["preemptions"] > 0
    # Tokens sampled past a stop were computed, then dropped, and their pages given back.
    assert lagged.stats()["kv_pages_used"] == 0
    stopped = sum(s.finish_reason == "stop" for o in expected for s in o.samples)
    assert lagged.stats()["computed_tokens"] - sync.stats()["computed_tokens"] <= stopped + 3 * len(PROMPTS)
    # The prefix cache serves the second call on both.
    _assert_close(lagged.generate(PROMPTS, params), sync.generate(PROMPTS, params), 0 if case != "preemption" else 1e-5)
    assert lagged.stats()["prefix_hit_tokens"] > 0 and sync.stats()["prefix_hit_tokens"] > 0


def test_stop_strings_equal_the_synchronous_engine(text_checkpoint):
    sync, lagged = _pair(text_checkpoint.path)
    params = SamplingParams(n=2, max_tokens=40, ignore_eos=True, seed=3)
    text = sync.generate(["hello world"], params)[0].samples[0].text
    params = SamplingParams(n=2, max_tokens=40, ignore_eos=True, seed=3, stop=[text[10:12], "\x7f\x7f"])
    expected = sync.generate(["hello world", "go"], params)
    got = lagged.generate(["hello world", "go"], params)
    assert _snapshot(got) == _snapshot(expected)
    assert [[s.text for s in o.samples] for o in got] == [[s.text for s in o.samples] for o in expected]
    assert expected[0].samples[0].finish_reason == "stop"


def test_sessions_equal_the_synchronous_engine_and_keep_the_same_kv(qwen2):
    sync, lagged = _pair(qwen2.path)
    params = SamplingParams(max_tokens=9, seed=4, ignore_eos=True)
    turns = {}
    for name, engine in (("sync", sync), ("async", lagged)):
        sess = engine.session(list(range(3, 25)))
        samples = []
        for extra in ([30, 31], [32, 33, 34], [35]):
            samples.append(sess.generate(params))
            sess.append(extra)
        turns[name] = ([(s.token_ids, s.logprobs) for s in samples], sess.token_ids, engine.stats())
    assert turns["async"][:2] == turns["sync"][:2]
    # The lease keeps what a synchronous step leaves: the extra token's page was given back.
    for key in ("kv_pages_leased", "prefix_hit_tokens"):
        assert turns["async"][2][key] == turns["sync"][2][key]


@pytest.mark.parametrize("inflight", ["keep", "recompute", "restart"])
def test_weight_commits_between_steps_equal_the_synchronous_engine(qwen2, inflight):
    from tests.rollout.engine.test_weight_updates import UpdateAtStep

    other = {k: v.clone() for k, v in qwen2.hf.state_dict().items()}
    for name in ("model.norm.weight", "model.layers.0.mlp.up_proj.weight"):
        other[name] = other[name] * 1.25
    params = SamplingParams(n=2, max_tokens=20, seed=6, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        callback = UpdateAtStep(4)
        engine = make_engine(qwen2.path, async_scheduling=async_scheduling, step_callback=callback)
        callback.action = lambda engine=engine: engine.update_weights(other, inflight=inflight)
        results.append(_snapshot(engine.generate(PROMPTS, params)))
        assert engine.policy_version == 1
    assert results[1] == results[0]
    assert {v for o in results[0] for s in o for v in s[2]} == ({0, 1} if inflight != "restart" else {1})


def test_drain_commit_waits_for_the_step_in_flight(qwen2):
    params = SamplingParams(n=2, max_tokens=20, seed=6, ignore_eos=True)
    other = {k: v * 1.1 for k, v in qwen2.hf.state_dict().items() if k == "model.norm.weight"}
    results = []
    for async_scheduling in (False, True):
        stepped, box = threading.Event(), {}
        engine = make_engine(qwen2.path, async_scheduling=async_scheduling, step_callback=lambda _, e=stepped: e.set())
        thread = threading.Thread(target=lambda e=engine, b=box: b.update(out=e.generate(PROMPTS, params)))
        thread.start()
        assert stepped.wait(WAIT)
        engine.update_weights(other, inflight="drain")
        thread.join(WAIT)
        assert not thread.is_alive()
        after = engine.generate(PROMPTS[:2], params)
        results.append((_snapshot(box["out"]), _snapshot(after)))
    assert results[1] == results[0]
    assert {v for o in results[0][0] for s in o for v in s[2]} == {0}
    assert {v for o in results[0][1] for s in o for v in s[2]} == {1}


def test_abort_and_a_failed_step_leave_the_lagged_engine_exact(qwen2, monkeypatch):
    sync, lagged = _pair(qwen2.path)
    params = SamplingParams(n=2, max_tokens=24, seed=9, ignore_eos=True)
    full = _snapshot(sync.generate(PROMPTS, params))
    # Closing the iterator after the first prompt ends aborts the rest, tokens in flight dropped.
    gen = lagged.generate_iter(PROMPTS, SamplingParams(n=2, max_tokens=24, seed=9, ignore_eos=False))
    next(gen)
    gen.close()
    assert lagged.stats()["kv_pages_used"] == 0 and not lagged.scheduler.requests
    # A step that fails with a step in flight: the step before it is applied, the rest recomputed.
    fail_launch(lagged, monkeypatch, at=5)
    with pytest.raises(RuntimeError, match="device fell over"):
        lagged.generate(PROMPTS, params)
    assert lagged.stats()["kv_pages_used"] == 0 and not lagged.scheduler.requests
    assert lagged.stepper._last_samplers is not None and lagged._pipeline.inflight is None
    assert _snapshot(lagged.generate(PROMPTS, params)) == full


def test_scores_and_prompt_logprobs_equal_the_synchronous_engine(qwen2):
    """Scored prompts end when their last chunk is applied: nothing is scheduled for them meanwhile."""
    sync, lagged = _pair(qwen2.path, max_step_tokens=32)  # prompts of 40 tokens take two chunks
    sequences = [list(range(3, 43)), [7, 8, 9, 10], list(range(50, 70))]
    scored = [[(s.token_ids, s.logprobs, s.top_logprobs) for s in e.score(sequences, 2)] for e in (sync, lagged)]
    assert scored[1] == scored[0]
    params = SamplingParams(n=2, max_tokens=6, seed=2, ignore_eos=True, prompt_logprobs=1)
    outs = [e.generate(sequences, params) for e in (sync, lagged)]
    assert _snapshot(outs[1]) == _snapshot(outs[0])
    assert [o.prompt_logprobs for o in outs[1]] == [o.prompt_logprobs for o in outs[0]]
    assert lagged.stats()["kv_pages_used"] == 0


def test_structured_outputs_equal_the_synchronous_engine(ascii_engine, ascii_checkpoint):
    """A grammar's matcher advances with each applied token: its rows are settled before the next plan."""
    from rollout import StructuredOutputs

    lagged = make_engine(ascii_checkpoint.path, max_seq_len=1024, async_scheduling=True)
    choices = StructuredOutputs(choice=["yes", "no", "maybe", "nope"])
    for constraint in (choices, StructuredOutputs(json_object=True)):
        params = SamplingParams(n=2, max_tokens=24, seed=4, structured_outputs=constraint)
        expected, got = (e.generate(["Q: ", "A: "], params) for e in (ascii_engine, lagged))
        assert _snapshot(got) == _snapshot(expected)
    assert lagged.stats()["kv_pages_used"] == 0


def test_a_commit_whose_settle_fails_recovers_and_the_run_stays_exact(qwen2, monkeypatch):
    """The step in flight cannot be read back during a commit: the commit fails, nothing is
    installed, the tokens in flight are dropped and sampled again, and the run goes on exactly."""
    params = SamplingParams(n=2, max_tokens=16, seed=9, ignore_eos=True)
    expected = make_engine(qwen2.path).generate(PROMPTS, params)
    update = {"model.norm.weight": qwen2.hf.state_dict()["model.norm.weight"] * 2}
    box = {"steps": 0}

    def commit_at_third_step(info):
        box["steps"] += 1
        if box["steps"] == 3:
            box["fail"] = True
            with pytest.raises(RuntimeError, match="lost while reading back"):
                lagged.update_weights(update, inflight="keep")
            box["raised"] = True

    lagged = make_engine(qwen2.path, async_scheduling=True, step_callback=commit_at_third_step)
    real = lagged.stepper.collect

    def collect(launched):
        if box.pop("fail", False):
            raise RuntimeError("device lost while reading back")
        return real(launched)

    monkeypatch.setattr(lagged.stepper, "collect", collect)
    _assert_close(lagged.generate(PROMPTS, params), expected)  # recomputed KV: its rounding
    assert box["raised"] and lagged.policy_version == 0
    assert lagged.stats()["kv_pages_used"] == 0 and lagged._pipeline.inflight is None
