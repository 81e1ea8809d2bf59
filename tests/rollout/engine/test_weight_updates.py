"""Engine.update_weights: full, partial and rejected pushes; the in-flight
modes checked token by token against transformers for the recorded version."""

from __future__ import annotations

import copy
import inspect
import threading
import time

import numpy as np
import pytest
import torch

from rollout import SamplingParams
from rollout.cluster.wire_receive import unpack
from tests.conftest import make_engine
from tests.factories import _randomize, hf_logprobs, pack_state

PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 9, 10, 11]]
PARAMS = SamplingParams(n=3, max_tokens=24, ignore_eos=True, seed=21, logprobs_mode="raw")


@pytest.fixture(scope="module")
def hf_b(qwen2):
    """The same architecture with other weights: the policy after a training step."""
    model = copy.deepcopy(qwen2.hf)
    _randomize(model, seed=99)
    return model


def _assert_matches(hf, outs, version=None, atol=1e-4):
    for out in outs:
        for s in out.samples:
            ref = hf_logprobs(hf, out.prompt_token_ids, s.token_ids)
            assert torch.allclose(torch.tensor(s.logprobs, dtype=torch.float64), ref, atol=atol)
            if version is not None:
                assert s.versions == [version] * len(s.token_ids)


def _snapshot(outs):
    return [[(s.token_ids, s.logprobs, s.versions) for s in o.samples] for o in outs]


class UpdateAtStep:
    """A step callback that runs `action` once, after step `at`, between steps."""

    def __init__(self, at: int):
        self.at, self.count, self.action = at, 0, None

    def __call__(self, info):
        self.count += 1
        if self.count == self.at and self.action is not None:
            self.action()


def test_full_update_serves_new_weights(qwen2, hf_b):
    engine = make_engine(qwen2.path)
    _assert_matches(qwen2.hf, engine.generate(PROMPTS, PARAMS), version=0)
    # A full state_dict from transformers, tied lm_head duplicate included.
    state = hf_b.state_dict()
    assert "lm_head.weight" in state
    assert engine.update_weights(state) == 1
    assert engine.policy_version == 1
    _assert_matches(hf_b, engine.generate(PROMPTS, PARAMS), version=1)
    assert engine.update_weights(qwen2.hf.state_dict(), version=7) == 7
    _assert_matches(qwen2.hf, engine.generate(PROMPTS, PARAMS), version=7)


def test_partial_update_changes_only_named_tensors(qwen2, hf_b):
    engine = make_engine(qwen2.path)
    names = [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.bias",
        "model.norm.weight",
    ]
    partial = {n: hf_b.state_dict()[n].clone() for n in names}
    expected = copy.deepcopy(qwen2.hf)
    expected.load_state_dict(partial, strict=False)
    assert engine.update_weights(partial) == 1
    _assert_matches(expected, engine.generate(PROMPTS, PARAMS), version=1)


def _bad_pushes(qwen2):
    good = qwen2.hf.state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    nan = good[q].clone()
    nan[0, 0] = float("nan")
    inf = good[q].clone()
    inf[1, 1] = float("inf")
    mismatched_head = {
        "model.embed_tokens.weight": good["model.embed_tokens.weight"],
        "lm_head.weight": good["model.embed_tokens.weight"] + 1,
    }
    return [
        ({"model.layers.0.self_attn.nope.weight": good[q]}, {}, ValueError, "nope"),
        ({q: good[q][:-1]}, {}, ValueError, q),
        ({q: good[q].to(torch.int32)}, {}, TypeError, q),
        ({q: nan}, {}, ValueError, "NaN"),
        ({q: inf}, {}, ValueError, "inf"),
        ({q: good[q].tolist()}, {}, TypeError, q),
        ({q: good[q], "model.layers.0.self_attn.k_proj.weight": good[q]}, {}, ValueError, "k_proj"),
        ([good[q]], {}, TypeError, "state_dict"),
        ({}, {}, ValueError, "empty"),
        ({q: good[q]}, {"version": 0}, ValueError, "version"),
        ({q: good[q]}, {"version": -3}, ValueError, "version"),
        ({q: good[q]}, {"version": 1.5}, TypeError, "version"),
        ({q: good[q]}, {"version": True}, TypeError, "version"),
        ({q: good[q]}, {"inflight": "later"}, ValueError, "inflight"),
        (mismatched_head, {}, ValueError, "lm_head.weight"),
    ]


