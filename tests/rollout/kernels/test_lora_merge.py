"""The compiled LoRA merge (`lora_merge`, csrc/lora_merge.cpp): values
against a float64 recompute, bit for bit against torch's path where the
float32 sum is exact (so only the rounding to the dtype can differ: nearest,
ties to even), overflow reported, and its input checks."""

from __future__ import annotations

import pytest
import torch

from rollout.engine.weight_lora import Adapter, merge_torch
from rollout.kernels.build import cpu_ops

# (rows, cols, r): register blocks of 4 x 16 with row and column tails, a column panel edge (256), ranks 1 to 64.
SHAPES = [(1, 1, 1), (5, 7, 3), (37, 53, 1), (35, 87, 16), (130, 333, 64), (64, 528, 16), (3, 16, 2)]
DTYPES = [torch.bfloat16, torch.float32]


def _random(rows: int, cols: int, r: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, Adapter]:
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(rows, cols, generator=g) * 0.02).to(dtype)
    a, b = torch.randn(r, cols, generator=g) * 0.05, torch.randn(rows, r, generator=g) * 0.05
    return base, Adapter(a, b, 1.7)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_merge_is_within_float32_accumulation_and_one_rounding_of_float64(dtype):
    ops = cpu_ops()
    for seed, (rows, cols, r) in enumerate(SHAPES):
        base, ad = _random(rows, cols, r, dtype, seed)
        out = torch.full_like(base, float("nan"))
        assert ops.lora_merge(out, base, ad.b, ad.a, ad.scaling) is True
        exact = base.double() + ad.scaling * (ad.b.double() @ ad.a.double())
        # r + 2 float32 roundings (the FMAs, the scaling's, the base's add), each within 2^-24 of its magnitudes
        acc = (r + 2) * 2.0**-24 * (base.double().abs() + ad.scaling * (ad.b.double().abs() @ ad.a.double().abs()))
        rounding = 2.0**-8 * (exact.abs() + acc) if dtype == torch.bfloat16 else 0.0  # bf16: 8 significant bits
        err = (out.double() - exact).abs()
        assert bool((err <= acc + rounding).all()), (rows, cols, r, float((err - acc - rounding).max()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_merge_rounds_an_exact_sum_as_torch_does_bit_for_bit(dtype):
    # Small multiples of powers of two: every product and partial sum is exact in float32, so any order of
    # summation gives the same float32 value, and what is left to compare is the rounding to `dtype`.
    ops = cpu_ops()
    ties = 0
    for seed, (rows, cols, r) in enumerate([*SHAPES, (9, 40, 64)]):
        g = torch.Generator().manual_seed(100 + seed)
        a = torch.randint(-8, 9, (r, cols), generator=g).float() * 2.0**-6
        b = torch.randint(-8, 9, (rows, r), generator=g).float() * 2.0**-5
        base = (torch.randint(-(2**12), 2**12, (rows, cols), generator=g).float() * 2.0**-13).to(dtype)
        ad = Adapter(a, b, 0.5)
        exact = base.double() + 0.5 * (b.double() @ a.double())
        assert torch.equal(exact.float().double(), exact)  # the float32 sum is exact indeed
        out, ref = torch.empty_like(base), torch.empty_like(base)
        assert ops.lora_merge(out, base, b, a, 0.5)
        merge_torch(ref, base, ad)
        assert torch.equal(_bits(out), _bits(ref))
        assert torch.equal(out, exact.float().to(dtype))  # torch's float32 -> dtype conversion of the exact sum
        if dtype == torch.bfloat16:  # halfway between two bf16 neighbours: only ties-to-even picks one
            bits = exact.float().view(torch.int32)
            ties += int(((bits & 0xFFFF) == 0x8000).sum())
    assert dtype == torch.float32 or ties > 20


def test_lora_merge_reports_overflow_and_checks_its_operands():
    ops = cpu_ops()
    base = torch.zeros(6, 20, dtype=torch.bfloat16)
    a, b = torch.full((2, 20), 1e20), torch.full((6, 2), 1e20)
    out = torch.empty_like(base)
    assert ops.lora_merge(out, base, b, a, 1.0) is False  # finite operands, a sum past the dtype's range
    assert torch.isinf(out.float()).all()
    # bfloat16's largest value plus 1e36: finite in float32, past the midpoint to 2^128, so the rounding gives inf
    top = torch.full((6, 20), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    assert ops.lora_merge(out, top, torch.full((6, 2), 7.07e17), torch.full((2, 20), 7.07e17), 1.0) is False
    assert torch.isinf(out.float()).all()
    assert ops.lora_merge(out, top, b * 0, a * 0, 1.0) is True
    for args, needle in [
        ((out, base.float(), b, a, 1.0), "base must have out's dtype"),
        ((out, base, b.double(), a, 1.0), "float32"),
        ((out, base, b[:, :1].contiguous(), a, 1.0), r"\(rows, r\)"),
        ((out, base, b, a.t().contiguous().t(), 1.0), "contiguous"),
        ((out.half(), base.half(), b, a, 1.0), "bfloat16 or float32"),
    ]:
        with pytest.raises(RuntimeError, match=needle):
            ops.lora_merge(*args)
