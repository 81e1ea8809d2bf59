"""A short soak: 4 concurrent callers with random prompts and sampling
settings while weights are pushed every half second through every in-flight
mode. (Memory flatness is measured over a longer run by scripts/soak.py.)"""

from __future__ import annotations

import pytest

from rollout import INFLIGHT_MODES, RolloutCluster, RolloutOutput, Sample, SamplingParams
from scripts.soak_harness import SOAK_CLUSTER, check_output, growth, soak
from scripts.synthetic import qwen2_config, random_state

CFG = qwen2_config("test-tiny")  # the shape of the `qwen2` test checkpoint


def test_short_soak(ray_session, qwen2):
    cluster = RolloutCluster(qwen2.path, **SOAK_CLUSTER)
    try:
        report = soak(cluster, [random_state(CFG, s) for s in (1, 2, 3)], seconds=12, callers=4, push_every=0.5)
    finally:
        cluster.shutdown()
    assert report.errors == []
    assert report.final_exact
    assert report.calls >= 20 and report.samples > report.calls
    assert report.pushes >= 8 and set(report.pushes_by_mode) == set(INFLIGHT_MODES)


def test_output_checks_catch_malformed_samples():
    params = SamplingParams(n=2, max_tokens=4)
    good = Sample([5, 6, 7, 8], [-1.0, -2.0, -0.5, -0.1], [1, 1, 2, 2], "length")
    assert check_output(RolloutOutput([1], [good, good], index=0), params, vocab=96, max_version=2) == []
    bad = [
        Sample([5, 6], [-1.0], [1, 1], "stop"),  # lengths differ
        Sample([5, 6], [-1.0, float("nan")], [1, 1], "stop"),  # NaN logprob
        Sample([5, 6], [-1.0, -1.0], [2, 1], "stop"),  # versions go backwards
        Sample([5, 6], [-1.0, -1.0], [1, 3], "stop"),  # a version from the future
        Sample([5, 6], [-1.0, -1.0], [1, 1], "length"),  # "length" before max_tokens
        Sample([5, 600], [-1.0, -1.0], [1, 1], "stop"),  # outside the vocabulary
        Sample([5, 6], [-1.0, -1.0], [1, 1], "abort"),
    ]
    for sample in bad:
        assert check_output(RolloutOutput([1], [good, sample], index=0), params, 96, 2), sample
    assert check_output(RolloutOutput([1], [good], index=0), params, 96, 2)  # a sample missing


def test_memory_growth_measure():
    assert growth([100, 100, 100, 100, 110, 110, 110, 110]) == pytest.approx(0.1)
    assert growth([1, 2]) == 0.0
