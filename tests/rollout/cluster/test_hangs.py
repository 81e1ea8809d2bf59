"""Fault drills for actors that hang or stall. A hung actor is alive to the
OS and silent to Ray (SIGSTOP stands in for a GPU or collective hang, a swap
storm, a deadlock); a stalled one answers but its engine completes no step.
The watchdog finds either, kills it and the cluster carries on as after a
death: generation, session turns and pushes complete on the live actors and
the replacement loads the latest push. A busy but healthy actor is left alone.

Each drill arranges its moment with events, not timing: a step callback holds
one actor (by pid) after each of its steps while a file names it, so the test
knows the actor is mid-generation before it stops it; pushes are stopped at a
chosen phase by stopping the actor just before the driver's call of it; a
replacement is stopped while it loads as soon as Ray's actor table names its
process, before the driver asks it to describe itself."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from rollout import RolloutCluster, SamplingParams
from rollout.cluster.actor_slots import ActorGone
from rollout.cluster.ray_runtime import actor_process
from rollout.cluster.watchdog import ActorWatch, HangBounds
from rollout.engine.streams import SampleDelta
from rollout.server import ClusterBackend, ServerConfig, start_server
from tests.conftest import make_engine
from tests.factories import _randomize
from tests.rollout.cluster.test_cluster import PARAMS, PROMPTS, assert_per_version, wait_until
from tests.rollout.engine.test_sessions import assert_matches_reference, params
from tests.rollout.server.conftest import parse_prometheus

BOUNDS = dict(ping_interval_s=0.25, liveness_timeout_s=3.0)
KW = dict(
    num_actors=2,
    num_cpus_per_actor=1,
    max_seq_len=256,
    kv_cache_tokens=4096,
    max_batch_size=64,
    timeout_s=60,
    stall_timeout_s=60,
    bucket_bytes=64 * 1024,
    progress_timeout_s=30.0,  # a held actor pauses between steps: only the stall drill counts that as a stall
    **BOUNDS,
)
LONG = SamplingParams(n=2, max_tokens=40, ignore_eos=True, seed=5, logprobs_mode="raw")


def _hold_in(folder: str):
    """A step callback: while a file named after the actor's pid exists in
    `folder`, the actor pauses (a bounded wait) after each of its steps that
    leaves sequences running. The last step of earlier work, whose callback
    may come after the file appeared, does not hold up the work to come."""

    def pause(info) -> None:
        path = os.path.join(folder, str(os.getpid()))
        deadline = time.monotonic() + 60
        while info.num_running and os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.005)

    return pause


def _slow_steps(seconds: float):
    """A step callback: every step takes `seconds` longer."""
    return lambda info: time.sleep(seconds)


@pytest.fixture(scope="module")
def policies(qwen2):
    """The policy at versions 0 and 1."""
    pushed = copy.deepcopy(qwen2.hf)
    _randomize(pushed, 99)
    return [qwen2.hf, pushed]


@pytest.fixture
def hold(tmp_path) -> Path:
    return tmp_path


@pytest.fixture
def make_cluster(ray_session, qwen2, hold):
    made = []

    def make(**overrides) -> RolloutCluster:
        kwargs = {"step_callback": _hold_in(str(hold)), **KW, **overrides}
        made.append(RolloutCluster(qwen2.path, **kwargs))
        return made[-1]

    yield make
    for cluster in made:
        cluster.shutdown()


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (FileNotFoundError, ProcessLookupError):
        return False


@contextlib.contextmanager
def stopped(*pids: int):
    """SIGSTOP the processes `pids`; any still stopped on the way out is killed,
    so a failing test leaves no stopped process behind."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        release(*pids)


def release(*pids: int) -> None:
    for pid in pids:
        if _is_stopped(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)


def _actor(cluster, index: int) -> dict:
    return next(h for h in cluster.health() if h["index"] == index)