def test_rejected_pushes_leave_weights_and_version_untouched(qwen2, hf_b):
    engine = make_engine(qwen2.path)
    before = _snapshot(engine.generate(PROMPTS, PARAMS))
    for state, kwargs, error, needle in _bad_pushes(qwen2):
        with pytest.raises(error, match=needle):
            engine.update_weights(state, **kwargs)
        assert engine.policy_version == 0
    assert _snapshot(engine.generate(PROMPTS, PARAMS)) == before
    # A good push still works afterwards, and a stale version after it is refused.
    assert engine.update_weights(hf_b.state_dict(), version=3) == 3
    with pytest.raises(ValueError, match="version"):
        engine.update_weights(hf_b.state_dict(), version=3)
    assert engine.policy_version == 3


def test_inflight_recompute_token_by_token(qwen2, hf_b):
    hook = UpdateAtStep(at=6)
    engine = make_engine(qwen2.path, step_callback=hook)
    hook.action = lambda: engine.update_weights(hf_b.state_dict(), inflight="recompute")
    outs = engine.generate(PROMPTS, PARAMS)
    mixed = 0
    for out in outs:
        for s in out.samples:
            assert s.versions == sorted(s.versions) and set(s.versions) <= {0, 1}
            mixed += len(set(s.versions)) == 2
            ref_a = hf_logprobs(qwen2.hf, out.prompt_token_ids, s.token_ids)
            ref_b = hf_logprobs(hf_b, out.prompt_token_ids, s.token_ids)
            for i, (lp, v) in enumerate(zip(s.logprobs, s.versions, strict=True)):
                ref = ref_a[i] if v == 0 else ref_b[i]
                assert abs(lp - ref.item()) < 1e-4, f"token {i} version {v}"
    assert mixed == 6


def test_inflight_keep_continues_on_old_kv(qwen2, hf_b):
    hook = UpdateAtStep(at=6)
    engine = make_engine(qwen2.path, step_callback=hook)
    hook.action = lambda: engine.update_weights(hf_b.state_dict(), inflight="keep")
    outs = engine.generate(PROMPTS, PARAMS)
    for out in outs:
        for s in out.samples:
            j = s.versions.count(0)
            assert 0 < j < len(s.token_ids) and s.versions == [0] * j + [1] * (len(s.token_ids) - j)
            ids = torch.tensor([out.prompt_token_ids + s.token_ids])
            split = len(out.prompt_token_ids) + j - 1  # positions whose KV the old weights computed
            with torch.no_grad():
                logits = _continue_with(qwen2.hf, hf_b, ids, split)
            lp = torch.log_softmax(logits, -1)
            for m in range(j, len(s.token_ids)):
                row = len(out.prompt_token_ids) + m - 1 - split
                assert abs(lp[row, s.token_ids[m]].item() - s.logprobs[m]) < 1e-4, f"token {m}"
            ref_a = hf_logprobs(qwen2.hf, out.prompt_token_ids, s.token_ids[:j])
            assert torch.allclose(torch.tensor(s.logprobs[:j], dtype=torch.float64), ref_a, atol=1e-4)


def test_inflight_restart_starts_over_on_new_weights(qwen2, hf_b):
    hook = UpdateAtStep(at=6)
    engine = make_engine(qwen2.path, step_callback=hook)
    hook.action = lambda: engine.update_weights(hf_b.state_dict(), inflight="restart")
    outs = engine.generate(PROMPTS, PARAMS)
    _assert_matches(hf_b, outs, version=1)
    assert all(len(s.token_ids) == 24 for o in outs for s in o.samples)
    # Starting over re-prefills each prompt once per group, not once per sample.
    assert engine.stats()["prompt_tokens"] == 2 * sum(len(p) for p in PROMPTS)


def test_inflight_drain_finishes_old_work_first_and_new_work_waits(qwen2, hf_b):
    hook = UpdateAtStep(at=4)
    engine = make_engine(qwen2.path, step_callback=hook)
    results: dict[str, object] = {}

    def push():
        results["version"] = engine.update_weights(hf_b.state_dict(), inflight="drain")

    def late_caller():
        results["late"] = engine.generate([[7, 7, 7, 7]], SamplingParams(n=2, max_tokens=8, ignore_eos=True))

    threads = [threading.Thread(target=push), threading.Thread(target=late_caller)]

    def start_drain_then_late_caller():
        threads[0].start()
        _wait_until(lambda: engine.scheduler.draining)
        threads[1].start()
        _wait_until(lambda: len(engine.scheduler.requests) == len(PROMPTS) + 1)

    hook.action = start_drain_then_late_caller
    outs = engine.generate(PROMPTS, PARAMS)
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    _assert_matches(qwen2.hf, outs, version=0)  # in flight: finished on the old weights
    assert results["version"] == 1
    _assert_matches(hf_b, results["late"], version=1)  # arrived during the drain: waited


