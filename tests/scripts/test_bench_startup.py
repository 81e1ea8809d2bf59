"""scripts/bench.py's start-up rows: one fresh-process start-up of a small
checkpoint reports its phases and resident memory (figures never asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import bench


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="the child reads /proc (Linux)")
def test_startup_run_reports_phases_and_resident_memory(qwen2, capsys):
    r = bench.startup_run(qwen2.path)
    for key in ("import_s", "engine_s", "generate_s"):
        assert r[key] > 0
    assert r["total_s"] >= r["import_s"] + r["engine_s"] and r["process_s"] >= r["total_s"]
    assert 0 < r["rss_bytes"] <= r["peak_rss_bytes"]
    assert r["kernels"] in ("compiled", "torch")
    # The test-tiny preset: 2 layers x (K and V) x 2 KV heads x head 16 x float32 = 512 bytes per KV token,
    # plus one scratch page of 16 tokens for padded decode rows.
    assert r["kv_pool_bytes"] == (r["kv_cache_tokens"] + 16) * 512
    bench.print_startup({"test-tiny": {**r, "runs": [r]}})
    assert "start-up test-tiny:" in capsys.readouterr().out