def assert_replaced(cluster, index: int, old_pid: int, fault: str) -> None:
    """Position `index` serves a new actor after one `fault` ("hung" or "stalled"), and says so."""
    cluster.wait_until_healthy(60)
    entry = _actor(cluster, index)
    assert entry["state"] == "alive" and entry["pid"] != old_pid
    assert entry["replacements"] == 1 and entry["replaced_because"].startswith(f"{fault}: ")
    assert (entry["hangs"], entry["stalls"]) == ((1, 0) if fault == "hung" else (0, 1))
    other = _actor(cluster, 1 - index)
    assert (other["replacements"], other["hangs"], other["stalls"]) == (0, 0, 0)


def assert_metrics_match_health(cluster) -> None:
    """A server over `cluster` exports each position's faults in `/metrics` as `health()` counts them."""
    server = start_server(ClusterBackend(cluster), ServerConfig("tiny", max_n=4, max_tokens=64), port=0)
    try:
        metrics = parse_prometheus(httpx.get(server.url + "/metrics", timeout=60).text)
    finally:
        server.stop()
    exported = {k: v for k, v in metrics.items() if k.startswith("rollout_actor_")}
    expected = {}
    for entry in cluster.health():
        actor = f'actor="{entry["index"]}"'
        expected |= {
            f"rollout_actor_replacements_total{{{actor}}}": entry["replacements"],
            f'rollout_actor_faults_total{{{actor},fault="hung"}}': entry["hangs"],
            f'rollout_actor_faults_total{{{actor},fault="stalled"}}': entry["stalls"],
            f"rollout_actor_failed_starts_total{{{actor}}}": entry["failed_starts"],
        }
    assert exported == expected and any(expected.values())


def assert_every_prompt_once(outs, prompts, params: SamplingParams) -> None:
    assert [o.index for o in outs] == list(range(len(prompts)))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.samples) == params.n for o in outs)
    assert all(len(s.token_ids) == params.max_tokens for o in outs for s in o.samples)


# -- the watchdog's bookkeeping, without Ray ---------------------------------------------------------------


def test_a_watch_calls_silence_a_hang_and_work_without_steps_a_stall():
    bounds = HangBounds(ping_interval_s=1.0, liveness_timeout_s=5.0, progress_timeout_s=10.0)
    watch = ActorWatch(generation=0, progress_at=0.0)
    watch.sent("ping", 0.0)
    assert watch.verdict(5.0, bounds) is None
    assert watch.verdict(5.5, bounds).kind == "hung"
    watch.answered(steps=7, holding=True, now=6.0)  # a new step: progress
    for t in (7.0, 12.0, 16.0):  # answers, holding work, the step counter standing still
        watch.sent("ping", t - 0.5)
        watch.answered(steps=7, holding=True, now=t)
        assert watch.verdict(t, bounds) is None
    fault = watch.verdict(16.5, bounds)
    assert fault.kind == "stalled" and "10.5 s" in fault.why
    watch.answered(steps=7, holding=False, now=17.0)  # no work held: nothing to make progress on
    assert watch.verdict(26.0, bounds) is None
    watch.answered(steps=7, holding=True, now=26.5)
    watch.answered(steps=8, holding=True, now=36.0)  # one step within the bound keeps it healthy
    assert watch.verdict(45.0, bounds) is None


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(liveness_timeout_s=0), "liveness_timeout_s must be a number > 0"),
        (dict(progress_timeout_s=-1.0), "progress_timeout_s must be a number > 0"),
        (dict(ping_interval_s="5"), "ping_interval_s must be a number > 0"),
        (dict(ping_interval_s=30.0), "ping_interval_s must be < liveness_timeout_s"),
    ],
)
def test_bounds_are_validated_before_any_actor_starts(ray_session, qwen2, kwargs, needle):
    before = ray_session.util.placement_group_table()
    with pytest.raises(ValueError, match=needle):
        RolloutCluster(qwen2.path, **{**KW, **BOUNDS, **kwargs})
    assert ray_session.util.placement_group_table() == before


# -- drills on a cluster ------------------------------------------------------------------------------------


