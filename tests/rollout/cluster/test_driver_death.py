"""The driver's own failures: a trainer process killed in the middle of a
push takes its actors, placement group and buckets with it, and a new driver
starts afresh on the same Ray; a push or a generate interrupted in-process
(KeyboardInterrupt) leaves no push staged and the cluster serving."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
from functools import cache
from pathlib import Path

import pytest
import ray

import rollout
from rollout import RolloutCluster, SamplingParams
from rollout.cluster.handles import GenerationHandle
from tests.factories import _randomize, hf_logprobs
from tests.rollout.cluster.test_cluster import wait_until

ROOT = Path(__file__).resolve().parents[3]
KW = dict(
    num_cpus_per_actor=1,
    max_seq_len=256,
    kv_cache_tokens=8192,
    max_batch_size=64,
    timeout_s=60,
    stall_timeout_s=60,
    bucket_bytes=64 * 1024,  # several buckets, so a push can stop between them
)
PROMPTS = [list(range(3, 3 + k)) for k in (5, 9, 17, 30)]
PARAMS = SamplingParams(n=2, max_tokens=8, ignore_eos=True, seed=4, logprobs_mode="raw")


def serves(cluster, model, version: int) -> None:
    """Every sample is of `version` and its logprobs are `model`'s."""
    outs = cluster.generate(PROMPTS, PARAMS, timeout=60)
    assert {v for o in outs for s in o.samples for v in s.versions} == {version}
    for out in outs:
        for s in out.samples:
            ref = hf_logprobs(model, out.prompt_token_ids, s.token_ids)
            assert max(abs(a - b) for a, b in zip(s.logprobs, ref.tolist(), strict=True)) < 1e-4


def store_free() -> float:
    """Object store bytes free: the raylet reports its store's use as the
    `object_store_memory` resource left, a moment after it changes."""
    return ray.available_resources()["object_store_memory"]


def actor_state(actor_id: str) -> str:
    return ray._private.state.actors(actor_id)["State"]


def process_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except FileNotFoundError:
        return True


def read_report(child: subprocess.Popen, path: Path, timeout: float = 90.0) -> dict:
    """The child's report at `path` once written; fails at once if the child exits first."""
    wait_until(lambda: path.exists() or child.poll() is not None, timeout)
    assert path.exists(), f"the driver exited with {child.returncode} before writing {path.name}"
    return json.loads(path.read_text())


def test_a_driver_killed_mid_push_takes_its_actors_and_buckets_and_a_new_driver_starts_afresh(
    ray_session, qwen2, tmp_path
):
    address = ray_session.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(tmp_path / "driver.log", "wb") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.rollout.cluster.dying_driver", address, str(qwen2.path), str(tmp_path)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        started = read_report(child, tmp_path / "started.json")
        free = store_free()  # the child's cluster is up and has put nothing yet
        (tmp_path / "go").touch()
        staged = read_report(child, tmp_path / "staged.json")
        assert staged["received"] and all(r.isdigit() for r in staged["received"]), staged
        # The push's buckets are in the store, held by the driver and adopted by its actor.
        wait_until(lambda: store_free() <= free - sum(staged["buckets"]), 30)
        assert [actor_state(a) for a in started["actors"]] == ["ALIVE"]
        child.send_signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    # Ray's default lifetime: the actors and placement group belong to the driver's job and end with it.
    wait_until(lambda: all(actor_state(a) == "DEAD" for a in started["actors"]), 60)
    wait_until(lambda: all(process_gone(pid) for pid in started["pids"]), 60)
    placement = started["placement_group"]
    wait_until(lambda: ray.util.placement_group_table()[placement]["state"] == "REMOVED", 60)
    wait_until(lambda: store_free() >= free, 60)  # no bucket outlived its owner
    cluster = rollout.init(qwen2.path, num_actors=1, address=address, **KW)  # a new driver joins by address
    try:
        assert cluster.policy_version() == 0 and [h["version"] for h in cluster.health()] == [0]
        serves(cluster, qwen2.hf, 0)
    finally:
        rollout.shutdown()


@pytest.fixture(scope="module")
def cluster(ray_session, qwen2):
    c = RolloutCluster(qwen2.path, num_actors=2, **KW)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def policy(qwen2):
    """The policy pushed as `version` (0: the checkpoint)."""

    @cache
    def at(version: int):
        if version == 0:
            return qwen2.hf
        model = copy.deepcopy(qwen2.hf)
        _randomize(model, 100 + version)
        return model

    return at


