"""Delta pushes without Ray: the encodings against hand-computed cases, and
an engine fed by a real optimizer's deltas holding the trainer's cast
weights bit for bit, sampling as a fresh engine loaded with them."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout import SamplingParams
from rollout.engine import delta_encoder
from rollout.engine.delta_encoder import DeltaEncoder
from rollout.engine.weight_delta import (
    BASE,
    INDEX,
    MASK,
    VALUES,
    Patch,
    changed_at,
    choose,
    host_ops,
    pack_mask,
    put,
    sizes,
    unpack_mask,
)
from tests.conftest import make_engine
from trainer_bridge import TrainerBridge
from trainer_bridge.names import export_state_dict

BF16 = torch.bfloat16
PROMPTS = [list(range(3, 19)), [5, 6, 7, 8, 9]]
PARAMS = SamplingParams(n=2, max_tokens=12, ignore_eos=True, seed=8, logprobs_mode="raw")


def test_encoding_sizes_and_choice_by_hand():
    # 1000 bf16 elements: whole 2000 B; mask 125 B + 2k; index 6k.
    assert sizes(1000, 10, 2) == {"full": 2000, "mask": 145, "index": 60}
    assert choose(1000, 10, 2) == "index"  # sparse
    assert choose(1000, 100, 2) == "mask"  # 325 < 600
    assert choose(1000, 990, 2) == "full"  # 2105 > 2000
    assert choose(1000, 500, 2) == "full"  # 1125 < 2000, but a mask must halve the bytes
    assert choose(1000, 437, 2) == "mask"  # 999 <= 1000
    assert choose(8, 8, 4) == "full"  # 33 > 32


def test_the_densest_delta_is_where_choose_turns_to_whole():
    # The compiled compare stops past `densest`: every count up to it must take a delta encoding, none above it.
    for itemsize in (2, 4):
        for n in (1, 7, 8, 33, 64, 100, 257):
            k = delta_encoder.densest(n, itemsize)
            assert [choose(n, c, itemsize) != "full" for c in range(n + 1)] == [c <= k for c in range(n + 1)]
    assert delta_encoder.densest(1000, 2) == 437  # a mask: 125 + 2 * 437 = 999 bytes, at most half of 2000


def test_mask_bits_are_little_endian_per_byte():
    changed = torch.zeros(11, dtype=torch.bool)
    changed[[0, 3, 8, 10]] = True
    # byte 0: bits 0 and 3 -> 1 + 8; byte 1: bits 0 and 2 (elements 8 and 10) -> 1 + 4
    assert pack_mask(changed).tolist() == [9, 5]
    assert torch.equal(unpack_mask(pack_mask(changed), 11), changed)


def _bits(t):
    return t.contiguous().view(torch.int16) if t.dtype == BF16 else t.contiguous().view(torch.int32)


def test_encoder_sends_changed_bits_only_and_keeps_its_copy():
    old = {"a": torch.randn(4096).to(BF16), "b": torch.randn(64, 64).to(BF16), "c": torch.randn(100).to(BF16)}
    enc = DeltaEncoder()
    first = enc.encode(old, base=0)
    enc.commit(first)
    assert first.cost.encoding == "full" and enc.nbytes == sum(t.nbytes for t in old.values())
    new = {k: v.clone() for k, v in old.items()}
    new["a"][[5, 700]] = 3.0  # sparse: indices
    new["b"].view(-1)[::3] += 1.0  # a third: mask
    new["b"][0, 0] = -new["b"][0, 0] if new["b"][0, 0] != 0 else 1.0
    encoded = enc.encode(new, base=1)
    sent = encoded.state_dict
    assert sent[BASE].tolist() == [1]
    assert sent["a" + INDEX].tolist() == [5, 700] and sent["a" + VALUES].tolist() == [3.0, 3.0]
    changed_b = (_bits(new["b"]) != _bits(old["b"])).view(-1)
    assert torch.equal(unpack_mask(sent["b" + MASK], 4096), changed_b)
    assert "c" not in sent and not any(k.startswith("c@") for k in sent)
    k = int(changed_b.sum())
    assert encoded.cost.bytes_sent == 8 + 2 * 6 + (512 + 2 * k)
    assert encoded.cost.bytes_full == sum(t.nbytes for t in new.values())
    assert encoded.cost.tensors == {"full": 0, "mask": 1, "index": 1, "unchanged": 1}
    enc.commit(encoded)
    assert all(torch.equal(_bits(enc.reference[n]), _bits(new[n])) for n in new)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32])
def test_the_compiled_compare_and_scatter_match_numpys_passes(dtype):
    ops = host_ops()
    if ops is None:
        pytest.skip("the compiled CPU kernels are unavailable on this host")  # numpy's path is tested above
    g = torch.Generator().manual_seed(1)
    for n, fraction in [(1, 1.0), (63, 0.2), (64, 0.0), (65, 0.5), (1000, 0.01), (4096 + 17, 0.3), (50_000, 0.9)]:
        old = torch.randint(-30000, 30000, (n,), generator=g, dtype=torch.int32).to(dtype)
        new = old.clone()
        flip = torch.rand(n, generator=g) < fraction
        new[flip] ^= 1  # one bit: a different value
        want = torch.nonzero(new != old).view(-1)
        mask = torch.full(((n + 7) // 8 + 8,), 0xAA, dtype=torch.uint8)
        index, values = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=dtype)
        assert ops.delta_compare(new, old, mask, index, values, n) == want.numel()
        assert torch.equal(mask[: (n + 7) // 8], pack_mask(new != old))
        assert torch.equal(index[: want.numel()].long(), want) and torch.equal(values[: want.numel()], new[want])
        for where in (index[: want.numel()], want, mask[: (n + 7) // 8]):  # int32, int64 positions; a mask
            patched = old.clone()
            ops.delta_scatter(patched, where.contiguous(), values[: want.numel()].contiguous())
            assert torch.equal(patched, new)
        if want.numel() > 2:  # gives up after the block of 64 where more than `stop` = 1 changed
            cumulative = torch.bincount(want // 64).cumsum(0)
            short = torch.full((2,), -1, dtype=torch.int32)  # positions: room for 2
            assert ops.delta_compare(new, old, mask, short, values, 1) == cumulative[cumulative > 1][0]
            assert torch.equal(short.long(), want[:2])
    with pytest.raises(RuntimeError, match="outside the tensor"):
        ops.delta_scatter(torch.zeros(8, dtype=dtype), torch.tensor([8], dtype=torch.int32), torch.ones(1, dtype=dtype))


@pytest.mark.parametrize("dtype", [BF16, torch.float64])  # the compiled scatter takes 2- and 4-byte elements
def test_a_received_mask_or_index_patch_writes_exactly_its_elements(dtype):
    changed = torch.zeros(20, dtype=torch.bool)
    changed[[1, 9, 19]] = True
    values = torch.tensor([1.0, 2.0, 3.0], dtype=dtype)
    for patch in (
        Patch(values, mask=pack_mask(changed)),
        Patch(values, index=torch.tensor([1, 9, 19], dtype=torch.int32)),
    ):
        live = torch.zeros(20, dtype=dtype)
        put(live, *changed_at("w", live, patch))
        assert live[[1, 9, 19]].tolist() == [1.0, 2.0, 3.0] and int(live.count_nonzero()) == 3


def test_a_tensor_whose_sample_says_most_changed_goes_whole_and_exact(qwen2, monkeypatch):
    """The sample picks whole for a tensor whose every sampled element changed,
    though only 1/16 of it did (a delta would have been smaller): no compare,
    and the engine still ends with the trainer's bits."""
    engine = make_engine(qwen2.path, dtype="bfloat16")
    bridge = TrainerBridge(engine)
    cast = export_state_dict(qwen2.hf, BF16)
    bridge.push(cast, delta=True)  # whole: fills the trainer's copy
    name = max((k for k in cast if ".layers." in k), key=lambda k: cast[k].numel())
    n = cast[name].numel()
    monkeypatch.setattr(delta_encoder, "SAMPLE_MIN", 1024)
    monkeypatch.setattr(delta_encoder, "SAMPLES", n // 16)
    compared = []
    if host_ops() is not None:
        monkeypatch.setattr(delta_encoder, "host_ops", lambda: _Spy(host_ops(), compared))
    new = {k: v.clone() for k, v in cast.items()}
    new[name].view(-1)[::16] += 1.0  # exactly the sampled elements
    small = min((k for k in cast if cast[k].numel() < 1024), key=lambda k: cast[k].numel())
    new[small].view(-1)[0] += 1.0
    bridge.push(new, delta=True)
    cost = bridge.last_push
    assert cost.encoding == "delta" and cost.tensors["full"] == 1 and cost.tensors["index"] + cost.tensors["mask"] == 1
    assert new[name].data_ptr() not in compared and (host_ops() is None or new[small].data_ptr() in compared)
    assert_holds(engine, new)


class _Spy:
    """The compiled ops, recording where each tensor `delta_compare` ran on lies."""

    def __init__(self, ops, seen: list):
        self.ops, self.seen = ops, seen

    def delta_compare(self, new, *args):
        self.seen.append(new.data_ptr())
        return self.ops.delta_compare(new, *args)

    def __getattr__(self, op):
        return getattr(self.ops, op)


def test_a_push_that_does_not_wait_keeps_what_it_sent_not_what_the_caller_changed_after():
    enc = DeltaEncoder()
    enc.commit(enc.encode({"a": torch.zeros(64, dtype=BF16)}, base=0))
    new = {"a": torch.ones(64, dtype=BF16)}  # every element changed: sent whole
    later = enc.encode(new, base=1, stable=False)  # the caller may change its tensors before the commit
    new["a"].fill_(5.0)
    enc.commit(later)
    assert torch.equal(enc.reference["a"], torch.ones(64, dtype=BF16))
    waited = enc.encode({"a": torch.full((64,), 2.0, dtype=BF16)}, base=2, stable=True)
    kept = enc.reference["a"]
    enc.commit(waited)  # copied into the copy's own memory at commit
    assert enc.reference["a"] is kept and torch.equal(kept, torch.full((64,), 2.0, dtype=BF16))


def test_a_lent_copy_is_never_written_a_later_delta_copies_it_first():
    """`borrow`: tensors sent whole become the copy as the caller lends their
    bytes (the object store's, which actors read as their weights)."""
    enc = DeltaEncoder()
    state = {"a": torch.randn(4096).to(BF16), "b": torch.randn(4096).to(BF16)}
    lent = {k: v.clone() for k, v in state.items()}  # stands for the store's bytes
    first = enc.encode(state, base=0, borrow=True)
    enc.commit(first, lent)
    assert all(enc.reference[k] is lent[k] for k in state)
    new = {k: v.clone() for k, v in state.items()}
    new["a"][7] += 1.0  # sparse: a scatter
    new["b"][::3] += 1.0  # a third: a mask, copied whole into the copy at commit
    second = enc.encode(new, base=1, stable=True, borrow=True)
    assert second.cost.tensors == {"full": 0, "mask": 1, "index": 1, "unchanged": 0}
    enc.commit(second)
    assert all(torch.equal(lent[k], state[k]) for k in state)  # untouched
    assert all(torch.equal(_bits(enc.reference[k]), _bits(new[k])) for k in state)
    assert enc.reference["a"].data_ptr() != lent["a"].data_ptr()


def _train_steps(model, steps: int, lr: float, seed: int):
    """AdamW on float32 master weights; yields after each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    for _ in range(steps):
        ids = torch.randint(0, vocab, (4, 24), generator=g)
        loss = torch.nn.functional.cross_entropy(model(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield


def assert_holds(engine, cast: dict):
    slots = engine.model.weight_slots()
    for name, tensor in cast.items():
        assert torch.equal(_bits(slots[name].view()), _bits(tensor)), name


def _samples(engine):
    return [[(s.token_ids, s.logprobs) for s in o.samples] for o in engine.generate(PROMPTS, PARAMS)]


def test_delta_pushes_from_adamw_leave_the_engine_with_the_trainers_cast_weights(qwen2):
    model = copy.deepcopy(qwen2.hf).train()
    engine = make_engine(qwen2.path, dtype="bfloat16")
    bridge = TrainerBridge(engine)
    encodings = set()
    for step in _train_steps(model, steps=4, lr=3e-4, seed=3):  # noqa: B007
        v = bridge.push(model, delta=True)
        cast = export_state_dict(model, BF16)
        assert_holds(engine, cast)
        cost = bridge.last_push
        assert cost.bytes_full == sum(t.nbytes for t in cast.values())
        encodings |= {k for k, n in cost.tensors.items() if n}
        if v > 1:
            assert cost.encoding == "delta" and cost.bytes_sent < cost.bytes_full
    assert {"mask", "index"} <= encodings
    assert bridge.reference_bytes == sum(t.nbytes for t in cast.values())
    fresh = make_engine(qwen2.path, dtype="bfloat16")
    fresh.update_weights(cast)
    assert _samples(engine) == _samples(fresh)


def test_a_bad_delta_is_refused_by_name_and_changes_nothing(qwen2):
    engine = make_engine(qwen2.path, dtype="bfloat16")
    name = "model.layers.0.mlp.down_proj.weight"
    live = engine.model.weight_slots()[name].view().clone()
    n = live.numel()
    good_mask = pack_mask(torch.arange(n) % 7 == 0)
    values = torch.ones(int((torch.arange(n) % 7 == 0).sum()), dtype=BF16)
    base, one = torch.tensor([0]), torch.tensor([1], dtype=torch.int32)
    bad = [
        ({BASE: torch.tensor([3]), name + MASK: good_mask, name + VALUES: values}, "relative to version 3"),
        ({BASE: base, name + MASK: good_mask[:-1], name + VALUES: values}, "delta mask of"),
        ({BASE: base, name + MASK: good_mask, name + VALUES: values[:-1]}, "carries"),
        ({BASE: base, name + VALUES: values}, "exactly one of"),
        ({BASE: base, name + INDEX: torch.tensor([4, 2], dtype=torch.int32), name + VALUES: values[:2]}, "increasing"),
        (
            {BASE: base, "model.nope" + INDEX: torch.tensor([1], dtype=torch.int32), "model.nope" + VALUES: values[:1]},
            "not a parameter",
        ),
        ({BASE: base, name + INDEX: one, name + VALUES: torch.tensor([float("nan")], dtype=BF16)}, "NaN"),
        (  # the tied embedding and head are one tensor: two different changes to it cannot both hold
            {
                BASE: base,
                "model.embed_tokens.weight" + INDEX: one,
                "model.embed_tokens.weight" + VALUES: values[:1],
                "lm_head.weight" + INDEX: one,
                "lm_head.weight" + VALUES: values[:1] * 2,
            },
            "differently",
        ),
    ]
    for state, needle in bad:
        with pytest.raises(ValueError, match=needle):
            engine.update_weights(state)
    assert engine.policy_version == 0 and torch.equal(engine.model.weight_slots()[name].view(), live)
    ok = {BASE: base, name + MASK: good_mask, name + VALUES: values}
    assert engine.update_weights(ok) == 1
    expect = live.clone().view(-1)
    expect[torch.arange(n) % 7 == 0] = 1.0
    assert torch.equal(engine.model.weight_slots()[name].view().reshape(-1), expect)
    # A sparse patch (at most 1/32 of the tensor) is written into the live weights at commit: no copy.
    where = torch.tensor([0, 5, n - 1], dtype=torch.int32)
    sparse = {BASE: torch.tensor([1]), name + INDEX: where, name + VALUES: torch.tensor([2.0, -3.0, 4.0], dtype=BF16)}
    before = engine.model.weight_slots()[name].view().data_ptr()
    staged = engine.prepare_weights(sparse)
    assert not staged.staging and len(staged.patches) == 1
    assert engine.commit_weights(staged) == 2
    expect[where.long()] = torch.tensor([2.0, -3.0, 4.0], dtype=BF16)
    after = engine.model.weight_slots()[name].view()
    assert after.data_ptr() == before and torch.equal(after.reshape(-1), expect)


def test_by_default_an_in_process_engine_gets_whole_pushes_and_no_copy_is_kept(qwen2):
    bridge = TrainerBridge(make_engine(qwen2.path))
    bridge.push(qwen2.hf)
    assert bridge.last_push.encoding == "full" and bridge.reference_bytes == 0
    with pytest.raises(TypeError, match="delta must be None"):
        bridge.push(qwen2.hf, delta="yes")
