"""scripts/gpu_check.py in its CPU smoke mode: every check runs end to end on
tiny models and reports sane values (the GPU figures come from a GPU run)."""

from __future__ import annotations

import contextlib
import copy
import io
import json

import pytest

from scripts import gpu_check, gpu_kernels, gpu_overlap


def test_decode_floor_by_hand():
    # SMOKE: hidden 64, intermediate 128, 2 layers, vocab 256, 4 heads of 16, 2 KV heads, tied.
    # Dense params: 2 * (64*(64+2*32) + 64*64 + 3*64*128) + 256*64 = 90112 -> 180224 bf16 bytes.
    # KV read: 2 rows * 10 tokens * 2 layers * (K and V) * 32 * 2 bytes = 5120 bytes.
    # FLOPs: 2 rows * (2 * 90112 + 2 layers * 4 * 10 * 64) = 370688.
    floor = gpu_check.decode_floor(gpu_check.SMOKE, batch=2, context=10, bandwidth=1e9, flops_rate=1e9)
    assert floor["memory_s"] == (180224 + 5120) / 1e9
    assert floor["compute_s"] == 370688 / 1e9
    assert floor["floor_s"] == floor["compute_s"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run of every section: its results, its JSON file and what it printed."""
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results = gpu_check.main(["--smoke", "--out", str(out)])
    return results, out, printed.getvalue()


def test_gpu_check_smoke_runs_every_check(smoke):
    results, out, printed = smoke
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    parity = results["parity"]
    assert parity["bf16_max_abs_dlogprob"] < 0.05  # bf16 against transformers in bf16
    done, total = parity["graph_vs_plain_identical_samples"].split("/")  # padded steps vs plain ones, on the CPU
    assert done == total and int(total) == 24 and parity["graph_replays"] > 0
    kv = results["kv_bf16"]  # a float32 model against transformers float32
    assert kv["float32_pool_max_abs_dlogprob"] < 1e-4
    assert kv["float32_pool_mean_abs_dlogprob"] < kv["bfloat16_pool_mean_abs_dlogprob"] < 0.05
    assert kv["float32_pool_mean_abs_dlogprob"] < kv["bfloat16_matmul_mean_abs_dlogprob"] < 0.05
    assert results["bench_25m"]["engine_tokens_per_s"] > 0 and results["bench_25m"]["transformers_tokens_per_s"] > 0
    overlap = results["overlap"]  # async_scheduling on and off, the same work
    assert overlap["nano_vllm"]["async"]["output_tokens"] == overlap["nano_vllm"]["sync"]["output_tokens"]
    assert overlap["decode_batch_8"]["async"]["tokens_per_s"] > 0 and overlap["grpo"]["speedup"] > 0
    assert overlap["decode_batch_8"]["identical_samples"] == "8/8"  # seeded alike, on the CPU exactly
    for batch in (16, 32):
        row = results["qwen2.5_0.5b"][f"batch_{batch}"]
        assert row["decode_step_s"] > 0 and row["floor_s"] > 0 and row["speedup"] > 0
        assert row["graphs_off_decode_step_s"] > 0 and row["graphs_off_tokens_per_s"] > 0
    assert "qwen2.5-0.5b bf16 batch_32" in printed
    sleep = results["sleep_wake"]  # the same weights and seeds after each wake: the same samples
    assert sleep["level1_same_samples"] and sleep["level2_same_samples"]
    assert sleep["push_after_level2_s"] > 0 and sleep["kv_bytes"] > 0
    # The kernels' sections, the Triton kernels under the interpreter.
    assert results["ceilings"]["copy_bandwidth_gb_s"] > 0
    for context in (16, 40):
        row = results["attention"][f"context_{context}"]
        assert row["triton_gb_s"] > 0 and row["torch_gb_s"] > 0 and row["triton_over_copy_bandwidth"] > 0
    steps = results["decode_steps"]
    for batch in (8, 16):
        # Two layers: the Triton path's launches (9 a layer and the step's own) against torch's many more.
        assert steps[f"triton_batch_{batch}"]["launches_per_step"] <= 12 * 2 + 8
        assert (
            steps[f"torch_batch_{batch}"]["launches_per_step"] > 2 * steps[f"triton_batch_{batch}"]["launches_per_step"]
        )
        assert steps[f"triton_batch_{batch}"]["step_s"] > 0 and steps[f"triton_batch_{batch}"]["floor_s"] > 0
    moe = results["moe"]  # a float32 Qwen3-MoE on the CPU: the expert loop, against transformers float32
    assert moe["grouped_mm"] is False and moe["max_abs_dlogprob"] < 1e-4
    assert moe["grouped_tokens_per_s"] > 0 and moe["loop_tokens_per_s"] > 0 and moe["speedup"] > 0
    _, lengths = gpu_kernels.nano_vllm_workload(3, 12, 12)
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3-8b"):
        assert results[f"nano_vllm_{name}"]["triton"]["output_tokens"] == sum(lengths)
    assert results["nano_vllm_qwen2.5-0.5b"]["torch"]["tokens_per_s"] > 0


def test_nano_vllm_workload_is_the_published_one():
    """nano-vllm's bench.py: seed 0, prompts of 100..1024 ids up to 10000, 100..1024 output tokens."""
    prompts, lengths = gpu_kernels.nano_vllm_workload(256, 1024, 1024)
    assert len(prompts) == len(lengths) == 256
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in lengths)
    assert max(max(p) for p in prompts) <= 10000 and min(min(p) for p in prompts) >= 0
    assert prompts[0][:3] == _reference_first_ids(3) and 130_000 < sum(lengths) < 150_000


