from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from rollout.cluster.wire import ALIGN, Manifest
from rollout.cluster.wire_receive import assemble, unpack, verification_shares, verify_entries
from rollout.cluster.wire_send import SEGMENT_MIN, BucketPacker, wire_order
from tests.factories import pack_state


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(64, 33, generator=g),
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.weight": torch.randn(200, 50, generator=g).to(torch.float16),
        "d.scalar": torch.tensor(3.5),
        "e.strided": torch.randn(40, 30, generator=g).t(),  # not contiguous
        "f.weight": torch.randn(32, 32, generator=g),  # 4 KiB, contiguous: sent in place
        "g.empty": torch.zeros(0, 4),
    }


def verify(buckets, manifest):
    """Every bucket's size and every tensor's checksum, as a receiving actor checks them."""
    if len(buckets) != len(manifest.bucket_nbytes):
        raise ValueError(f"{len(buckets)} buckets, the manifest names {len(manifest.bucket_nbytes)}")
    for index, bucket in enumerate(buckets):
        assert bucket.nbytes == manifest.bucket_nbytes[index]
        verify_entries(bucket, manifest.bucket_entries(index))


def test_round_trip_is_bit_exact_across_buckets():
    state = _state()
    buckets, manifest = pack_state(state, bucket_bytes=4096)
    assert len(buckets) >= 3  # small buckets force a split; large tensors get their own
    assert all(e.offset % ALIGN == 0 for e in manifest.entries)
    verify(buckets, manifest)
    out = unpack(buckets, manifest)
    assert sorted(out) == sorted(state) and list(out) == [e.name for e in manifest.entries]
    for name, t in state.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)
    assert manifest.total_bytes == sum(t.numel() * t.element_size() for t in state.values())


def test_segments_view_large_contiguous_tensors_in_place():
    state = _state()
    packed = list(BucketPacker().pack_buckets(state))
    assert len(packed) == 1
    segments = packed[0].segments
    assert all(s.nbytes % ALIGN == 0 and s.nbytes >= SEGMENT_MIN for s in segments)
    in_place = {n for n in state if any(s.ctypes.data == state[n].data_ptr() for s in segments)}
    assert in_place == {"a.weight", "f.weight"}  # 8448 and 4096 bytes; the rest are small, odd or strided
    offsets = np.cumsum([0] + [s.nbytes for s in segments])
    for e in (e for e in packed[0].entries if e.nbytes):  # each entry lies inside one segment
        k = np.searchsorted(offsets, e.offset, side="right") - 1
        assert e.offset + e.nbytes <= offsets[k + 1]


def test_assemble_is_zero_copy_for_segments_side_by_side():
    (packed,) = BucketPacker().pack_buckets(_state())
    store = np.concatenate(packed.segments)  # what the object store does: one copy, side by side
    cuts = np.cumsum([0] + [s.nbytes for s in packed.segments])
    received = [store[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    bucket, copied = assemble(received)
    assert not copied and bucket.ctypes.data == store.ctypes.data and not bucket.flags.writeable
    owner = weakref.ref(store)
    del store, received
    gc.collect()
    assert owner() is not None  # the bucket keeps the memory it views alive
    copy, copied = assemble(packed.segments)  # separate arrays: copied together, same bytes
    assert copied and np.array_equal(copy, bucket)
    with pytest.raises(TypeError, match="segment 0"):
        assemble([np.zeros((2, 2), dtype=np.uint8)])


def test_scratch_is_reused_between_pushes():
    packer = BucketPacker(bucket_bytes=1 << 20)
    state = _state()
    (first,) = packer.pack_buckets(state)
    doubled = {k: v.mul_(2) for k, v in _state().items()}  # same layout, new values
    (second,) = packer.pack_buckets(doubled)
    sources = {t.data_ptr() for t in state.values()}
    scratch = [i for i, s in enumerate(first.segments) if s.ctypes.data not in sources]
    assert scratch
    assert [first.segments[i].ctypes.data for i in scratch] == [second.segments[i].ctypes.data for i in scratch]
    bucket, _ = assemble(second.segments)
    out = unpack([bucket], _manifest(second))
    assert torch.equal(out["b.bias"], state["b.bias"] * 2)


def _manifest(packed):
    return Manifest(packed.entries, (packed.nbytes,))


def test_wire_order_puts_fused_siblings_side_by_side():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.v_proj.bias",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.input_layernorm.weight",
    ]
    p = "model.layers.0.self_attn."
    assert wire_order(names) == [
        ["model.embed_tokens.weight"],
        [p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight", p + "o_proj.weight"]
        + [p + "q_proj.bias", p + "k_proj.bias", p + "v_proj.bias"],
        ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"],
        ["model.layers.0.input_layernorm.weight"],
    ]


def test_a_module_is_not_split_across_buckets():
    block = torch.ones(16, 32)  # 2 KiB
    state = {name: block.clone() for name in ("x.a.weight", "y.p.weight", "y.q.weight", "y.r.weight")}
    _, manifest = pack_state(state, bucket_bytes=3 * block.nbytes)
    assert [e.bucket for e in manifest.entries] == [0, 1, 1, 1]


def test_corruption_is_named():
    buckets, manifest = pack_state(_state(), bucket_bytes=4096)
    entry = next(e for e in manifest.entries if e.name == "c.weight")
    buckets[entry.bucket][entry.offset + 5] ^= 0xFF
    with pytest.raises(ValueError, match="'c.weight' fails its checksum"):
        verify(buckets, manifest)
    with pytest.raises(ValueError, match="buckets"):
        verify(buckets[:-1], manifest)


@pytest.mark.parametrize(
    "state,error,needle",
    [
        ([], TypeError, "mapping"),
        ({}, ValueError, "empty"),
        ({1: torch.zeros(1)}, TypeError, "strings"),
        ({"x": [1.0]}, TypeError, "torch.Tensor"),
        ({"x": torch.zeros(2, dtype=torch.complex64)}, TypeError, "dtype"),
        ({"x": torch.eye(3).to_sparse()}, TypeError, r"state_dict\['x'\] must be a dense tensor"),
        ({"x": torch.empty(3, device="meta")}, TypeError, r"state_dict\['x'\] must be a dense tensor"),
    ],
)
def test_bad_state_dicts(state, error, needle):
    with pytest.raises(error, match=needle):
        next(BucketPacker().pack_buckets(state))


def test_names_that_share_memory_travel_once():
    embed = torch.randn(64, 32)
    state = {"model.embed_tokens.weight": embed, "x.norm.weight": torch.ones(32), "lm_head.weight": embed}
    (packed,) = BucketPacker().pack_buckets(state)
    assert packed.nbytes < 2 * embed.nbytes  # the tied head is not sent again
    by_name = {e.name: e for e in packed.entries}
    head, emb = by_name["lm_head.weight"], by_name["model.embed_tokens.weight"]
    assert (head.offset, head.nbytes, head.checksum) == (emb.offset, emb.nbytes, emb.checksum)
    bucket, _ = assemble(packed.segments)
    out = unpack([bucket], _manifest(packed))
    assert torch.equal(out["lm_head.weight"], embed)
    assert out["lm_head.weight"].data_ptr() == out["model.embed_tokens.weight"].data_ptr()
    assert sum(len(s) for s in verification_shares(packed.entries, 2)) == 2  # the shared bytes are checked once
    clone = dict(state, **{"lm_head.weight": embed.clone()})  # equal values, own memory: sent twice
    (again,) = BucketPacker().pack_buckets(clone)
    assert again.nbytes >= 2 * embed.nbytes
