"""The metric that catches a broken weight sync: pushing wrong weights on
purpose makes the rollout-vs-trainer mismatch jump past the alarm's
threshold (a warning once per run, or `WeightSyncError`), while a correct
sync stays at float rounding; the bridge logs mismatch, KL estimators and a
staleness histogram with every batch."""

from __future__ import annotations

import copy
import warnings

import pytest

from rollout import SamplingParams
from tests.conftest import make_engine
from tests.factories import _randomize
from trainer_bridge import MismatchAlarm, TrainerBridge, WeightSyncError
from trainer_bridge.metrics import Metrics

PROMPTS = [list(range(3, 12)), list(range(20, 26))]
PARAMS = SamplingParams(n=2, max_tokens=8, ignore_eos=True, seed=2)


def test_wrong_weights_trip_the_alarm_once_and_a_correct_sync_never(qwen2):
    engine = make_engine(qwen2.path)
    metrics = Metrics(enabled=False)
    bridge = TrainerBridge(engine, metrics=metrics)
    trainer = qwen2.hf
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any alarm here fails the test
        bridge.token_logprobs(trainer, bridge.generate(PROMPTS, PARAMS))
    logged = {k: v for row in metrics.history for k, v in row.items()}
    assert logged["mismatch/mean_abs"] < 1e-4 and abs(logged["kl/k3"]) < 1e-6
    assert logged["rollout/staleness_0"] == 1.0 and bridge.alarm.fired == 0

    wrong = copy.deepcopy(trainer)
    _randomize(wrong, seed=7)
    bridge.push(wrong)  # the engine now serves weights the trainer does not hold
    with pytest.warns(RuntimeWarning, match="not serving the trainer's weights"):
        bridge.token_logprobs(trainer, bridge.generate(PROMPTS, PARAMS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per run: the second bad batch counts but does not warn again
        bridge.token_logprobs(trainer, bridge.generate(PROMPTS, PARAMS))
    assert bridge.alarm.fired == 2
    mismatches = [row["mismatch/mean_abs"] for row in metrics.history if "mismatch/mean_abs" in row]
    assert mismatches[0] < 1e-4 < bridge.alarm.threshold < mismatches[1]

    strict = TrainerBridge(engine, alarm=MismatchAlarm(action="raise"))
    with pytest.raises(WeightSyncError, match="nats"):
        strict.token_logprobs(trainer, strict.generate(PROMPTS, PARAMS))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"threshold": 0}, "threshold"), ({"threshold": "x"}, "threshold"), ({"action": "log"}, "action")],
)
def test_bad_alarm_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MismatchAlarm(**kwargs)
