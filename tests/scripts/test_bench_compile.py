"""scripts/bench_compile.py: its fused layer loop (what Inductor compiles) is
the model's own computation, checked uncompiled against the engine's forward."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from rollout import SamplingParams
from tests.conftest import make_engine

ROOT = Path(__file__).resolve().parents[2]


def _load():
    sys.path.insert(0, str(ROOT / "scripts"))  # bench_compile imports bench
    try:
        spec = importlib.util.spec_from_file_location("bench_compile", ROOT / "scripts" / "bench_compile.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return module


def test_fused_forward_equals_the_models_forward(qwen2):
    bench_compile = _load()
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
    bench_compile = _load()
    engine = make_engine(qwen2.path, kernels="compiled")
    with pytest.raises(ValueError, match="kernels='torch'"):
        bench_compile.use_fused_forward(engine.model, compile=False)
