"""A short run of the GRPO demo inside the suite (the full run is ./scripts/demo)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from examples.grpo_demo.task import make_task_model, prompts, rewards
from examples.grpo_demo.trainer import DemoConfig, run


def test_demo_smoke_run(ray_session, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        summary = run(DemoConfig(steps=6, actors=2, out=tmp_path / "demo"), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert set(summary) == {
        "reward_start",
        "reward_end",
        "steps",
        "weight_pushes",
        "max_staleness_seen",
        "mean_abs_logprob_mismatch",
        "seconds",
        "peak_rss_bytes",
        "actors_rss_bytes",
    }
    assert summary["steps"] == 6 and summary["weight_pushes"] == 6
    assert summary["max_staleness_seen"] <= 1  # generation one step ahead, bounded
    assert summary["mean_abs_logprob_mismatch"] < 1e-4
    assert json.loads((tmp_path / "demo" / "summary.json").read_text()) == summary
    assert (tmp_path / "demo" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "demo" / "wandb").glob("offline-run-*"))
    steps = json.loads((tmp_path / "demo" / "steps.json").read_text())
    assert [s["version"] for s in steps] == [1, 2, 3, 4, 5, 6]


def test_reward_is_the_fraction_of_successor_tokens():
    class Batch:
        group_index = torch.tensor([0, 1])
        response_ids = torch.tensor([[8, 8, 3, 8], [3, 3, 3, 3]])  # "5" is id 8, "0" is id 3
        response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])

    assert rewards(["4>", "9>"], Batch()).tolist() == pytest.approx([0.75, 0.75])


def test_task_checkpoint_and_tokenizer(tmp_path):
    model = make_task_model(tmp_path, seed=0)
    assert model.config.vocab_size == 16 and not model.config.tie_word_embeddings
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.encode("4>").ids == [1, 7, 13]  # <s>, "4" (3 specials + 4), ">" (3 specials + 10)
    assert all(len(p) == 2 and p[0].isdigit() and p[1] == ">" for p in prompts(random.Random(0), 20))


def test_config_is_validated():
    with pytest.raises(ValueError, match="steps"):
        DemoConfig(steps=0)


def test_tool_demo_smoke_run(ray_session, tmp_path, monkeypatch):
    """The multi-turn task through the cluster: episodes batched one row each, pushes, exact logprobs."""
    monkeypatch.setenv("HOME", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        summary = run(DemoConfig(steps=4, actors=2, out=tmp_path / "tool", wandb=False, task="tool"), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] == 4 and summary["max_staleness_seen"] <= 1
    assert summary["mean_abs_logprob_mismatch"] < 1e-4 and 0.0 <= summary["ask_rate_end"] <= 1.0
    steps = json.loads((tmp_path / "tool" / "steps.json").read_text())
    assert [s["version"] for s in steps] == [1, 2, 3, 4]


def test_tool_environment_answers_only_an_ask():
    from examples.grpo_demo.tool import AskEnv, token_id

    class Turn:
        def __init__(self, symbols):
            self.token_ids = [token_id(c) for c in symbols]

    env = AskEnv(secret=4)
    assert env.reset() == ">"
    assert env.step(Turn("?")) == ([token_id("4"), token_id("=")], 0.0, False)
    assert env.step(Turn("5505")) == (None, 0.75, True)  # three of four tokens are the successor
    assert AskEnv(secret=9).step(Turn("0")) == (None, 0.0, True)  # no ask: the episode ends unrewarded
    with pytest.raises(ValueError, match="task"):
        DemoConfig(task="chess")
    with pytest.raises(ValueError, match="distill_top_k"):
        DemoConfig(task="rule", distill_top_k=3)
    with pytest.raises(ValueError, match="distill_top_k"):
        DemoConfig(task="distill", distill_top_k=21)
    assert DemoConfig(task="distill", distill_top_k=5).distill_top_k == 5


def test_demo_with_over_sampling_and_tis(ray_session, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        cfg = DemoConfig(steps=4, actors=2, out=tmp_path / "os", wandb=False, oversample=0.5, tis=True)
        summary = run(cfg, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] == 4 and summary["mean_abs_logprob_mismatch"] < 1e-4
    with pytest.raises(ValueError, match="oversample"):
        DemoConfig(oversample=-1)


@pytest.mark.parametrize("lora", [False, True])
def test_colocated_demo_sleeps_the_engine_during_each_step(tmp_path, lora):
    """One process, no actors: rollouts on-policy (staleness 0), the engine asleep while the
    trainer steps, exact logprobs; with `lora` the pushes carry the adapters only. HOME stays:
    the in-process engine finds its compiled kernels under it."""
    threads = torch.get_num_threads()
    cfg = DemoConfig(steps=3, out=tmp_path / "colocate", wandb=False, colocate=True, lora=lora)
    try:
        summary = run(cfg, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] == 3 and summary["max_staleness_seen"] == 0 and summary["peak_rss_bytes"] > 0
    assert summary["mean_abs_logprob_mismatch"] < 1e-4
    steps = json.loads((tmp_path / "colocate" / "steps.json").read_text())
    assert [s["version"] for s in steps] == [1, 2, 3]
    if lora:  # adapters only: a small fraction of the model's bytes
        full = sum(p.numel() * 4 for n, p in make_task_model(tmp_path / "m", seed=0).named_parameters())
        assert all(s["push_bytes"] < full / 2 for s in steps)
    with pytest.raises(ValueError, match="colocate runs the rule task"):
        DemoConfig(colocate=True, task="tool")


def test_moe_demo_config_is_checked():
    with pytest.raises(ValueError, match="model must be 'dense' or 'moe'"):
        DemoConfig(model="sparse")
    with pytest.raises(ValueError, match="model 'moe' runs the 'rule' task"):
        DemoConfig(model="moe", task="tool")
    with pytest.raises(ValueError, match="model 'moe' trains every weight"):
        DemoConfig(model="moe", lora=True)
