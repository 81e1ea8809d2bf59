"""Fused elementwise steps of a decoder layer, as Triton kernels.

The same ops and signatures as the CPU ones in `csrc/fused_ops.cpp`, so the
model calls either: RMSNorm (alone, or after the residual add), rotary
embedding with the KV write (optionally after Qwen3's per-head q/k norms),
and SiLU-times-up. Each call is one kernel launch, none for zero tokens, and
none reads a device value on the host, so all of them can be captured in a
CUDA graph.

Math runs in float32 and rounds to the tensors' dtype wherever the torch
path (`decoder.rms_norm`, `RotaryTable.apply`, `KVPool.write`, `F.silu`)
materialises a float16/bfloat16 tensor, so results agree with it bit for bit
except where an op is computed differently: the mean of squares sums in
another order, and `exp` (SiLU) and `rsqrt` are other implementations. The
rotary kernel is compiled without FMA contraction, which would skip the
rounding of each product that the torch path does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch

# Elements in one half-head tile of the rotary kernel ([heads, D / 2] in float32): 64 heads of D = 128.
HEAD_TILE = 4096


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 `x` rounded (to nearest even) to `dtype` and widened back: one torch op's output."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _normalize(x, w, width, eps, dtype: tl.constexpr):
    """`decoder.rms_norm` of the float32 row `x` (zeros past `width`) with float32 weight `w`:
    normalised in float32, rounded to `dtype`, then scaled (the caller rounds the product)."""
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    return w * _round(x * inv, dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, out_ptr, x_row, delta_row, out_row, width, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row per program: out = rms_norm(x), after x += delta (stored in x's dtype) with HAS_DELTA."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x_dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * delta_row + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + delta, x_dtype)
        tl.store(x_ptr + row * x_row + cols, x.to(x_dtype), mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _normalize(x, w, width, eps, x_dtype)
    tl.store(out_ptr + row * out_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_heads(x_ptr, norm_ptr, c1, c2, s1, s2, i, cols, mask, half, eps, NORM: tl.constexpr):
    """The heads whose rows start at `x_ptr` (`[BLOCK_H, 1]` pointers), at columns `i` (`[1, BLOCK]`, valid
    where `cols`), RMS-normalised row by row with weight `norm_ptr` under NORM, then rotated: returns the
    two halves x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], in float32. Every product and
    sum is rounded to the dtype of x, as the torch path does (`_round` inlined: the interpreter pays for
    each nested call)."""
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half + i, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half) + eps)[:, None]
        w1 = tl.load(norm_ptr + i, mask=cols, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + half + i, mask=cols, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    a1 = (x1 * c1).to(dtype).to(tl.float32)
    b1 = (x2 * s1).to(dtype).to(tl.float32)
    a2 = (x2 * c2).to(dtype).to(tl.float32)
    b2 = (x1 * s2).to(dtype).to(tl.float32)
    return (a1 - b1).to(dtype).to(tl.float32), (a2 + b2).to(dtype).to(tl.float32)


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_norm_ptr, k_norm_ptr,
    q_tok, q_head, k_tok, k_head, v_tok, v_head, num_q_heads, num_kv_heads, half, eps,
    Q_NORM: tl.constexpr, K_NORM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
):  # fmt: skip
    """Program t: rotates q[t] in place, BLOCK_HQ heads at a time as a [BLOCK_HQ, BLOCK] tile per half,
    then writes the rotated k[t] and v[t] to the caches at slots[t], BLOCK_HKV heads at a time (masked
    past the head count and past half = D / 2 <= BLOCK)."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)[None, :]
    cols = i < half
    table = tl.load(pos_ptr + t).to(tl.int64) * (2 * half) + i
    c1 = tl.load(cos_ptr + table, mask=cols, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + half, mask=cols, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=cols, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + half, mask=cols, other=0.0).to(tl.float32)
    q_dtype = q_ptr.dtype.element_ty
    for h0 in range(0, num_q_heads, BLOCK_HQ):
        h = h0 + tl.arange(0, BLOCK_HQ)[:, None]
        mask = (h < num_q_heads) & cols
        x = q_ptr + t * q_tok + h * q_head
        y1, y2 = _rope_heads(x, q_norm_ptr, c1, c2, s1, s2, i, cols, mask, half, eps, Q_NORM)
        tl.store(x + i, y1.to(q_dtype), mask=mask)
        tl.store(x + half + i, y2.to(q_dtype), mask=mask)
    cache_dtype = k_cache_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + t).to(tl.int64) * (num_kv_heads * 2 * half)
    for j0 in range(0, num_kv_heads, BLOCK_HKV):
        j = j0 + tl.arange(0, BLOCK_HKV)[:, None]
        mask = (j < num_kv_heads) & cols
        cache = slot + j * (2 * half) + i
        x = k_ptr + t * k_tok + j * k_head
        y1, y2 = _rope_heads(x, k_norm_ptr, c1, c2, s1, s2, i, cols, mask, half, eps, K_NORM)
        tl.store(k_cache_ptr + cache, y1.to(cache_dtype), mask=mask)
        tl.store(k_cache_ptr + cache + half, y2.to(cache_dtype), mask=mask)
        v = v_ptr + t * v_tok + j * v_head + i
        v1 = tl.load(v, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(v + half, mask=mask, other=0.0).to(tl.float32)
        tl.store(v_cache_ptr + cache, v1.to(cache_dtype), mask=mask)
        tl.store(v_cache_ptr + cache + half, v2.to(cache_dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, gate_up_row, out_row, width, BLOCK: tl.constexpr):
    """Program (t, b): out[t, cols] = silu(gate) * up for the BLOCK columns `cols` of block b."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    row = gate_up_ptr + t * gate_up_row
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + width + cols, mask=mask, other=0.0).to(tl.float32)
    # torch's silu: x / (1 + exp(-x)), with an IEEE division, rounded before the product
    act = _round(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), gate_up_ptr.dtype.element_ty)
    tl.store(out_ptr + t * out_row + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    """Warps for a program over `block` elements: 8 elements a thread, within 1 to 16 warps."""
    return max(1, min(16, block // 256))


def _check_rows(name: str, t: torch.Tensor, rows: int, width: int) -> None:
    if t.dim() != 2 or tuple(t.shape) != (rows, width) or t.stride(1) != 1:
        raise ValueError(f"{name} must be [{rows}, {width}] with contiguous rows, got {tuple(t.shape)}")


def _rms_norm_rows(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, out) -> None:
    """`add_rms_norm_`, or `rms_norm` of h when delta is None."""
    if h.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(h.shape)}")
    rows, width = h.shape
    for name, t in (("out", out), ("delta", delta)):
        if t is not None:
            _check_rows(name, t, rows, width)
    _check_rows("x", h, rows, width)
    if weight.shape != (width,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{width}], got {tuple(weight.shape)}")
    if rows == 0:
        return
    block = triton.next_power_of_2(width)
    d, d_row = (h, 0) if delta is None else (delta, delta.stride(0))
    args = (h, d, weight, out, h.stride(0), d_row, out.stride(0), width, eps)
    launch(_rms_norm_kernel, (rows,), *args, HAS_DELTA=delta is not None, BLOCK=block, num_warps=_warps(block))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out = weight * (x * rsqrt(mean(x^2) + eps)) row by row; x, out `[T, H]`, weight `[H]`."""
    _rms_norm_rows(x, None, weight, eps, out)


def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """h += delta (rounded to h's dtype), then out = rms_norm(h); h, delta, out `[T, H]`, weight `[H]`."""
    _rms_norm_rows(h, delta, weight, eps, out)


def rope_and_cache_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Rotates q in place and writes rotated k and plain v to the caches at `slots`.

    q `[T, Hq, D]`, k and v `[T, Hkv, D]` (any row and head strides, contiguous in D, one
    dtype with cos/sin); positions, slots `[T]` integers, in range (not checked: that would
    read them on the host); cos, sin `[max_positions, D]`; k_cache, v_cache contiguous
    `[pages, page_size, Hkv, D]` of any float dtype (values rounded to nearest even).
    D must be even. Raises ValueError on shapes, dtypes or layouts that do not fit.
    """
    norm_rope_and_cache_(q, k, v, None, None, 0.0, positions, cos, sin, k_cache, v_cache, slots)


def norm_rope_and_cache_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """`rope_and_cache_` after a per-head RMSNorm of q with weight q_norm `[D]` and of k with
    k_norm `[D]` (each skipped when None), as Qwen3 does; the normalised q is what q keeps."""
    _check_rope(q, k, v, q_norm, k_norm, positions, cos, sin, k_cache, v_cache, slots)
    tokens, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    if tokens == 0:
        return
    block = triton.next_power_of_2(dim // 2)
    block_hq, block_hkv = _head_block(num_q_heads, block), _head_block(num_kv_heads, block)
    args = (q, k, v, positions, cos, sin, k_cache, v_cache, slots)
    args += (q if q_norm is None else q_norm, k if k_norm is None else k_norm)
    args += (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    args += (num_q_heads, num_kv_heads, dim // 2, eps)
    meta = dict(Q_NORM=q_norm is not None, K_NORM=k_norm is not None, BLOCK=block)
    meta.update(BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, num_warps=_warps(max(block_hq, block_hkv) * block))
    launch(_rope_cache_kernel, (tokens,), *args, **meta, enable_fp_fusion=False)


def _head_block(heads: int, block: int) -> int:
    """Heads in one [heads, block] tile of the rotary kernel: all of them (rounded up to a power of two),
    up to `HEAD_TILE` elements; more heads take several tiles in turn."""
    return min(triton.next_power_of_2(heads), max(1, HEAD_TILE // block))


def _check_rope(q, k, v, q_norm, k_norm, positions, cos, sin, k_cache, v_cache, slots) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q must be [T, Hq, D], k and v [T, Hkv, D], got {q.shape}, {k.shape}, {v.shape}")
    tokens, _, dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != dim or dim % 2:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)} (D must be even)")
    if any(t.stride(2) != 1 for t in (q, k, v)):
        raise ValueError("q, k and v must be contiguous in D")
    if len({t.dtype for t in (q, k, v, cos, sin)}) != 1:
        raise ValueError("q, k, v, cos and sin must share a dtype")
    if cos.dim() != 2 or cos.shape[1] != dim or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [positions, {dim}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos and sin must be contiguous")
    cache = (k_cache.shape[0], k_cache.shape[1], k.shape[1], dim) if k_cache.dim() == 4 else None
    if tuple(k_cache.shape) != cache or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must be alike [pages, page_size, {k.shape[1]}, {dim}]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if positions.shape != (tokens,) or slots.shape != (tokens,):
        raise ValueError(f"positions and slots must be [{tokens}], got {tuple(positions.shape)}, {tuple(slots.shape)}")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (dim,) or not w.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous [{dim}], got {tuple(w.shape)}")


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """out = silu(gate) * up for gate_up = [gate | up]: gate_up `[T, 2I]`, out `[T, I]`."""
    rows, width = out.shape
    _check_rows("gate_up", gate_up, rows, 2 * width)
    _check_rows("out", out, rows, width)
    if rows == 0:
        return
    block = min(1024, triton.next_power_of_2(width))
    grid = (rows, triton.cdiv(width, block))
    args = (gate_up, out, gate_up.stride(0), out.stride(0), width)
    launch(_silu_mul_kernel, grid, *args, BLOCK=block, num_warps=_warps(block))
