"""scripts/bench_host.py: it times the decode steps of the full batch and only
those, and host time is a step's time less the model's."""

from __future__ import annotations

import pytest

from scripts import bench_host


def test_run_records_every_full_batch_decode_step(qwen2):
    batch, tokens, rounds = 3, 5, 2
    got = bench_host.run(qwen2.path, rounds, batch, tokens, max_seq_len=64, kv_cache_tokens=1024, max_batch_size=4)
    # One prefill step samples each prompt's first token; each of the other `tokens - 1` is a decode step.
    assert len(got["steps"]) == rounds * (tokens - 1)
    assert set(got["timed"]) == {part for part, _, _ in bench_host.PARTS}
    for step in got["steps"]:
        assert 0 < step["model"] <= step["stepper"] <= step["guarded"] <= step["interval"]
        assert step["metadata"] <= step["prepare"]


def test_summarise_subtracts_the_model_per_step():
    steps = [
        dict(interval=0.010, interval_cpu=0.008, guarded=0.009, model=0.006, model_cpu=0.005),
        dict(interval=0.020, interval_cpu=0.012, guarded=0.015, model=0.012, model_cpu=0.010),
        dict(interval=0.004, interval_cpu=0.004, guarded=0.004, model=0.003, model_cpu=0.003),
    ]
    table = bench_host.summarise(steps)
    assert table["host"]["median_ms"] == pytest.approx(4.0)  # hosts 4, 8 and 1 ms
    assert table["host"]["mean_ms"] == pytest.approx(13 / 3)
    assert table["host_cpu"]["median_ms"] == pytest.approx(2.0)  # 3, 2 and 1 ms
    assert table["host_guarded"]["median_ms"] == pytest.approx(3.0)  # 3, 3 and 1 ms


def test_a_part_the_engine_lacks_is_left_out():
    class Stepper:
        def _run(self, x):
            return x + 1

    class Engine:
        stepper = Stepper()
        scheduler = object()  # none of its methods

    timer = bench_host.PartTimer(Engine())
    assert timer.found == {"model": "stepper._run"}
    assert Engine.stepper._run(1) == 2
    assert set(timer.take()) == {"model", "model_cpu"}
    assert timer.take() == {}
