"""scripts/bench_real.py's parts that make its figures: the GEMM shapes its
floor times (they must be every multiply a token makes, no more), and the
per-op profile's accounting (figures never asserted)."""

from __future__ import annotations

import pytest

from rollout import SamplingParams
from scripts import bench_real
from scripts.bench import dense_params
from scripts.presets import preset
from tests.conftest import make_engine


@pytest.mark.parametrize("name", ["smollm2-135m", "bench-25m", "qwen2.5-0.5b"])
def test_projection_shapes_are_every_weight_a_token_multiplies(name):
    config = preset(name)
    shapes = bench_real.projection_shapes(config)
    assert sum(o * i * c for o, i, c in shapes.values()) == dense_params(config)


def test_smollm2_shapes_as_the_issue_states_them():
    shapes = bench_real.projection_shapes(preset("smollm2-135m"))
    assert shapes["qkv"] == (576 + 2 * 3 * 64, 576, 30) and shapes["lm_head"] == (49152, 576, 1)
    # 134.5M weights each token multiplies (2 FLOPs each), plus attention: 30 layers x 4 x context x 9 heads x 64.
    per_layer = 576 * 960 + 576 * 576 + 3 * 576 * 1536  # qkv, o, gate/up/down
    assert dense_params(preset("smollm2-135m")) == 30 * per_layer + 49152 * 576 == 134_479_872
    assert bench_real.attention_flops(preset("smollm2-135m"), 100) == 30 * 4 * 100 * 576


def test_gemm_floor_times_each_shape_and_sums_them():
    config = preset("test-tiny")
    floor = bench_real.gemm_floor(config, rows=8, seconds=0.01)
    shapes = bench_real.projection_shapes(config)
    assert floor["shapes"].keys() == shapes.keys()
    assert floor["step_seconds"] == pytest.approx(
        sum(c * floor["shapes"][k]["seconds"] for k, (_, _, c) in shapes.items())
    )
    flops = sum(2 * 8 * o * i * c for o, i, c in shapes.values())
    assert floor["flops_per_s"] == pytest.approx(flops / floor["step_seconds"])


def test_profile_splits_a_generate_by_op(qwen2, capsys):
    engine = make_engine(qwen2.path)
    params = SamplingParams(n=4, max_tokens=12, ignore_eos=True, seed=0)
    prof = bench_real.profile(engine, [list(range(3, 30))] * 3, params, preset("test-tiny"))
    ops = prof["ops"]
    assert engine.model._one_op == (engine.config.kernels == "compiled")  # restored
    assert sum(row["seconds"] for row in ops.values()) >= prof["wall_seconds"] - 1e-9  # ops plus the time outside
    if engine.config.kernels == "compiled":
        assert {"GEMM qkv", "GEMM gate_up", "GEMM lm_head", "attention (paged decode)", "sampler"} <= ops.keys()
        assert all(row["gflops"] > 0 for name, row in ops.items() if name.startswith("GEMM") and "gflops" in row)
    bench_real.print_profile("tiny", prof)
    assert "GEMM" in capsys.readouterr().out
    assert sum(r["share"] for r in ops.values()) == pytest.approx(1.0)
