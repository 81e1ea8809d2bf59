"""The projections' GEMM backends on the CPU: oneDNN's matmul (`onednn_linear`)
or torch's BLAS, chosen once per build (`pick_linear`); the copies of the
weights the GEMMs multiply by, oneDNN's blocked layout and/or bfloat16
(`PackedWeights`); and the row count up to which the compiled
`skinny_linear` takes a projection instead (`SKINNY_MAX_ROWS`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Steps of at most this many rows project with the compiled `skinny_linear`
# (`csrc/skinny_linear.cpp`, which takes no more): with one or two rows a
# projection is a pass over its weight, which that kernel streams faster than
# oneDNN; from three rows on oneDNN's blocking wins. Batch-1 latency and the
# last sequences of a batch run there.
SKINNY_MAX_ROWS = 2


# oneDNN builds and caches a primitive (JIT code and buffers: 0.6 MB at a
# few rows, 2 MB at 2000 on the CPU) for every shape it multiplies, keeping up
# to 1024 of them, and the rows of a step's GEMMs are its token count, which
# changes from step to step: an actor under mixed load grew by a GB of
# primitives (docs/benchmarks.md, the soak). So a GEMM runs as row chunks of
# GEMM_CHUNK and a tail padded to `gemm_rows`: each projection has at most
# 54 shapes, built once.
GEMM_CHUNK = 512


def gemm_rows(rows: int) -> int:
    """The rows a oneDNN GEMM of `rows` rows (at most `GEMM_CHUNK`) runs at:
    `rows` below 16, else `rows` rounded up to one of eight sizes per
    doubling (at most 1/8 more rows)."""
    if rows < 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def gemm_plan(rows: int) -> list[tuple[int, int]]:
    """The oneDNN calls of a GEMM of `rows` rows, in row order: (rows, padded
    rows) of each, `GEMM_CHUNK` rows at a time and the rest padded."""
    plan = [(GEMM_CHUNK, GEMM_CHUNK)] * (rows // GEMM_CHUNK)
    if rows % GEMM_CHUNK or not plan:
        plan.append((rows % GEMM_CHUNK, gemm_rows(rows % GEMM_CHUNK)))
    return plan


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` of `x` `[rows, in_features]` through oneDNN's matmul (the op
    torch's own compiler emits for CPU linears), in the calls of
    `gemm_plan(rows)`: padding rows are zeros, and their outputs are dropped."""
    outs, start = [], 0
    for rows, padded in gemm_plan(x.shape[0]):
        part = x[start : start + rows]
        start += rows
        if padded != rows:
            part = torch.cat([part, part.new_zeros(padded - rows, part.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(part, weight, bias, "none", [], "")
        outs.append(out if padded == rows else out[:rows])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def pick_linear(in_features: int) -> tuple[str, Callable]:
    """oneDNN's matmul when this torch has it and it computes a linear, else
    torch's BLAS (`F.linear`, MKL on x86).

    MKL takes its AVX2 code on AMD processors while oneDNN uses AVX-512
    there, so oneDNN is the faster of the two where both exist (see
    docs/benchmarks.md). The choice follows the build, not a timing, so every
    engine of a cluster computes the same logprobs; the check uses its own
    generator and leaves torch's global one alone.
    """
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, in_features, generator=g), torch.randn(64, in_features, generator=g)
    try:
        works = torch.allclose(onednn_linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    except (AttributeError, RuntimeError):  # a build without oneDNN
        works = False
    return ("onednn", onednn_linear) if works else ("blas", F.linear)


def onednn_bf16() -> bool:
    """Whether oneDNN's bfloat16 GEMMs run on this CPU (AVX-512 or AVX-NE-CONVERT;
    torch refuses them elsewhere, and torch's own bfloat16 GEMM takes over)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


class PackedWeights:
    """The copies of the projection weights the GEMMs multiply by, kept in step with the live ones.

    The weights named in `packed` are copied in oneDNN's blocked layout:
    oneDNN reorders a plain weight on every call, and a copy packed once
    spares every GEMM that reorder. Those named in `narrow` are copied in
    `narrow_dtype` (bfloat16 copies of float32 weights, see `Model`'s
    `matmul_dtype`), blocked too when also in `packed`. A commit marks the
    copies of the weights it replaced stale (`changed`: no memory is freed
    under the guard); the forward uses those live weights (converted at each
    use when narrow) and repacks at most `per_step` of them per step (enough
    to catch up within 32 steps), so a push adds no packing to its own
    latency or to the commit's pause. Packed and plain weights agree to
    float32 accumulation order, not bit for bit. Commits and steps both run
    under the engine's guard, so a copy is never read while its weight
    changes. Costs one more copy of the weights, of which the LM head, with a
    large vocabulary, is the biggest.
    """

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        packed: frozenset[str] | None = None,
        narrow: frozenset[str] = frozenset(),
        narrow_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self._params = params  # name -> live parameter; commits rebind its data
        self._packed: dict[str, torch.Tensor] = {}  # name -> the GEMMs' copy of the parameter's data
        self._stale: set[str] = set(params)  # copies that do not match their parameter (or are missing)
        self._pack = frozenset(params) if packed is None else packed
        self._narrow, self._narrow_dtype = narrow, narrow_dtype
        self.per_step = max(1, -(-len(params) // 32))

    def changed(self, names=None) -> None:
        """The weights `names` (all when None) have new values: their copies are stale."""
        self._stale.update(self._params if names is None else (n for n in names if n in self._params))

    def release(self) -> None:
        """Free every copy (the weights are being freed); later steps repack."""
        self._packed.clear()
        self._stale.update(self._params)

    def start_step(self) -> None:
        """Repack up to `per_step` stale copies, in parameter order, whichever GEMMs the step runs."""
        if self._stale:
            for name in [n for n in self._params if n in self._stale][: self.per_step]:
                self._repack(name)

    def weight(self, name: str) -> torch.Tensor:
        """The copy of `name` when current, else the live weight (converted when narrow)."""
        if name not in self._stale:
            return self._packed[name]
        return self._plain(name)

    def _plain(self, name: str) -> torch.Tensor:
        weight = self._params[name].detach()
        return weight.to(self._narrow_dtype) if name in self._narrow else weight

    def _repack(self, name: str) -> None:
        weight = self._plain(name)
        self._packed[name] = torch.ops.mkldnn._reorder_linear_weight(weight, None) if name in self._pack else weight
        self._stale.discard(name)

    @property
    def names(self):
        """The names of the weights copied here."""
        return self._params.keys()

    @property
    def num_current(self) -> int:
        return len(self._params) - len(self._stale)
