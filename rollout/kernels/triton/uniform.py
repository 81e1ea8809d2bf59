"""The engine's per-row uniforms on the device: `rollout.engine.sampler.counter_uniform`
(a pure function of seed, stream and counter) bit for bit, as a Triton
function the sampler inlines and as one kernel over a batch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch


@triton.jit
def _mix32(x):
    # PCG-RXS-M-XS on uint32, wrapping as the reference's int64 arithmetic masked to 32 bits.
    state = x * 747796405 + 2891336453
    word = ((state >> ((state >> 28) + 4)) ^ state) * 277803737
    return (word >> 22) ^ word


@triton.jit
def uniform(seed, stream, counter):
    """float32 uniform in [0, 1) of int64 `seed`, `stream`, `counter` (elementwise)."""
    h = _mix32(counter.to(tl.uint32))
    h = _mix32(h ^ stream.to(tl.uint32))
    h = _mix32(h ^ seed.to(tl.uint32))
    h = _mix32(h ^ (seed >> 32).to(tl.uint32))
    return (h >> 8).to(tl.float32) * (1.0 / 16777216)


@triton.jit
def _counter_uniform(seed_ptr, stream_ptr, counter_ptr, out_ptr, rows, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < rows
    seed = tl.load(seed_ptr + offs, mask=mask, other=0)
    stream = tl.load(stream_ptr + offs, mask=mask, other=0)
    counter = tl.load(counter_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, uniform(seed, stream, counter), mask=mask)


def counter_uniform(seed: torch.Tensor, stream: torch.Tensor, counter: torch.Tensor, out: torch.Tensor) -> None:
    """float32 uniforms in [0, 1) into `out` `[R]` from int64 `seed`, `stream`,
    `counter` `[R]`: bit for bit `rollout.engine.sampler.counter_uniform`."""
    rows = out.shape[0]
    block = 256
    launch(_counter_uniform, (triton.cdiv(rows, block),), seed, stream, counter, out, rows, BLOCK=block)