def test_an_actor_hung_mid_generate_is_replaced_and_its_prompts_run_elsewhere(make_cluster, policies, hold):
    cluster = make_cluster()
    assert cluster.push_weights(policies[1].state_dict()) == 1
    pid = cluster._slots[0].pid
    (hold / str(pid)).touch()  # actor 0 pauses after each step: it holds its share mid-generation
    prompts = PROMPTS * 2
    handle = cluster.submit(prompts, LONG)
    wait_until(lambda: _actor(cluster, 0).get("running", 0) > 0)
    with stopped(pid):
        started = time.monotonic()
        outs = handle.result(60)
        recovered = time.monotonic() - started
    assert recovered < 30
    assert_every_prompt_once(outs, prompts, LONG)
    assert {v for o in outs for s in o.samples for v in s.versions} == {1}
    assert_per_version(outs, policies)
    assert_replaced(cluster, 0, pid, "hung")
    assert {h["version"] for h in cluster.health()} == {1} and cluster.policy_version() == 1


def test_an_actor_that_stalls_mid_generate_is_replaced(make_cluster, policies, hold):
    cluster = make_cluster(progress_timeout_s=4.0)
    pid = cluster._slots[0].pid
    (hold / str(pid)).touch()  # it answers every ping but completes no step after its first
    outs = cluster.generate(PROMPTS, LONG, timeout=60)
    assert_every_prompt_once(outs, PROMPTS, LONG)
    assert_per_version(outs, policies)
    assert_replaced(cluster, 0, pid, "stalled")
    assert_metrics_match_health(cluster)  # a stall here, a hang and a failed start in the loading drill


def test_a_token_stream_whose_actor_hangs_ends_with_actor_gone(make_cluster, qwen2, hold):
    """Tokens a stream delivered cannot be taken back, so it is not rerun: once
    the watchdog kills its hung actor it ends with `ActorGone`, and the next
    stream runs on a live actor."""
    cluster = make_cluster()
    pid = cluster._slots[0].pid
    (hold / str(pid)).touch()  # actor 0 pauses after each step
    params = SamplingParams(max_tokens=40, ignore_eos=True, seed=3)
    stream = iter(cluster.stream(PROMPTS[0], params))  # to actor 0: both idle, the lower index first
    assert isinstance(next(stream), SampleDelta)  # a token was delivered
    assert _actor(cluster, 0)["running"] == 1 and _actor(cluster, 1)["running"] == 0
    with stopped(pid), pytest.raises(ActorGone, match="died while streaming"):
        for _ in stream:
            pass
    assert_replaced(cluster, 0, pid, "hung")
    again = cluster.stream(PROMPTS[0], params)
    tokens = [t for item in again if isinstance(item, SampleDelta) for t in item.token_ids]
    (reference,) = make_engine(qwen2.path, max_seq_len=256).generate([PROMPTS[0]], params)
    assert tokens == again.output.samples[0].token_ids == reference.samples[0].token_ids


def test_a_session_turn_on_an_actor_that_hangs_runs_again_elsewhere(make_cluster, qwen2, hold):
    prompt, turns = [3 + (7 * i) % 90 for i in range(11)], [(6, 11, [5, 9]), (24, 12, [17]), (5, 13, [])]
    with make_engine(qwen2.path).session(prompt) as ref:
        for max_tokens, seed, observation in turns:
            ref.generate(params(max_tokens, seed))
            ref.append(observation)
    cluster = make_cluster()
    sess = cluster.session(prompt)
    sess.generate(params(*turns[0][:2]))
    sess.append(turns[0][2])
    victim = sess._backend.slot
    index, pid = victim.index, victim.pid
    (hold / str(pid)).touch()
    result: dict = {}
    turn = threading.Thread(target=lambda: result.update(sample=sess.generate(params(*turns[1][:2]))), daemon=True)
    turn.start()
    wait_until(lambda: (h := _actor(cluster, index)).get("session_turns") == 1 and h["running"] == 1)
    with stopped(pid):
        turn.join(60)
    assert not turn.is_alive() and "sample" in result
    assert sess._backend.slot.pid != pid
    sess.append(turns[1][2])
    sess.generate(params(*turns[2][:2]))
    sess.append(turns[2][2])
    assert sess.token_ids == ref.token_ids and sess.loss_mask == ref.loss_mask
    assert_matches_reference(sess, {0: qwen2.hf})
    sess.close()
    assert_replaced(cluster, index, pid, "hung")


