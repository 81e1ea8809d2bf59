"""scripts/bench_compile.py: its fused layer loop (what Inductor compiles) is
the model's own computation, checked uncompiled against the engine's forward."""

from __future__ import annotations

import pytest

from rollout import SamplingParams
from scripts import bench_compile
from tests.conftest import make_engine


def test_fused_forward_equals_the_models_forward(qwen2):
    plain = make_engine(qwen2.path, kernels="torch")
    fused = make_engine(qwen2.path, kernels="torch")
    bench_compile.use_fused_forward(fused.model, compile=False)
    prompts = [[5, 9, 2, 7], [1, 3, 3, 8, 20, 4]]
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    want, got = plain.generate(prompts, params), fused.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        for ws, gs in zip(w.samples, g.samples, strict=True):
            assert gs.token_ids == ws.token_ids
            assert gs.logprobs == ws.logprobs  # the same ops in the same order


def test_fused_forward_refuses_a_model_on_compiled_kernels(qwen2):
    engine = make_engine(qwen2.path, kernels="compiled")
    with pytest.raises(ValueError, match="kernels='torch'"):
        bench_compile.use_fused_forward(engine.model, compile=False)
