"""The tests' shortcuts through Triton's interpreter (tests/triton_interpreter.py):
the numpy `tl.sort` against Triton's own interpreted sorting network, on keys
like the sampler's (64-bit, unsigned with the top bit set, ties, and the
sentinel values its kernels sort with); and the builtins' names read once."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
import triton.language as tl

from tests import triton_interpreter

pytestmark = pytest.mark.skipif(triton_interpreter.ORIGINAL_SORT is None, reason="runs under Triton's interpreter")


@triton.jit
def _sort_kernel(keys_ptr, out_ptr, BLOCK: tl.constexpr, UNSIGNED: tl.constexpr, DESCENDING: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    keys = tl.load(keys_ptr + offs)
    if UNSIGNED:
        ordered = tl.sort(keys.to(tl.uint64, bitcast=True), descending=DESCENDING).to(tl.int64, bitcast=True)
    else:
        ordered = tl.sort(keys, descending=DESCENDING)
    tl.store(out_ptr + offs, ordered)


def _keys(block: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(block)
    keys = torch.randint(-(2**63), 2**63 - 1, (block,), generator=g, dtype=torch.int64)
    keys[: block // 4] = keys[block // 4 : block // 2]  # ties
    keys[-4:] = 0  # the masked-out keys
    keys[-8:-4] = -(2**32)  # 0xFFFFFFFF << 32 as uint64: the dropped tokens' keys
    return keys


def _sort(monkeypatch, sort, keys: torch.Tensor, unsigned: bool, descending: bool) -> torch.Tensor:
    calls = []
    monkeypatch.setattr(tl, "sort", lambda *a, **kw: calls.append(1) or sort(*a, **kw))
    out = torch.empty_like(keys)
    _sort_kernel[(1,)](keys, out, BLOCK=keys.numel(), UNSIGNED=unsigned, DESCENDING=descending)
    assert calls == [1]  # the kernel's tl.sort went through the one under test
    return out


@pytest.mark.parametrize("unsigned, descending", [(True, True), (True, False), (False, True)])
def test_numpy_sort_gives_the_interpreted_networks_keys(monkeypatch, unsigned, descending):
    keys = _keys(128)
    ours = _sort(monkeypatch, triton_interpreter.sort, keys, unsigned, descending)
    theirs = _sort(monkeypatch, triton_interpreter.ORIGINAL_SORT, keys, unsigned, descending)
    assert torch.equal(ours, theirs)
    as_numbers = [k % 2**64 if unsigned else k for k in keys.tolist()]  # a hand check of the order itself
    expected = sorted(as_numbers, reverse=descending)
    assert [k % 2**64 if unsigned else k for k in ours.tolist()] == expected


def test_every_builtin_the_interpreter_swaps_is_on_the_list_read_once():
    for namespace in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        names = triton_interpreter.BUILTIN_NAMES[id(namespace)]
        now = [name for name, member in inspect.getmembers(namespace) if tl.core.is_builtin(member)]
        assert set(now) <= set(names) and names == sorted(names), namespace
    assert len(triton_interpreter.BUILTIN_NAMES[id(tl)]) > 50  # the language's ops, not an empty list
