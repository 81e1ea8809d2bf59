"""The Triton fused ops (rollout/kernels/triton/fused.py) under Triton's interpreter, against the torch
path they replace (`decoder.rms_norm`, `RotaryTable.apply` with `KVPool.write`, `F.silu(gate) * up`)
and a float64 recompute.

Bit-equal to the torch path: the residual add, and rotary embedding with the KV write. Within a tight
tolerance (`CLOSE`): RMSNorm and the q/k norms before rotary (the mean of squares sums in another
order) and SiLU (numpy's exp here, another implementation on a GPU). bfloat16, the GPU dtype, cannot
run under the interpreter; float16 exercises the same rounding steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout.kernels.triton import fused, launches
from rollout.model.config import RopeConfig
from rollout.model.decoder import rms_norm
from rollout.model.rope import RotaryTable
from workspace import KVPool

EPS = 1e-6
HQ, HKV, MAX_POS, PAGES, PAGE_SIZE = 4, 2, 32, 4, 4
# Tolerances against the torch path where bit-equality is not claimed: four float32 ulps, two float16
# ulps (SiLU: its one-ulp difference is rounded again after the product with up), and an absolute
# term of a few ulps of the inputs' magnitude (about 4) for rotary's cancellations.
CLOSE = {torch.float32: dict(rtol=4 * 2**-23, atol=2e-6), torch.float16: dict(rtol=2 * 2**-10, atol=2**-14)}
# Against float64: the dtype's rounding of a few steps.
F64 = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=4e-3, atol=4e-3)}


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)


def _rms_norm64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _expect_launches(names: list[str], kernel: str, tokens: int) -> None:
    assert names == ([kernel] if tokens else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,width", [(0, 48), (1, 64), (5, 48)])
def test_rms_norm(dtype, tokens, width):
    x = _randn(tokens, width, dtype=dtype, seed=1, scale=3.0)
    weight = _randn(width, dtype=dtype, seed=2)
    out = torch.full_like(x, float("nan"))
    with launches() as names:
        fused.rms_norm(x, weight, EPS, out)
    _expect_launches(names, "_rms_norm_kernel", tokens)
    torch.testing.assert_close(out, rms_norm(x, weight, EPS), **CLOSE[dtype])
    torch.testing.assert_close(out.double(), _rms_norm64(x, weight), **F64[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,width", [(0, 48), (1, 64), (5, 48)])
def test_add_rms_norm_(dtype, tokens, width):
    h = _randn(tokens, width, dtype=dtype, seed=3, scale=3.0)
    delta = _randn(tokens, width, dtype=dtype, seed=4)
    weight = _randn(width, dtype=dtype, seed=5)
    h_ref = h + delta
    out = torch.full_like(h, float("nan"))
    with launches() as names:
        fused.add_rms_norm_(h, delta, weight, EPS, out)
    _expect_launches(names, "_rms_norm_kernel", tokens)
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(out, rms_norm(h_ref, weight, EPS), **CLOSE[dtype])
    torch.testing.assert_close(out.double(), _rms_norm64(h_ref, weight), **F64[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,width", [(0, 40), (1, 64), (5, 40)])
def test_silu_mul(dtype, tokens, width):
    gate_up = _randn(tokens, 2 * width, dtype=dtype, seed=6, scale=4.0)
    out = torch.full((tokens, width), float("nan"), dtype=dtype)
    with launches() as names:
        fused.silu_mul(gate_up, out)
    _expect_launches(names, "_silu_mul_kernel", tokens)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, **CLOSE[dtype])
    torch.testing.assert_close(out.double(), F.silu(gate.double()) * up.double(), **F64[dtype])


def _poisoned_pool(dim: int, dtype: torch.dtype, hkv: int = HKV) -> KVPool:
    """A two-layer pool full of NaN, so a write outside the given slots (or layer) shows."""
    pool = KVPool(
        num_layers=2, num_pages=PAGES, page_size=PAGE_SIZE, num_kv_heads=hkv, head_dim=dim, dtype=dtype, device="cpu"
    )
    pool.k.fill_(float("nan"))
    pool.v.fill_(float("nan"))
    return pool


class RopeCase:
    """Inputs of one rotary call: q, k, v as views of one fused qkv projection, random distinct
    slots across the pages, positions reaching the table's last row, and a NaN-poisoned pool."""

    def __init__(self, dtype, pool_dtype, tokens, dim, qk_norm, hq=HQ, hkv=HKV):
        self.hq, self.hkv = hq, hkv
        self.qkv = _randn(tokens, (hq + 2 * hkv) * dim, dtype=dtype, seed=7, scale=2.0)
        self.inputs = self.qkv.clone()  # the kernel rotates q in self.qkv
        self.dim = dim
        self.norms = (_randn(dim, dtype=dtype, seed=8), _randn(dim, dtype=dtype, seed=9)) if qk_norm else (None, None)
        self.rotary = RotaryTable(RopeConfig(theta=10000.0, type="default"), dim, MAX_POS, dtype, "cpu")
        g = torch.Generator().manual_seed(10)
        self.positions = torch.randint(0, MAX_POS, (tokens,), generator=g)
        self.positions[-1:] = MAX_POS - 1
        self.slots = torch.randperm(PAGES * PAGE_SIZE, generator=g)[:tokens]
        self.pool = _poisoned_pool(dim, pool_dtype, hkv)

    def views(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, d, hq, hkv = qkv.shape[0], self.dim, self.hq, self.hkv
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)

    def reference(self) -> tuple[torch.Tensor, KVPool]:
        """q after the torch path, and a poisoned pool written by `KVPool.write`."""
        q, k, v = self.views(self.inputs)
        q_norm, k_norm = self.norms
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, EPS), rms_norm(k, k_norm, EPS)
        q, k = self.rotary.apply(q, k, self.positions)
        pool = _poisoned_pool(self.dim, self.pool.k.dtype, self.hkv)
        pool.write(1, self.slots, k, v)
        return q, pool

    def reference64(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q and k in float64, from float64 norms and tables."""
        q, k, _ = self.views(self.inputs.double())
        q_norm, k_norm = self.norms
        if q_norm is not None:
            q, k = _rms_norm64(q, q_norm), _rms_norm64(k, k_norm)
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        angles = self.positions.double()[:, None, None] * inv_freq
        cos, sin = angles.cos(), angles.sin()
        half = self.dim // 2

        def rotate(x):
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        return rotate(q), rotate(k)


ROPE_CASES = [
    # (dtype, pool dtype, tokens, head_dim): D = 24 is not a power of two (half 12 in a block of 16)
    (torch.float32, torch.float32, 5, 64),
    (torch.float32, torch.float16, 5, 24),
    (torch.float16, torch.float16, 5, 16),
    (torch.float16, torch.float32, 1, 24),
    (torch.float32, torch.float32, 1, 16),
    (torch.float16, torch.float16, 0, 16),
]


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype,pool_dtype,tokens,dim", ROPE_CASES)
def test_rope_and_cache_(dtype, pool_dtype, tokens, dim, qk_norm):
    _check_rope_case(RopeCase(dtype, pool_dtype, tokens, dim, qk_norm), dtype, qk_norm)


# (Hq, Hkv, elements in one half-head tile, of D / 2 = 12 in a block of 16): head counts that are not
# powers of two in one tile each (8 q rows, 4 k rows), and in tiles of 2 or 1 heads that the kernel
# takes in turn, the last one partial.
HEAD_CASES = [(6, 3, None), (6, 3, 32), (5, 1, 32), (3, 2, 16)]


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hq,hkv,head_tile", HEAD_CASES)
def test_rope_and_cache_head_blocks(hq, hkv, head_tile, qk_norm, monkeypatch):
    if head_tile is not None:
        monkeypatch.setattr(fused, "HEAD_TILE", head_tile)
    case = RopeCase(torch.float16, torch.float32, 5, 24, qk_norm, hq=hq, hkv=hkv)
    _check_rope_case(case, torch.float16, qk_norm)


def _check_rope_case(case, dtype, qk_norm):
    tokens, dim, hkv = case.qkv.shape[0], case.dim, case.hkv
    q_ref, pool_ref = case.reference()
    q, k, v = case.views(case.qkv)
    kv_before = torch.cat((k, v), dim=1).clone()
    rotary, pool = case.rotary, case.pool
    args = (case.positions, rotary.cos, rotary.sin, pool.k[1], pool.v[1], case.slots)
    with launches() as names:
        if qk_norm:
            fused.norm_rope_and_cache_(q, k, v, *case.norms, EPS, *args)
        else:
            fused.rope_and_cache_(q, k, v, *args)
    _expect_launches(names, "_rope_cache_kernel", tokens)
    assert torch.equal(torch.cat((k, v), dim=1), kv_before)  # k and v are read only
    assert torch.isnan(pool.k[0]).all() and torch.isnan(pool.v[0]).all()  # another layer
    written = pool.k[1].view(-1, hkv, dim)[case.slots]
    assert not written.isnan().any() and not pool.v[1].view(-1, hkv, dim)[case.slots].isnan().any()
    _assert_rope_matches(case, q, q_ref, pool, pool_ref, dtype, qk_norm)


def _assert_rope_matches(case, q, q_ref, pool, pool_ref, dtype, qk_norm):
    """Bit-equal to the torch path where claimed (untouched slots stay NaN), and near float64."""
    for got, want in ((q, q_ref), (pool.k, pool_ref.k), (pool.v, pool_ref.v)):
        tol = CLOSE[dtype] if qk_norm and got is not pool.v else dict(rtol=0, atol=0)
        torch.testing.assert_close(got, want, equal_nan=True, **tol)
    q64, k64 = case.reference64()
    torch.testing.assert_close(q.double(), q64, **F64[dtype])
    k_pool = pool.k[1].view(-1, case.hkv, case.dim)[case.slots].double()
    coarser = torch.float16 if torch.float16 in (dtype, pool.k.dtype) else torch.float32
    torch.testing.assert_close(k_pool, k64, **F64[coarser])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="out must be"):
        fused.rms_norm(torch.zeros(2, 48), torch.ones(48), EPS, torch.empty(2, 40))
    with pytest.raises(ValueError, match="gate_up must be"):
        fused.silu_mul(torch.zeros(2, 48), torch.empty(2, 20))
    case = RopeCase(torch.float32, torch.float32, 2, 16, qk_norm=False)
    q, k, v = case.views(case.qkv)
    rotary, pool = case.rotary, case.pool
    args = (case.positions, rotary.cos, rotary.sin, pool.k[1], pool.v[1], case.slots)
    with pytest.raises(ValueError, match="D must be even"):
        fused.rope_and_cache_(q[..., :15], k[..., :15], v[..., :15], *args)
    with pytest.raises(ValueError, match="share a dtype"):
        fused.rope_and_cache_(q.half(), k, v, *args)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        fused.rope_and_cache_(q, k, v, *args[:3], pool.k[1][:, :, :1], *args[4:])
