from __future__ import annotations

import pytest
import torch

from rollout.wire import ALIGN, BucketPacker, unpack, verify


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(64, 33, generator=g),
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.weight": torch.randn(200, 50, generator=g).to(torch.float16),
        "d.scalar": torch.tensor(3.5),
        "e.strided": torch.randn(40, 30, generator=g).t(),  # not contiguous
    }


def test_round_trip_is_bit_exact_across_buckets():
    state = _state()
    packer = BucketPacker(bucket_bytes=4096)
    buckets, manifest = packer.pack(state)
    assert len(buckets) >= 3  # small buckets force a split; large tensors get their own
    assert all(e.offset % ALIGN == 0 for e in manifest.entries)
    verify(buckets, manifest)
    out = unpack(buckets, manifest)
    assert list(out) == list(state)
    for name, t in state.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)
    assert manifest.total_bytes == sum(t.numel() * t.element_size() for t in state.values())


def test_buffers_are_reused_between_pushes():
    packer = BucketPacker(bucket_bytes=1 << 20)
    first, _ = packer.pack(_state())
    second, manifest = packer.pack({k: v * 2 for k, v in _state().items()})
    assert first[0].ctypes.data == second[0].ctypes.data
    assert torch.equal(unpack(second, manifest)["a.weight"], _state()["a.weight"] * 2)


def test_corruption_is_named():
    buckets, manifest = BucketPacker(bucket_bytes=4096).pack(_state())
    entry = manifest.entries[2]
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
    ],
)
def test_bad_state_dicts(state, error, needle):
    with pytest.raises(error, match=needle):
        BucketPacker().pack(state)