def bounded(call, timeout: float = 60.0):
    """`call()`, failing the test if it has not returned within `timeout` s (a push lock left held hangs)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert out, f"no result within {timeout} s"
    return out[0]


def interrupt_at(monkeypatch, cluster, point: str) -> None:
    """Raise KeyboardInterrupt on the driver's thread at `point` of the next push."""
    if point == "shipping":  # the first bucket went to the actors, the second is being put
        real_put, puts = ray.put, []

        def put(value, **kwargs):
            puts.append(value)
            if len(puts) == 2:
                raise KeyboardInterrupt
            return real_put(value, **kwargs)

        monkeypatch.setattr(ray, "put", put)
        return
    what = {"received": "receiving", "prepared": "preparing", "committing": "committing"}[point]
    real_collect, fired = cluster._pool.collect, []

    def collect(calls, doing, timeout=None, **kwargs):
        if doing.startswith(what) and not fired:
            fired.append(doing)
            if point == "committing":  # the commit calls are on their way; the driver stops waiting
                raise KeyboardInterrupt
            real_collect(calls, doing, timeout, **kwargs)  # every actor has done this phase
            raise KeyboardInterrupt
        return real_collect(calls, doing, timeout, **kwargs)

    monkeypatch.setattr(cluster._pool, "collect", collect)


@pytest.mark.parametrize("point", ["shipping", "received", "prepared", "committing"])
def test_an_interrupted_push_leaves_nothing_staged_and_the_next_push_commits(cluster, policy, monkeypatch, point):
    before = cluster.policy_version()
    interrupt_at(monkeypatch, cluster, point)
    with pytest.raises(KeyboardInterrupt):
        cluster.push_weights(policy(before + 1).state_dict())
    monkeypatch.undo()
    # Sent commits cannot be called back: the driver waits for them and counts the version.
    now = before + 1 if point == "committing" else before
    assert cluster.policy_version() == now
    health = cluster.health()
    assert [(h["state"], h["version"], h["staged_pushes"]) for h in health] == [("alive", now, 0)] * 2
    serves(cluster, policy(now), now)
    assert bounded(lambda: cluster.push_weights(policy(now + 1).state_dict())) == now + 1
    assert {h["version"] for h in cluster.health()} == {now + 1}
    serves(cluster, policy(now + 1), now + 1)


def test_an_interrupted_generate_aborts_its_samples_and_the_cluster_serves_on(cluster, policy, monkeypatch):
    def interrupted(handle, timeout=None):
        wait_until(lambda: all(h["running"] > 0 for h in cluster.health()), 60)  # every actor is generating
        raise KeyboardInterrupt

    computed = sum(h["computed_tokens"] for h in cluster.health())
    params = SamplingParams(n=4, max_tokens=200, ignore_eos=True, seed=7)
    monkeypatch.setattr(GenerationHandle, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cluster.generate(PROMPTS, params)
    monkeypatch.undo()
    wait_until(lambda: all(h["running"] == h["waiting"] == 0 for h in cluster.health()), 60)
    computed = sum(h["computed_tokens"] for h in cluster.health()) - computed
    assert computed < len(PROMPTS) * params.n * params.max_tokens // 2  # aborted, not run to the end
    version = cluster.policy_version()
    serves(cluster, policy(version), version)
    assert bounded(lambda: cluster.push_weights(policy(version + 1).state_dict())) == version + 1
    serves(cluster, policy(version + 1), version + 1)


def test_a_generate_interrupted_while_dispatching_aborts_what_it_started(cluster, policy, monkeypatch):
    open_stream, opened = cluster._pool.open_stream, []

    def interrupted(*args):
        if opened:  # one actor has its share already
            raise KeyboardInterrupt
        opened.append(open_stream(*args))
        return opened[0]

    computed = sum(h["computed_tokens"] for h in cluster.health())
    params = SamplingParams(n=4, max_tokens=200, ignore_eos=True, seed=8)
    monkeypatch.setattr(cluster._pool, "open_stream", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cluster.generate(PROMPTS, params)
    monkeypatch.undo()
    wait_until(lambda: all(h["running"] == h["waiting"] == 0 for h in cluster.health()), 60)
    computed = sum(h["computed_tokens"] for h in cluster.health()) - computed
    assert computed < len(PROMPTS) * params.n * params.max_tokens // 4  # one share, aborted
    assert not any(h["load"] for h in cluster.health())
    version = cluster.policy_version()
    serves(cluster, policy(version), version)
