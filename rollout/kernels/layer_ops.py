"""The kernels a decoder layer and the stepper call, one object per backend.

The model and the stepper take one of these (or None: plain torch ops) and
never ask which device they run on. Both backends expose the same names with
the same signatures, those of the compiled CPU ops (`csrc/`):

- `rms_norm(x, weight, eps, out)`, `add_rms_norm_(h, delta, weight, eps, out)`,
  `silu_mul(gate_up, out)`: a layer's elementwise steps, one launch each;
- `moe_block` (or None): a whole sparse layer in one op (`rollout.model.moe`);
- `norm_rope_and_cache_(q, k, v, q_norm, k_norm, eps, positions, cos, sin,
  k_cache, v_cache, slots) -> q`: the q/k RMSNorms (qwen3; None where the model
  has none), rotary on q and k, and the write of k and v to the pool at
  `slots`; returns the rotated queries;
- `paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, scale,
  window)`: decode attention read in place from the pool;
- `paged_prefill` (or None): prefill chunks attending to their cached pages in
  place, all chunks of a step in one launch;
- `sample_rows` (or None): the compiled CPU sampler; `device_sample` (or None):
  the device sampler, which marks the rows whose kept set its candidates may
  not cover (`rollout.engine.stepper` resamples those with the reference);
- `score_block` (or None): the compiled CPU scoring fold (`rollout.engine.scoring`).

`fuses(dtype, device)` says whether the elementwise ops apply to a model of
that dtype on that device; where they do not, the model keeps torch's ops
and only attention and sampling use the backend.
"""

from __future__ import annotations

import torch


class CompiledOps:
    """The compiled CPU kernels (`torch.ops.rollout`, built by `build.py`).

    The elementwise ops are float32 only; half-precision models keep torch's,
    whose rounding steps the reference shares.
    """

    name = "compiled"
    paged_prefill = None  # prefill chunks gather their pages and run SDPA (`rollout.model.attention`)
    device_sample = None
    tables_in_place = False  # decode graphs (CUDA only) never run these

    def __init__(self, lib) -> None:
        self.lib = lib  # also the GEMMs (`skinny_linear`) and the one-op decode (`decode_layers`)
        self.rms_norm = lib.rms_norm
        self.add_rms_norm_ = lib.add_rms_norm_
        self.silu_mul = lib.silu_mul
        self.moe_block = lib.moe_block  # a whole sparse layer, float32 (`rollout.model.moe`)
        self.paged_decode = lib.paged_decode
        self.sample_rows = lib.sample_rows
        self.score_block = lib.score_block

    @staticmethod
    def fuses(dtype: torch.dtype, device: torch.device) -> bool:
        return dtype == torch.float32 and torch.device(device).type == "cpu"

    def norm_rope_and_cache_(self, q, k, v, q_norm, k_norm, eps, positions, cos, sin, k_cache, v_cache, slots):
        if q_norm is not None:  # qwen3's norms, in place on the views of the qkv projection (one op each)
            self.lib.head_rms_norm_(q, q_norm, eps)
            self.lib.head_rms_norm_(k, k_norm, eps)
        self.lib.rope_and_cache_(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
        return q


class TritonOps:
    """The Triton kernels of `triton/`, for every dtype, on CUDA (or on the CPU
    under Triton's interpreter, for tests). Decode attention reads block
    tables of any width, so decode graphs need not be keyed by it."""

    name = "triton"
    lib = None
    moe_block = None  # sparse layers loop over experts with torch's GEMMs
    sample_rows = None
    score_block = None
    tables_in_place = True

    def __init__(self) -> None:
        from .triton import fused, paged_decode, paged_prefill, sampling

        self.rms_norm = fused.rms_norm
        self.add_rms_norm_ = fused.add_rms_norm_
        self.silu_mul = fused.silu_mul
        self.paged_decode = paged_decode.paged_decode
        self.paged_prefill = paged_prefill.paged_prefill
        self.device_sample = sampling.sample
        self._norm_rope_and_cache_ = fused.norm_rope_and_cache_

    @staticmethod
    def fuses(dtype: torch.dtype, device: torch.device) -> bool:
        return True

    def norm_rope_and_cache_(self, q, k, v, q_norm, k_norm, eps, positions, cos, sin, k_cache, v_cache, slots):
        self._norm_rope_and_cache_(q, k, v, q_norm, k_norm, eps, positions, cos, sin, k_cache, v_cache, slots)
        return q


LayerOps = CompiledOps | TritonOps
