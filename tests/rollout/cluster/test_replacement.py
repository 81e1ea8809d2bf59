"""A replacement actor serves exactly what the live actors serve: every push
since the checkpoint, composed, not the last push alone."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch

from rollout import RolloutCluster
from rollout.cluster.actor import RolloutWorker, weight_aliases
from rollout.cluster.actor_slots import ActorGone
from rollout.cluster.published import compose
from rollout.engine.engine import Engine
from tests.factories import _randomize, pack_state, with_pushes
from tests.rollout.cluster.test_cluster import KW, PARAMS, PROMPTS, assert_per_version

ENGINE = dict(device="cpu", max_batch_size=8, max_seq_len=128, kv_cache_tokens=1024)
TIED = {"model.embed_tokens.weight": ("lm_head.weight",), "lm_head.weight": ("model.embed_tokens.weight",)}


def _policy(base, seed: int):
    model = copy.deepcopy(base)
    _randomize(model, seed)
    return model


def _only(model, *prefixes: str) -> dict:
    """The tensors of `model` whose names start with one of `prefixes`."""
    return {k: v.clone() for k, v in model.state_dict().items() if k.startswith(prefixes)}


def _pushes(base) -> list[dict]:
    """Each push touches other tensors; the tied embedding is set under one
    name, then under its alias, which must supersede it."""
    return [
        _policy(base, 99).state_dict(),
        _only(_policy(base, 123), "model.layers.0.self_attn.", "model.embed_tokens.weight"),
        _only(_policy(base, 7), "model.layers.1.mlp.", "lm_head.weight"),
    ]


def _composed(states, aliases=TIED):
    """Each state packed as a push and composed in order; per push its buckets and manifest."""
    published, packed = None, []
    for version, state in enumerate(states, start=1):
        buckets, manifest = pack_state(state, KW["bucket_bytes"])
        refs = tuple([b] for b in buckets)  # each bucket as its one segment stands in for its object ref
        published = compose(published, manifest, version, refs, aliases)
        packed.append((refs, manifest))
    return published, packed


def test_a_composed_push_names_each_tensor_once_from_the_newest_push_that_set_it(qwen2):
    pushes = _pushes(qwen2.hf)
    published, [(r1, m1), (r2, m2), (r3, m3)] = _composed(pushes)
    assert published.version == 3
    newest = {}
    for refs, manifest in ((r1, m1), (r2, m2), (r3, m3)):
        superseded = {n for e in manifest.entries for n in (e.name, *TIED.get(e.name, ()))}
        newest = {k: v for k, v in newest.items() if k not in superseded}
        newest.update({e.name: (refs[e.bucket], manifest.bucket_nbytes[e.bucket], e) for e in manifest.entries})
    got = {
        e.name: (published.refs[e.bucket], published.manifest.bucket_nbytes[e.bucket], e)
        for e in published.manifest.entries
    }
    assert len(got) == len(published.manifest.entries) == len(newest)
    for name, (ref, size, entry) in newest.items():  # the same bytes, at the same place in the same bucket
        ref2, size2, entry2 = got[name]
        assert ref2 is ref and size2 == size and (entry2.offset, entry2.checksum) == (entry.offset, entry.checksum)
    assert "model.embed_tokens.weight" not in got and any(
        got["lm_head.weight"][0] is r for r in r3
    )  # the alias superseded it
    # Buckets whose every tensor a later push replaced are released: v1's layer 0
    # attention and layer 1 gate/up, and v2's embedding.
    assert {id(r) for r in published.refs} == {id(v) for _, (v, _, _) in newest.items()}
    assert len(published.refs) == len(r1) - 2 + len(r2) - 1 + len(r3)
    assert all(published.manifest.bucket_entries(i) for i in range(len(published.refs)))
    full = compose(published, m1, 4, r1, TIED)  # a push of every tensor leaves nothing of the others
    assert full.refs == r1 and full.manifest == m1


def test_a_worker_loading_a_composed_push_holds_every_push_applied_in_order(qwen2):
    pushes = _pushes(qwen2.hf)
    published, _ = _composed(pushes, weight_aliases(Engine(qwen2.path, **ENGINE).model.weight_slots()))
    worker = RolloutWorker(qwen2.path, ENGINE, None, published.manifest, published.version, *published.refs)
    expected = with_pushes(qwen2.hf, *pushes).state_dict()
    assert worker.describe()["version"] == 3
    for name, slot in worker.engine.model.weight_slots().items():
        assert torch.equal(slot.view(), expected[name]), name


def test_a_worker_that_does_not_hold_the_published_weights_refuses_to_serve(qwen2, monkeypatch):
    published, _ = _composed(_pushes(qwen2.hf))
    monkeypatch.setattr(Engine, "commit_weights", lambda self, staged, version, inflight: version)  # a lost commit
    with pytest.raises(RuntimeError, match="after loading the published weights, .* differs"):
        RolloutWorker(qwen2.path, ENGINE, None, published.manifest, published.version, *published.refs)


@pytest.fixture
def cluster(ray_session, qwen2):
    c = RolloutCluster(qwen2.path, **KW)
    yield c
    c.shutdown()


def test_a_replacement_after_partial_pushes_serves_every_push_composed(cluster, qwen2, ray_session):
    pushes = _pushes(qwen2.hf)
    for version, state in enumerate(pushes, start=1):
        assert cluster.push_weights(state) == version
    policies = {3: with_pushes(qwen2.hf, *pushes)}
    victim, dead_pid = cluster._slots[0], cluster._slots[0].pid
    os.kill(dead_pid, signal.SIGKILL)
    # The cluster learns of a death from a call that fails; this one starts the replacement.
    [(_, gone)] = cluster._pool.call_all([victim], "policy_version", (), "answering after SIGKILL")
    assert isinstance(gone, ActorGone)
    cluster.wait_until_healthy(120)
    health = cluster.health()
    assert dead_pid not in [h["pid"] for h in health] and {h["version"] for h in health} == {3}
    for slot in cluster._slots:  # the replacement and the survivor, each asked directly
        stream = slot.handle.generate_stream.remote(list(range(len(PROMPTS))), PROMPTS, PARAMS)
        outs = [ray_session.get(ref) for ref in stream]
        assert {v for o in outs for s in o.samples for v in s.versions} == {3}
        assert_per_version(outs, policies)
    assert_per_version(cluster.generate(PROMPTS * 2, PARAMS), policies)