def _stop_before(cluster, method: str, victims) -> list[int]:
    """Make the driver stop the actor in each slot of `victims`, once, just
    before it calls `method` on it; returns the list the stopped pids are
    added to. `del cluster._pool.call` ends it."""
    pool, pids, done = cluster._pool, [], set()
    real_call = pool.call

    def call(slot, name, *args):
        if name == method and slot in victims and slot.index not in done:
            done.add(slot.index)
            pids.append(slot.pid)
            os.kill(slot.pid, signal.SIGSTOP)
        return real_call(slot, name, *args)

    pool.call = call
    return pids


@pytest.mark.parametrize("phase", ["prepare_push", "commit_push"])
def test_a_push_commits_on_the_live_actor_when_one_hangs_and_its_replacement_loads_it(make_cluster, policies, phase):
    cluster = make_cluster()
    victim = cluster._slots[1]
    stopped_pids = _stop_before(cluster, phase, [victim])
    try:
        assert cluster.push_weights(policies[1].state_dict()) == 1
    finally:
        release(*stopped_pids)
    assert len(stopped_pids) == 1 and cluster.policy_version() == 1
    assert_replaced(cluster, 1, stopped_pids[0], "hung")
    assert {h["version"] for h in cluster.health()} == {1}
    outs = cluster.generate(PROMPTS * 2, PARAMS)
    assert {v for o in outs for s in o.samples for v in s.versions} == {1}
    assert_per_version(outs, policies)


def test_a_push_every_actor_hangs_in_fails_and_leaves_the_version_where_it_was(make_cluster, policies):
    cluster = make_cluster()
    stopped_pids = _stop_before(cluster, "prepare_push", list(cluster._slots))
    try:
        with pytest.raises(RuntimeError, match=r"(?s)no actor prepared weight push v1: .* stays at version 0"):
            cluster.push_weights(policies[1].state_dict())
    finally:
        release(*stopped_pids)
    assert len(stopped_pids) == 2 and cluster.policy_version() == 0
    cluster.wait_until_healthy(60)
    health = cluster.health()
    assert {h["version"] for h in health} == {0} and [h["hangs"] for h in health] == [1, 1]
    assert {v for o in cluster.generate(PROMPTS, PARAMS) for s in o.samples for v in s.versions} == {0}
    del cluster._pool.call
    assert cluster.push_weights(policies[1].state_dict()) == 1  # the next push goes through
    assert_per_version(cluster.generate(PROMPTS, PARAMS), policies)


def test_a_busy_actor_with_slow_steps_and_a_long_prefill_is_not_killed(make_cluster, policies):
    # The default bounds scaled down tenfold (5 / 30 / 60 s -> 0.5 / 3 / 6 s); each
    # step then takes 2 s more, and a 160-token prompt is prefilled 32 tokens a
    # step: its first token comes after five steps, ~10 s, past both bounds.
    cluster = make_cluster(
        ping_interval_s=0.5,
        liveness_timeout_s=3.0,
        progress_timeout_s=6.0,
        max_batch_size=8,
        max_step_tokens=32,
        step_callback=_slow_steps(2.0),
    )
    pids = [s.pid for s in cluster._slots]
    prompts = [[3 + i % 90 for i in range(160)], [5 + i % 90 for i in range(160)]]
    slow = SamplingParams(max_tokens=2, ignore_eos=True, seed=1, logprobs_mode="raw")
    outs = cluster.generate(prompts, slow, timeout=120)
    assert_every_prompt_once(outs, prompts, slow)
    assert_per_version(outs, policies)
    health = cluster.health()
    assert [h["pid"] for h in health] == pids
    assert [(h["replacements"], h["hangs"], h["stalls"]) for h in health] == [(0, 0, 0), (0, 0, 0)]
    cluster.shutdown()
    assert not cluster._watchdog._thread.is_alive()  # shutdown stops the watchdog


