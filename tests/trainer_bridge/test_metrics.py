from __future__ import annotations

from tests.conftest import make_engine
from trainer_bridge import TrainerBridge
from trainer_bridge.metrics import Metrics, wandb_mode


def test_mode_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def test_offline_run_is_written_and_bridge_logs_into_it(monkeypatch, tmp_path, qwen2):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    metrics = Metrics(project="rollout-test", run_name="unit", dir=tmp_path / "logs")
    bridge = TrainerBridge(make_engine(qwen2.path), metrics=metrics)
    from rollout import SamplingParams

    bridge.generate([[3, 4, 5]], SamplingParams(n=2, max_tokens=5, seed=0))
    bridge.push(qwen2.hf)
    metrics.log({"train/loss": 1.5}, step=3)
    metrics.finish()
    runs = list((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    keys = set().union(*metrics.history)
    assert {"rollout/tokens_per_s", "rollout/staleness_max", "push/seconds", "train/loss"} <= keys


def test_disabled_metrics_keep_history_only():
    m = Metrics(enabled=False)
    m.log({"a": 1})
    m.finish()
    assert m.run is None and m.history == [{"a": 1}]
