"""Sessions on a cluster: a session pinned to one actor gives the trajectory
of the same seeded session on an in-process engine and of a teacher-forced
transformers forward; it survives its actor's SIGKILL between turns and in
the middle of one; its turns reuse the actor's KV; bad input raises on the
driver before any actor is called; the actor's own errors arrive unchanged."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch

import rollout
from rollout import ClosedError, RolloutCluster, SamplingParams
from rollout.cluster.actor_sessions import EngineSessions
from rollout.cluster.ray_runtime import control
from rollout.cluster.sessions import ClusterSessions
from tests.conftest import make_engine
from tests.factories import hf_logprobs
from tests.rollout.cluster.test_cluster import wait_until
from tests.rollout.engine.test_sessions import assert_matches_reference, params

KW = dict(
    num_actors=2,
    num_cpus_per_actor=1,
    max_seq_len=256,
    kv_cache_tokens=4096,
    max_batch_size=16,
    timeout_s=120,
    stall_timeout_s=120,
)
PROMPT = [3 + (7 * i) % 90 for i in range(11)]
# Per turn: max_tokens, seed, then the observation appended after it.
TURNS = [(6, 11, [5, 9]), (4, 12, [17]), (24, 13, [40, 41, 42]), (3, 14, [8]), (5, 15, [])]


def _pause_while(path: str):
    """A step callback: while `path` exists, the engine pauses after each step
    (a bounded wait), so a test can kill an actor in the middle of a turn."""

    def pause(info) -> None:
        deadline = time.monotonic() + 120
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.005)

    return pause


@pytest.fixture(scope="module")
def hold(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions") / "hold"


@pytest.fixture(scope="module")
def cluster(ray_session, qwen2, hold):
    c = RolloutCluster(qwen2.path, step_callback=_pause_while(str(hold)), **KW)
    yield c
    c.shutdown()


def _turn(sess, k: int):
    max_tokens, seed, _ = TURNS[k]
    return sess.generate(params(max_tokens, seed))


def _episode(sess, turns=None):
    for k in range(len(TURNS)) if turns is None else turns:
        _turn(sess, k)
        sess.append(TURNS[k][2])
    return sess


@pytest.fixture(scope="module")
def reference(qwen2):
    """The episode as a session on an in-process engine of the same checkpoint."""
    with make_engine(qwen2.path).session(PROMPT) as sess:
        return _episode(sess)


def assert_same_trajectory(sess, ref) -> None:
    assert sess.token_ids == ref.token_ids and sess.loss_mask == ref.loss_mask and sess.versions == ref.versions
    assert torch.allclose(torch.tensor(sess.logprobs), torch.tensor(ref.logprobs), atol=1e-5)
    assert [s.finish_reason for s in sess.samples] == [s.finish_reason for s in ref.samples]


def _actor(cluster, index: int) -> dict:
    return next(h for h in cluster.health() if h["index"] == index)


def test_a_cluster_session_equals_an_engine_session_and_transformers(cluster, qwen2, reference):
    with cluster.session(PROMPT) as sess:
        slot = sess._backend.slot
        _episode(sess)
        assert sess._backend.slot is slot and sess.num_turns == len(TURNS)
        assert_same_trajectory(sess, reference)
        assert_matches_reference(sess, {0: qwen2.hf})
        assert _actor(cluster, slot.index)["sessions"] == 1
    wait_until(lambda: _actor(cluster, slot.index)["sessions"] == 0)  # the close is not waited for
    assert _actor(cluster, slot.index)["kv_pages_used"] == 0


def test_a_second_turn_on_the_pinned_actor_computes_only_the_new_tokens(cluster, qwen2):
    with cluster.session(list(range(3, 43))) as sess:  # 40 tokens: its last page is partly filled
        sess.generate(params(5, 1))
        index = sess._backend.slot.index
        before = _actor(cluster, index)["computed_tokens"]
        sess.append([9, 10, 11])
        s2 = sess.generate(params(4, 2))
        # Turn 1's last sampled token and the 3 observed ones, then one per decode step.
        assert _actor(cluster, index)["computed_tokens"] - before == 1 + 3 + (len(s2.token_ids) - 1)
        assert_matches_reference(sess, {0: qwen2.hf})


def test_a_session_survives_its_actor_killed_between_turns_and_mid_turn(cluster, qwen2, reference, hold):
    sess = cluster.session(PROMPT)
    _episode(sess, [0])
    first = sess._backend.slot.pid
    os.kill(first, signal.SIGKILL)  # between turns: the next turn finds it dead
    _episode(sess, [1])
    assert sess._backend.slot.pid != first

    hold.touch()  # every engine step now pauses until the file goes
    result: dict = {}
    turn = threading.Thread(target=lambda: result.update(sample=_turn(sess, 2)), daemon=True)
    turn.start()
    victim = sess._backend.slot
    wait_until(lambda: (h := _actor(cluster, victim.index)).get("session_turns") == 1 and h["running"] == 1)
    os.kill(victim.pid, signal.SIGKILL)  # its turn has run a step and is paused: it cannot have finished
    hold.unlink()
    turn.join(120)
    assert not turn.is_alive() and "sample" in result
    assert sess._backend.slot.pid not in (first, victim.pid)
    sess.append(TURNS[2][2])
    _episode(sess, [3, 4])

    assert_same_trajectory(sess, reference)
    assert_matches_reference(sess, {0: qwen2.hf})
    sess.close()
    cluster.wait_until_healthy(120)


def test_sessions_spread_over_actors_and_batch_through_asyncio(cluster, reference):
    async def episode(sess):
        for k in range(len(TURNS)):
            max_tokens, seed, obs = TURNS[k]
            await sess.generate_async(params(max_tokens, seed))
            sess.append(obs)
        return sess

    async def main():
        with cluster.session(PROMPT) as a, cluster.session(PROMPT) as b:
            assert {a._backend.slot.index, b._backend.slot.index} == {0, 1}  # idle actors: fewest sessions first
            return await asyncio.gather(episode(a), episode(b))

    for sess in asyncio.run(main()):
        assert_same_trajectory(sess, reference)


def test_bad_input_raises_on_the_driver_before_any_actor_call(cluster, monkeypatch):
    sess = cluster.session([3, 4, 5])
    sess.generate(params(2, 0))
    before = (sess.token_ids, sess.loss_mask, sess.logprobs, sess.versions)

    def no_actor_call(*args):
        raise AssertionError("an actor was called")

    monkeypatch.setattr(ClusterSessions, "pin", no_actor_call)
    monkeypatch.setattr(ClusterSessions, "run_turn", no_actor_call)
    for prompt, error, match in [
        (3.5, TypeError, "prompt"),
        ([5, 96], ValueError, "vocabulary"),
        ([3] * 256, ValueError, "max_seq_len"),
        ("text", ValueError, "tokenizer"),
    ]:
        with pytest.raises(error, match=match):
            cluster.session(prompt)
    with pytest.raises(ValueError, match="n must be 1"):
        sess.generate(SamplingParams(n=2))
    with pytest.raises(ValueError, match="stop_token_ids"):
        sess.generate(SamplingParams(stop_token_ids=[96]))
    with pytest.raises(ValueError, match="vocabulary"):
        sess.append([5, 96])
    with pytest.raises(ValueError, match="chat template"):
        sess.append([{"role": "user", "content": "hi"}])
    assert (sess.token_ids, sess.loss_mask, sess.logprobs, sess.versions) == before
    sess.close()


def test_an_error_inside_the_actor_reaches_the_caller_unchanged(cluster, ray_session):
    with cluster.session([3, 4, 5]) as sess:
        slot = sess._backend.slot
        ray_session.get(control(slot.handle, "inject_fault").remote("session_turn", "injected"))
        with pytest.raises(ValueError, match="^injected$") as raised:
            sess.generate(params(2, 0))
        assert type(raised.value) is ValueError and sess.token_ids == [3, 4, 5]
        assert len(sess.generate(params(2, 0)).token_ids) == 2
        assert sess._backend.slot is slot and slot.state == "alive"


def test_an_actor_keeps_a_bounded_number_of_engine_sessions(qwen2):
    engine = make_engine(qwen2.path)
    kept = EngineSessions(engine, limit=2)
    ids = {k: [3 + i, 4, 5, 6] for i, k in enumerate("abc")}
    for k in "abc":
        ids[k] += kept.turn(k, ids[k], params(3, 1), f"{k}0")[0].token_ids
    assert kept.num_kept == 2 and engine.stats()["session_leases"] == 2  # "a", the oldest, was closed
    with engine.session(ids["a"][:4]) as ref:  # an uninterrupted session, for reference
        ref.generate(params(3, 1))
        ref.append([7])
        expected = ref.generate(params(2, 2)).token_ids
    computed = engine.stats()["computed_tokens"]
    # "a" starts again from the driver's ids: correct, only slower.
    assert kept.turn("a", ids["a"] + [7], params(2, 2), "a1")[0].token_ids == expected
    assert engine.stats()["computed_tokens"] - computed == len(ids["a"]) + 1 + 1
    kept.turn("b", [9, 9, 9], params(2, 0), "b1")  # ids that do not continue "b": a fresh session
    kept.close("b")
    kept.close("b")
    assert kept.num_kept == 1 and kept.num_running == 0 and engine.stats()["session_leases"] == 1


def test_the_module_verb_and_a_shut_down_cluster(ray_session, qwen2):
    cluster = rollout.init(qwen2.path, **{**KW, "num_actors": 1})
    try:
        sess = rollout.session([3, 4, 5])
        assert len(sess.generate(params(3, 0)).token_ids) == 3
    finally:
        rollout.shutdown()
    with pytest.raises(ClosedError):
        cluster.session([3, 4, 5])
    with pytest.raises(ClosedError):
        sess.generate(params(3, 0))
    with pytest.raises(RuntimeError, match="rollout.init"):
        rollout.session([3, 4, 5])
    sess.close()


def test_cluster_stream_gives_the_engines_tokens_and_cancel_frees_the_kv(cluster, qwen2):
    """`cluster.stream` (rollout/cluster/streams.py) delivers what an in-process
    engine samples for the same seed, delta by delta; cancel aborts on the actor."""
    from rollout.engine.streams import SampleDelta

    p = SamplingParams(n=2, max_tokens=10, ignore_eos=True, seed=4)
    (reference,) = make_engine(qwen2.path, max_seq_len=256).generate([PROMPT], p)
    stream = cluster.stream(PROMPT, p)
    tokens = {0: [], 1: []}
    for item in stream:
        if isinstance(item, SampleDelta):
            tokens[item.index] += item.token_ids
    assert [tokens[0], tokens[1]] == [s.token_ids for s in reference.samples]
    assert [s.token_ids for s in stream.output.samples] == [s.token_ids for s in reference.samples]
    used = sum(h["kv_pages_used"] for h in cluster.health())  # sessions of other tests may keep KV
    long = cluster.stream(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
    first = next(iter(long))
    assert isinstance(first, SampleDelta)
    long.cancel()
    wait_until(lambda: sum(h["kv_pages_used"] for h in cluster.health()) == used, 60)
    with pytest.raises(ValueError, match="vocabulary"):
        cluster.stream([1, 2, 10**6], p)


def test_cluster_abort_racing_a_push_ends_every_sample_and_frees_the_kv(cluster, qwen2, hold):
    """`GenerationHandle.abort()`: unfinished samples on both actors end with
    finish_reason "abort" and the tokens sampled so far; a push racing it
    commits; KV goes back on every actor; the cluster serves on."""
    used = sum(h["kv_pages_used"] for h in cluster.health())
    p = SamplingParams(n=2, max_tokens=200, ignore_eos=True, logprobs_mode="raw")
    prompts = [PROMPT, PROMPT[:7], PROMPT[2:], PROMPT[:5]]
    hold.touch()  # every step now waits for the file to go: the generation stays in flight
    try:
        handle = cluster.submit(prompts, p)
        wait_until(lambda: all(h.get("running", 0) for h in cluster.health()), 60)
        barrier = threading.Barrier(2, timeout=60)
        pushed: dict = {}

        def push() -> None:
            barrier.wait()
            pushed["version"] = cluster.push_weights(qwen2.hf.state_dict())  # the same weights: a new version

        pusher = threading.Thread(target=push)
        pusher.start()
        barrier.wait()
        handle.abort()
    finally:
        hold.unlink()
    pusher.join(120)
    outs = handle.result(120)
    assert pushed["version"] == cluster.policy_version()
    for out in outs:
        for s in out.samples:
            assert s.finish_reason == "abort" and len(s.token_ids) < 200
            assert len(s.token_ids) == len(s.logprobs) == len(s.versions)
            if s.token_ids:  # the weights never changed: every kept token is exact under them
                ref = hf_logprobs(qwen2.hf, out.prompt_token_ids, s.token_ids)
                assert torch.allclose(torch.tensor(s.logprobs, dtype=torch.float64), ref, atol=1e-4)
    wait_until(lambda: sum(h["kv_pages_used"] for h in cluster.health()) == used, 60)
    (after,) = cluster.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))
    assert after.samples[0].finish_reason == "length" and after.samples[0].versions == [pushed["version"]] * 4


def test_cluster_session_abort_ends_the_turn_on_its_actor(cluster, hold):
    sess = cluster.session(PROMPT)
    result: dict = {}
    hold.touch()
    try:
        worker = threading.Thread(
            target=lambda: result.setdefault("turn", sess.generate(SamplingParams(max_tokens=200, ignore_eos=True)))
        )
        worker.start()
        wait_until(lambda: any(h.get("session_turns", 0) and h.get("running", 0) for h in cluster.health()), 60)
        sess.abort()
        wait_until(lambda: all(not h.get("running", 0) for h in cluster.health()), 60)  # ended while held
    finally:
        hold.unlink()
    worker.join(60)
    turn = result["turn"]
    assert turn.finish_reason == "abort" and len(turn.token_ids) < 200
    assert sess.token_ids == PROMPT + turn.token_ids
    sess.close()