def test_update_from_another_thread_while_generating(qwen2, hf_b):
    hook = UpdateAtStep(at=3)
    engine = make_engine(qwen2.path, step_callback=hook)
    pusher = threading.Thread(target=lambda: engine.update_weights(hf_b.state_dict()))
    hook.action = lambda: (pusher.start(), _wait_until(lambda: engine.policy_version == 1))
    outs = engine.generate(PROMPTS, PARAMS)
    pusher.join(30)
    assert any(1 in s.versions for o in outs for s in o.samples)
    for out in outs:
        for s in out.samples:
            for i, v in enumerate(s.versions):
                ref = hf_logprobs(qwen2.hf if v == 0 else hf_b, out.prompt_token_ids, s.token_ids)[i]
                assert abs(ref.item() - s.logprobs[i]) < 1e-4


def test_drain_from_inside_generate_is_refused(qwen2, hf_b):
    hook = UpdateAtStep(at=2)
    engine = make_engine(qwen2.path, step_callback=hook)
    errors = []

    def drain_inline():
        try:
            engine.update_weights(hf_b.state_dict(), inflight="drain")
        except RuntimeError as e:
            errors.append(e)

    hook.action = drain_inline
    engine.generate(PROMPTS, PARAMS)
    assert errors and engine.policy_version == 0


def test_prefix_cache_never_serves_old_versions(qwen2, hf_b):
    engine = make_engine(qwen2.path)
    prompt = [list(range(3, 60))]  # 57 tokens: three full pages cached after the first run
    params = SamplingParams(n=1, max_tokens=8, ignore_eos=True, seed=1, logprobs_mode="raw")
    engine.generate(prompt, params)
    engine.generate(prompt, params)
    hits = engine.stats()["prefix_hit_tokens"]
    assert hits == 48  # the positive control: the cache works within a version
    engine.update_weights(hf_b.state_dict(), inflight="keep")
    out = engine.generate(prompt, params)
    assert engine.stats()["prefix_hit_tokens"] == hits
    _assert_matches(hf_b, out, version=1)
    engine.generate(prompt, params)
    assert engine.stats()["prefix_hit_tokens"] == hits + 48  # new-version entries are reused


def _continue_with(first, second, ids, split):
    """Logits of `second` over ids[split:], attending to KV that `first` computed for ids[:split]."""
    out = first(ids[:, :split], use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    # transformers 5 renamed the `past_key_values` argument to `cache`.
    key = "cache" if "cache" in inspect.signature(second.forward).parameters else "past_key_values"
    return second(ids[:, split:], **{key: cache}).logits[0].double()


def _wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.001)


def _store_buckets(state):
    """Contiguous read-only buckets, as a rollout actor receives them from the object store."""
    buckets, manifest = pack_state(state)
    for b in buckets:
        b.flags.writeable = False
    return buckets, unpack(buckets, manifest)


def test_adopting_host_update_takes_the_buckets_without_a_copy(qwen2, hf_b):
    engine = make_engine(qwen2.path)
    buckets, state = _store_buckets(hf_b.state_dict())
    engine.commit_weights(engine.prepare_weights(state, adopt=True))
    layer, p = engine.model.layers[1], "model.layers.1."
    assert layer.qkv.data_ptr() == state[p + "self_attn.q_proj.weight"].data_ptr()  # q/k/v adopted as one view
    assert layer.qkv_bias.data_ptr() == state[p + "self_attn.q_proj.bias"].data_ptr()
    assert layer.gate_up.data_ptr() == state[p + "mlp.gate_proj.weight"].data_ptr()
    assert engine.model.embed.data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    _assert_matches(hf_b, engine.generate(PROMPTS, PARAMS), version=1)
    # A later partial update copies the fused parameter out; the adopted bytes never change.
    before = [b.copy() for b in buckets]
    k = "model.layers.1.self_attn.k_proj.weight"
    partial = {k: qwen2.hf.state_dict()[k].clone()}
    assert engine.update_weights(partial) == 2
    assert all(np.array_equal(a, b) for a, b in zip(before, buckets, strict=True))
    assert layer.qkv.data_ptr() != state[p + "self_attn.q_proj.weight"].data_ptr()
    expected = copy.deepcopy(hf_b)
    expected.load_state_dict(partial, strict=False)
    _assert_matches(expected, engine.generate(PROMPTS, PARAMS), version=2)


