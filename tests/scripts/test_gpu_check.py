"""scripts/gpu_check.py in its CPU smoke mode: every check runs end to end on
tiny models and reports sane values (the GPU figures come from a GPU run)."""

from __future__ import annotations

import json

from scripts import gpu_check


def test_decode_floor_by_hand():
    # SMOKE: hidden 64, intermediate 128, 2 layers, vocab 256, 4 heads of 16, 2 KV heads, tied.
    # Dense params: 2 * (64*(64+2*32) + 64*64 + 3*64*128) + 256*64 = 90112 -> 180224 bf16 bytes.
    # KV read: 2 rows * 10 tokens * 2 layers * (K and V) * 32 * 2 bytes = 5120 bytes.
    # FLOPs: 2 rows * (2 * 90112 + 2 layers * 4 * 10 * 64) = 370688.
    floor = gpu_check.decode_floor(gpu_check.SMOKE, batch=2, context=10, bandwidth=1e9, flops_rate=1e9)
    assert floor["memory_s"] == (180224 + 5120) / 1e9
    assert floor["compute_s"] == 370688 / 1e9
    assert floor["floor_s"] == floor["compute_s"]


def test_gpu_check_smoke_runs_every_check(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    results = gpu_check.main(["--smoke", "--out", str(out)])
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
    for batch in (16, 32):
        row = results["qwen2.5_0.5b"][f"batch_{batch}"]
        assert row["decode_step_s"] > 0 and row["floor_s"] > 0 and row["speedup"] > 0
        assert row["graphs_off_decode_step_s"] > 0 and row["graphs_off_tokens_per_s"] > 0
    assert "qwen2.5-0.5b bf16 batch_32" in capsys.readouterr().out


def test_a_failing_section_is_recorded_and_the_others_run(tmp_path, capsys, monkeypatch):

    def broken(*args, **kwargs):
        raise RuntimeError("capture exploded")

    monkeypatch.setattr(gpu_check, "bench_25m", broken)
    out = tmp_path / "gpu_check.json"
    results = gpu_check.main(["--smoke", "--out", str(out)])
    assert "RuntimeError: capture exploded" in results["bench_25m"]["error"]
    assert results["parity"]["graph_replays"] > 0  # the section before it
    assert results["qwen2.5_0.5b"]["batch_32"]["speedup"] > 0  # and the one after it
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    printed = capsys.readouterr().out
    assert "bench_25m FAILED: RuntimeError: capture exploded" in printed
    assert "qwen2.5-0.5b bf16 batch_32" in printed
