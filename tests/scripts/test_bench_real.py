"""scripts/bench_real.py's parts that make its figures: the GEMM shapes its
floor times (they must be every multiply a token makes, no more), the
per-op profile's accounting, and the logprob mismatch against transformers
(figures never asserted)."""

from __future__ import annotations

import pytest
import torch

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


def test_the_bf16_floor_times_the_layer_projections_in_bfloat16(monkeypatch):
    timed = []

    def seconds_per_call(fn, seconds):
        fn()
        return 1.0

    real_backends = bench_real._backends
    monkeypatch.setattr(bench_real, "_seconds_per_call", seconds_per_call)
    monkeypatch.setattr(bench_real, "_backends", lambda w: timed.append(w.dtype) or real_backends(w))
    floor = bench_real.bf16_floor(preset("test-tiny"), rows=4)
    shapes = bench_real.projection_shapes(preset("test-tiny"))
    assert floor["shapes"].keys() == shapes.keys()
    assert timed == [torch.bfloat16] * 4 + [torch.float32]  # qkv, o_proj, gate_up, down; the LM head


def test_the_bf16_floor_summary_by_hand():
    floors = [{"flops_per_s": 300.0, "r": 1}, {"flops_per_s": 100.0, "r": 2}, {"flops_per_s": 200.0, "r": 3}]
    side = {"runs_tokens_per_s": [9.0, 5.0, 16.0]}  # against 30, 10 and 20 tokens/s: 0.3, 0.5, 0.8
    summary = bench_real.summarize_bf16_floor(floors, 10.0, side)
    assert summary == {"flops_per_s": 200.0, "r": 3, "tokens_per_s": 20.0}
    assert side["fraction_of_bf16_floor"] == 0.5


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


def test_steps_gemm_seconds_interpolates_between_powers_of_two(monkeypatch):
    """Each shape's time at a step's rows, linear between the powers of two around
    them; the LM head at the sampled rows; a stub timing makes it hand-checkable."""
    config = preset("test-tiny")
    calls = []

    def fake_floor(config, rows, seconds, names):
        calls.append((rows, frozenset(names)))
        return {"shapes": {name: {"seconds": rows * (2.0 if name == "lm_head" else 1.0)} for name in names}}

    monkeypatch.setattr(bench_real, "gemm_floor", fake_floor)
    layers = config["num_hidden_layers"]
    # 8 tokens, 8 sampled: exact; 3 tokens, 2 sampled: 3 is between 2 and 4 (time 3), LM head exact.
    total, rate = bench_real.steps_gemm_seconds(config, [(8, 8), (3, 2)], full_rows=8)
    assert total == pytest.approx(4 * layers * 8 + 2 * 8 + 4 * layers * 3 + 2 * 2)
    assert {rows for rows, _ in calls} == {2, 4, 8}
    flops = sum(2 * 8 * o * i * c for o, i, c in bench_real.projection_shapes(config).values())
    assert rate == pytest.approx(flops / (4 * layers * 8 + 2 * 8))  # the full batch from the same timings
    # A prefill chunk that samples nothing multiplies no LM head row.
    calls.clear()
    assert bench_real.steps_gemm_seconds(config, [(16, 0)]) == (pytest.approx(4 * layers * 16), None)
    assert calls == [(16, frozenset({"qkv", "o_proj", "gate_up", "down"}))]


def test_own_steps_floor_reads_the_steps_of_its_run(qwen2):
    engine = make_engine(qwen2.path)
    prompts, params = [list(range(3, 30))] * 2, SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=0)
    engine.generate(prompts, params)  # steps before the run are not counted

    def run():
        tokens, seconds, context = bench_real.time_engine(engine, prompts, params)
        return tokens, seconds, context

    own = bench_real.own_steps_floor(engine, run, preset("test-tiny"), full_rows=4)
    assert own["steps"] == 6  # one prefill step that samples, then 5 decode steps
    assert own["gemm_seconds"] > 0 and own["tokens_per_s"] > 0 and own["full_batch_tokens_per_s"] > 0
    assert own["engine_fraction"] == pytest.approx(own["engine_tokens_per_s"] / own["tokens_per_s"])


def test_logprob_mismatch_measures_the_engine_against_transformers(qwen2):
    """The float32 engine agrees with transformers to float32 noise; a bfloat16 KV pool does
    not, and the mismatch says by how much; a hand-perturbed reference shows as a wide gap."""
    import copy

    params = SamplingParams(n=2, max_tokens=12, seed=3, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    exact = bench_real.logprob_mismatch(make_engine(qwen2.path), qwen2.hf, prompts, params, samples=3)
    assert exact["tokens"] == 3 * 12 and exact["max_abs"] < 1e-4
    bf16 = bench_real.logprob_mismatch(
        make_engine(qwen2.path, kv_cache_dtype="bfloat16"), qwen2.hf, prompts, params, samples=3
    )
    assert bf16["max_abs"] > 10 * exact["max_abs"] and bf16["mean_abs"] <= bf16["max_abs"]
    shifted = copy.deepcopy(qwen2.hf)
    with torch.no_grad():
        shifted.lm_head.weight.mul_(2.0)  # doubles every logit: a different distribution
    far = bench_real.logprob_mismatch(make_engine(qwen2.path), shifted, prompts, params, samples=3)
    assert far["mean_abs"] > 1e-2