def _stop_first_replacement_while_it_loads(cluster) -> list[tuple[int, str]]:
    """Make the pool's first replacement stop (SIGSTOP) as soon as Ray's actor
    table names its process, before the pool asks it to describe itself, so
    it never answers; returns the list its (pid, table state when stopped)
    is added to. The actor itself is given no hook."""
    pool, stopped_at = cluster._pool, []
    real_spawn = pool._spawn

    def spawn(index, published):
        handle = real_spawn(index, published)
        if not stopped_at:
            deadline = time.monotonic() + 60
            while (pid := actor_process(handle)[0]) is None:
                assert time.monotonic() < deadline, "Ray's actor table never named the replacement's process"
                time.sleep(0.002)
            os.kill(pid, signal.SIGSTOP)
            stopped_at.append((pid, _table_state(handle)))
        return handle

    pool._spawn = spawn
    return stopped_at


def _table_state(handle) -> str:
    """The actor's state in Ray's actor table."""
    from ray._private import state

    return state.actors(handle._actor_id.hex())["State"]


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_replacement_that_hangs_while_loading_is_killed_and_started_again(make_cluster, policies):
    cluster = make_cluster(timeout_s=15)
    assert cluster.push_weights(policies[1].state_dict()) == 1  # a replacement loads v1 before it serves
    pid = cluster._slots[0].pid
    stopped_at = _stop_first_replacement_while_it_loads(cluster)
    try:
        with stopped(pid):  # the watchdog finds it hung and replaces it; the replacement is stopped
            wait_until(lambda: cluster._slots[0].state != "alive")
            cluster.wait_until_healthy(60)  # raises once the position is dead
    finally:
        release(*(p for p, _ in stopped_at))
    [(replacement, state)] = stopped_at
    assert state == "PENDING_CREATION"  # stopped in its constructor: loading the checkpoint and the push
    wait_until(lambda: _gone(replacement), timeout=10)  # killed by the pool, not by the test's clean-up
    entry = _actor(cluster, 0)
    assert entry["state"] == "alive" and entry["pid"] not in (pid, replacement)
    assert entry["replacements"] == 1 and entry["hangs"] == 1 and entry["replaced_because"].startswith("hung: ")
    assert entry["failed_starts"] == 1
    assert_metrics_match_health(cluster)
    assert entry["failed_start_because"] == (
        "replacement failed to start (try 1 of 3): it did not load and describe itself within 15 s; it was killed"
    )
    assert {h["version"] for h in cluster.health()} == {1}
    outs = cluster.generate(PROMPTS * 2, PARAMS)
    assert {v for o in outs for s in o.samples for v in s.versions} == {1}
    assert_per_version(outs, policies)


def test_a_position_whose_replacements_all_fail_to_start_is_dead_after_three_tries(make_cluster, policies):
    cluster = make_cluster()
    assert cluster.push_weights(policies[1].state_dict()) == 1
    pool, handles = cluster._pool, []
    real_spawn = pool._spawn

    def spawn(index, published):  # each replacement commits the push under a wrong version: it must not serve
        handles.append(real_spawn(index, dataclasses.replace(published, version=published.version + 7)))
        return handles[-1]

    pool._spawn = spawn
    pid = cluster._slots[0].pid
    pool.kill(cluster._slots[0], "killed by the test")
    wait_until(lambda: cluster._slots[0].state == "dead", timeout=120)
    entry = _actor(cluster, 0)
    assert entry["replacements"] == 1 and entry["replaced_because"] == "killed by the test"
    assert entry["failed_starts"] == 3 and len(handles) == 3
    assert (
        entry["error"]
        == entry["failed_start_because"]
        == ("replacement failed to start (try 3 of 3): it loaded version 8, not the published version 1")
    )
    wait_until(lambda: _gone(pid), timeout=10)
    for handle in handles:  # every failed replacement is ended, its process included
        wait_until(lambda h=handle: _table_state(h) == "DEAD" and _gone(actor_process(h)[0]), timeout=10)
    outs = cluster.generate(PROMPTS, PARAMS)  # the live actor serves on
    assert {v for o in outs for s in o.samples for v in s.versions} == {1}
    assert _actor(cluster, 1)["state"] == "alive"