def _reference_first_ids(count: int) -> list[int]:
    import random

    rng = random.Random(0)
    rng.randint(100, 1024)  # the first prompt's length is drawn first
    return [rng.randint(0, 10000) for _ in range(count)]


def test_a_failing_section_is_recorded_and_the_others_run(smoke, tmp_path, capsys, monkeypatch):
    """The run's bookkeeping: every section but the failing one replays what it returned in the
    smoke run above (measured there), and each is called once, in order, after the failure too."""
    measured, _, _ = smoke
    called = []

    def replay(name):
        def section(*args, **kwargs):
            called.append(name)
            return copy.deepcopy(measured[name])

        return section

    def broken(*args, **kwargs):
        called.append("bench_25m")
        raise RuntimeError("capture exploded")

    replays = {"parity": "parity", "kv_bf16": "kv_bf16", "qwen_05b": "qwen2.5_0.5b"}
    for name, replayed in {**replays, "sleep_wake": "sleep_wake", "moe": "moe"}.items():
        monkeypatch.setattr(gpu_check, name, replay(replayed))
    monkeypatch.setattr(gpu_check, "bench_25m", broken)
    monkeypatch.setattr(gpu_overlap, "overlap", replay("overlap"))
    monkeypatch.setattr(gpu_kernels, "attention_bandwidth", replay("attention"))
    monkeypatch.setattr(gpu_kernels, "decode_steps", replay("decode_steps"))
    nano = {name: replay(f"nano_vllm_{name}") for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3-8b")}
    monkeypatch.setattr(gpu_kernels, "nano_vllm_model", lambda root, device, config, name, **kw: nano[name]())
    out = tmp_path / "gpu_check.json"
    results = gpu_check.main(["--smoke", "--out", str(out)])
    sections = ["parity", "overlap", "kv_bf16", "bench_25m", "qwen2.5_0.5b", "sleep_wake", "attention", "decode_steps"]
    nano_runs = [f"nano_vllm_{name}" for name in nano]
    assert called == sections + nano_runs[:1] + ["moe"] + nano_runs[1:]
    assert "RuntimeError: capture exploded" in results["bench_25m"]["error"]
    assert results["parity"] == measured["parity"]  # the section before it
    assert results["qwen2.5_0.5b"] == measured["qwen2.5_0.5b"]  # and those after it
    assert results["nano_vllm_llama-3-8b"] == measured["nano_vllm_llama-3-8b"]
    assert results["ceilings"]["copy_bandwidth_gb_s"] > 0  # measured again, not replayed
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    printed = capsys.readouterr().out
    assert "bench_25m FAILED: RuntimeError: capture exploded" in printed
    assert "qwen2.5-0.5b bf16 batch_32" in printed
