"""Engine.sleep / wake_up: outputs after a wake equal those before, the KV
pool's resident memory goes back to the OS, level 2 frees the weights until
a whole push, and bad levels and tags are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout import EngineAsleepError, SamplingParams
from rollout.cluster.host import resident_bytes
from tests.conftest import make_engine
from tests.factories import _randomize
from trainer_bridge import TrainerBridge

PROMPTS = [list(range(3, 30)), [5, 6, 7, 8, 9, 10]]
PARAMS = SamplingParams(n=2, max_tokens=10, ignore_eos=True, seed=13, logprobs_mode="raw")


def _outs(engine):
    return [[(s.token_ids, s.logprobs, s.versions) for s in o.samples] for o in engine.generate(PROMPTS, PARAMS)]


def test_outputs_after_a_wake_equal_those_before_and_the_kv_memory_goes_back(qwen2):
    engine = make_engine(qwen2.path, kv_cache_tokens=65536)
    before = _outs(engine)
    pool = engine.kv_pool.nbytes
    assert pool >= 32 * 2**20
    engine.kv_pool.k.fill_(0.0)  # every page of the pool resident, as after long use
    engine.kv_pool.v.fill_(0.0)
    # Private memory only: pages of Ray's object store (shared) or of files that other tests'
    # threads touch meanwhile would move the whole resident count.
    rss = resident_bytes("RssAnon")
    engine.sleep(level=1)
    assert rss - resident_bytes("RssAnon") >= 0.9 * pool  # unmapped, not cached
    assert engine.asleep == ("kv_cache",) and engine.policy_version == 0
    with pytest.raises(EngineAsleepError, match="wake_up"):
        engine.generate(PROMPTS, PARAMS)
    with pytest.raises(EngineAsleepError, match="wake_up"):
        engine.score(PROMPTS)
    engine.wake_up(tags=["weights"])  # level 1 kept them: nothing to do
    assert engine.asleep == ("kv_cache",)
    engine.wake_up(tags=["kv_cache"])
    assert engine.asleep == () and _outs(engine) == before


def test_sleep_releases_session_leases_and_the_next_turn_matches_an_engine_that_never_slept(qwen2):
    a, b = make_engine(qwen2.path), make_engine(qwen2.path)
    params = SamplingParams(max_tokens=8, ignore_eos=True, seed=3, logprobs_mode="raw")
    sa, sb = a.session(list(range(3, 20))), b.session(list(range(3, 20)))
    assert sa.generate(params).token_ids == sb.generate(params).token_ids
    assert a.stats()["session_leases"] == 1
    a.sleep(1)
    assert a.stats()["session_leases"] == 0 and a.stats()["kv_pages_used"] == 0
    a.wake_up()
    sa.append([7, 8])
    sb.append([7, 8])
    ta, tb = sa.generate(params), sb.generate(params)
    assert ta.token_ids == tb.token_ids
    assert torch.allclose(torch.tensor(ta.logprobs), torch.tensor(tb.logprobs), atol=1e-5)


def test_level_2_frees_the_weights_until_a_whole_push(qwen2):
    engine = make_engine(qwen2.path)
    policy = copy.deepcopy(qwen2.hf)
    _randomize(policy, seed=41)
    reference = make_engine(qwen2.path)
    reference.update_weights(policy.state_dict())
    expected = _outs(reference)
    engine.sleep(level=2)
    assert engine.asleep == ("weights", "kv_cache") and engine.policy_version == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    partial = {k: v for k, v in policy.state_dict().items() if "layers.1.mlp" not in k}
    with pytest.raises(ValueError, match="must set every weight; it lacks 'model.layers.1.mlp"):
        engine.update_weights(partial)
    bridge = TrainerBridge(engine)
    assert bridge.push(policy, delta=True) == 1  # a bridge that never pushed: whole
    engine.wake_up()
    assert engine.asleep == () and _outs(engine) == expected
    engine.sleep(2)
    engine.wake_up(["weights"])  # storage back, values still gone
    engine.wake_up(["kv_cache"])
    with pytest.raises(EngineAsleepError, match="push every weight"):
        engine.generate(PROMPTS, PARAMS)
    assert bridge.push(policy, delta=True) == 2 and bridge.last_push.encoding == "full"  # weights discarded
    assert _outs(engine) == [[(t, lp, [2] * len(t)) for t, lp, _ in o] for o in expected]


@pytest.mark.parametrize("level", [0, 3, True, "1", None])
def test_bad_levels_are_refused_by_name(qwen2, level):
    engine = make_engine(qwen2.path)
    with pytest.raises(ValueError, match=r"level must be one of \(1, 2\)"):
        engine.sleep(level)
    assert engine.asleep == ()


@pytest.mark.parametrize("tags", [["gpu"], "weights", [], ("weights", 1)])
def test_bad_tags_are_refused_by_name(qwen2, tags):
    engine = make_engine(qwen2.path)
    engine.sleep(1)
    with pytest.raises(ValueError, match=r"tags must be None or a (non-empty )?list of \('weights', 'kv_cache'\)"):
        engine.wake_up(tags)
    assert engine.asleep == ("kv_cache",)


def test_sleep_is_refused_while_requests_are_in_flight(qwen2):
    errors = []

    def try_sleep(info):  # between two steps, sequences still decoding
        if not errors:
            with pytest.raises(RuntimeError, match="requests in flight") as e:
                engine.sleep(1)
            errors.append(e.value)

    engine = make_engine(qwen2.path, step_callback=try_sleep)
    engine.generate(PROMPTS, PARAMS)
    assert len(errors) == 1 and engine.asleep == ()
    engine.sleep(1)
    assert engine.asleep == ("kv_cache",)


def test_a_moe_engine_frees_its_routing_pages_asleep_and_routes_as_before_after_a_wake(moe_checkpoints):
    """The KV pool's routing pages go with the keys and values, and come back zeroed: the
    routed experts after a wake equal those before the sleep, as do the tokens."""
    engine = make_engine(moe_checkpoints["qwen3_moe"].path, kv_cache_tokens=4096)
    params = SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=5, return_routed_experts=True)

    def routed():
        outs = engine.generate(PROMPTS, params)
        return [
            (o.prompt_routed_experts.tolist(), [(s.token_ids, s.routed_experts.tolist()) for s in o.samples])
            for o in outs
        ]

    before = routed()
    shape, dtype = engine.kv_pool.routing.shape, engine.kv_pool.routing.dtype
    engine.sleep(level=1)
    assert engine.kv_pool.routing.numel() == 0 and engine.kv_pool.nbytes == 0
    engine.wake_up()
    assert engine.kv_pool.routing.shape == shape and engine.kv_pool.routing.dtype == dtype
    assert routed() == before