def test_adopted_sources_that_do_not_lie_side_by_side_are_staged(qwen2, hf_b):
    engine = make_engine(qwen2.path)
    state = {k: v.clone() for k, v in hf_b.state_dict().items()}  # separate allocations
    engine.commit_weights(engine.prepare_weights(state, adopt=True))
    qkv = engine.model.layers[0].qkv
    assert qkv.data_ptr() != state["model.layers.0.self_attn.q_proj.weight"].data_ptr()
    assert engine.model.norm.data_ptr() == state["model.norm.weight"].data_ptr()  # whole tensors are adopted
    _assert_matches(hf_b, engine.generate(PROMPTS, PARAMS), version=1)


def test_host_updates_swap_storage_and_reuse_the_old_as_staging(qwen2, hf_b):
    engine = make_engine(qwen2.path)
    qkv = engine.model.layers[0].qkv
    first = qkv.data_ptr()
    engine.update_weights(hf_b.state_dict())
    second = qkv.data_ptr()
    engine.update_weights(qwen2.hf.state_dict())
    assert second != first and qkv.data_ptr() == first  # two buffers take turns: nothing allocated
    _assert_matches(qwen2.hf, engine.generate(PROMPTS, PARAMS), version=2)
    staged = engine.prepare_weights(hf_b.state_dict())
    engine.discard_weights(staged)
    with pytest.raises(RuntimeError, match="discarded already"):
        engine.commit_weights(staged)
    assert engine.policy_version == 2
    _assert_matches(qwen2.hf, engine.generate(PROMPTS, PARAMS), version=2)


def test_packed_copies_fall_back_to_plain_weights_when_packing_fails(qwen2, monkeypatch):
    def broken(weight, batch_size):
        raise RuntimeError("no reorder here")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", broken)
    with pytest.warns(RuntimeWarning, match="projections use plain weights"):
        engine = make_engine(qwen2.path)
    assert engine.model.packed is None and engine.stats()["packed_weights"] == 0
    _assert_matches(qwen2.hf, engine.generate(PROMPTS, PARAMS), version=0)


def test_packed_projection_copies_follow_every_commit(qwen2, hf_b):
    """A commit drops the packed copies of the weights it replaced; each step repacks
    at most one, and every token in between comes from the new weights."""
    engine = make_engine(qwen2.path)
    if engine.model.packed is None:
        pytest.skip("this torch build has no oneDNN: projections use torch's BLAS and nothing is packed")
    total = 4 * qwen2.hf.config.num_hidden_layers + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert engine.model.packed.per_step == 1  # a step repacks one weight of this small model
    assert engine.stats()["packed_weights"] == 1  # start-up packs one, to prove packing works here
    while engine.stats()["packed_weights"] < total:  # the first steps pack the rest
        _assert_matches(qwen2.hf, engine.generate(PROMPTS[:1], SamplingParams(max_tokens=3, ignore_eos=True)))
    # Three forward passes of three rows: decode steps run oneDNN on the packed or stale weights
    # (one- and two-row steps take skinny_linear on the plain weights instead).
    one = SamplingParams(n=3, max_tokens=3, temperature=0.0, ignore_eos=True)

    for version, (hf, state) in enumerate([(hf_b, hf_b.state_dict()), (qwen2.hf, qwen2.hf.state_dict())], start=1):
        engine.update_weights(state)  # the second update stages into the buffers the first one freed
        assert engine.stats()["packed_weights"] == 0
        repacked = []
        while not repacked or repacked[-1] < total:
            _assert_matches(hf, engine.generate(PROMPTS[:1], one), version=version)
            repacked.append(engine.stats()["packed_weights"])
        assert repacked[0] == 3 and all(b - a <= 3 for a, b in zip(repacked, repacked[1:], strict=False))
        _assert_matches(hf, engine.generate(PROMPTS, PARAMS), version=version)

    engine.update_weights(
        {"model.layers.1.self_attn.k_proj.weight": hf_b.state_dict()["model.layers.1.self_attn.k_proj.weight"].clone()}
    )
    assert engine.stats()["packed_weights"] == total - 1
    # The head is tied here: a push of the embedding alone drops the head's packed copy too.
    embed = "model.embed_tokens.weight"
    engine.update_weights({embed: hf_b.state_dict()[embed].clone()})
    assert engine.stats()["packed_weights"] == total - 2
    mixed = copy.deepcopy(qwen2.hf)
    names = (embed, "model.layers.1.self_attn.k_proj.weight")
    mixed.load_state_dict({n: hf_b.state_dict()[n] for n in names}, strict=False)
    _assert_matches(mixed, engine.generate(PROMPTS[:1], one), version=4)
    assert engine.stats()["packed_weights"] == total
