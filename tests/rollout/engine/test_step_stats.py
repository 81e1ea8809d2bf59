"""Step statistics: the step log is ordered by when steps ended, bounded, and
holds a step before its callback runs."""

from __future__ import annotations

from rollout import SamplingParams, StepInfo
from rollout.engine.step_stats import StepLog
from tests.conftest import make_engine


def info(end_time: float) -> StepInfo:
    return StepInfo(end_time, 0.01, 0, 4, 4, 4, 0, 1)


def test_log_is_ordered_by_end_time_and_bounded():
    log = StepLog(size=3)
    for end in (1.0, 3.0, 2.0, 4.0):  # two threads may log one after the other's later step
        log.record(info(end))
    assert [i.end_time for i in log.since()] == [2.0, 3.0, 4.0]
    assert [i.end_time for i in log.since(2.5)] == [3.0, 4.0]


def test_each_step_is_logged_before_its_callback_runs(qwen2):
    seen = []
    engine = make_engine(qwen2.path, step_callback=lambda step: seen.append(step in engine.step_log()))
    engine.generate([[3, 4, 5], [6, 7]], SamplingParams(n=2, max_tokens=6, ignore_eos=True))
    log = engine.step_log()
    assert seen and all(seen) and len(log) == len(seen)
    assert all(step.num_tokens > 0 and step.seconds >= 0 for step in log)
    assert [step.end_time for step in log] == sorted(step.end_time for step in log)
