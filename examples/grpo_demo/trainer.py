"""The GRPO demo: a tiny Llama model learns a rule from a programmatic
reward, trained with a plain PyTorch loop on the transformers model while an
embedded local Ray cluster of rollout actors generates one step ahead.

Task ("copying with a rule"): the prompt is a digit and ">", e.g. "4>"; the
answer is four tokens, and the reward is the fraction of them that equal the
digit's successor (mod 10), "5555" for "4>". A random model scores about
1/16; GRPO lifts it within a few dozen steps.

Needs the `demo` extra (transformers, matplotlib, tqdm).
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import rollout
from rollout import SamplingParams
from rollout.checks import check_int
from trainer_bridge.bridge import TrainerBridge
from trainer_bridge.grpo import clipped_policy_loss, group_advantages
from trainer_bridge.logprobs import logprob_mismatch, token_logprobs
from trainer_bridge.metrics import Metrics

SPECIALS = ["<pad>", "<s>", "</s>"]
SYMBOLS = [str(d) for d in range(10)] + [">", "+", "="]


@dataclass(slots=True)
class DemoConfig:
    steps: int = 80  # optimizer steps (one weight push each)
    actors: int = 2  # rollout actors in the embedded cluster
    out: Path = Path("runs/demo")
    wandb: bool = True
    prompts_per_step: int = 10
    n: int = 8  # samples per prompt (the GRPO group)
    lr: float = 3e-3
    clip: float = 0.2
    max_staleness: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "actors", "prompts_per_step", "n"):
            check_int(name, getattr(self, name), 1)
        self.out = Path(self.out)


def make_task_model(path: Path, seed: int):
    """Write a random tiny Llama checkpoint and its tokenizer to `path`; return the transformers model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    vocab = {t: i for i, t in enumerate(SPECIALS + SYMBOLS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    return model


def rewards(prompts: list[str], batch) -> torch.Tensor:
    """Fraction of each row's 4 answer tokens that are the successor of its prompt digit."""
    target = torch.tensor([(int(prompts[g][0]) + 1) % 10 + len(SPECIALS) for g in batch.group_index.tolist()])
    hits = (batch.response_ids == target[:, None]) & batch.response_mask.bool()
    return hits.float().sum(dim=1) / 4


def run(cfg: DemoConfig, progress: bool = True) -> dict:
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)  # the actors have the other cores
    model = make_task_model(cfg.out / "checkpoint", cfg.seed)
    metrics = Metrics(project="rollout-demo", config=_jsonable(cfg), dir=cfg.out, enabled=cfg.wandb)
    cluster = rollout.init(
        cfg.out / "checkpoint",
        num_actors=cfg.actors,
        num_cpus_per_actor=1,
        max_seq_len=32,
        kv_cache_tokens=4096,
        max_batch_size=256,
        timeout_s=300,
        ray_init_kwargs={"num_cpus": max(os.cpu_count() or 1, cfg.actors), "log_to_driver": False},
    )
    start = time.perf_counter()
    try:
        rows = _train(
            cfg, model, TrainerBridge(cluster, max_staleness=cfg.max_staleness, metrics=metrics), metrics, progress
        )
    finally:
        rollout.shutdown()
        metrics.finish()
    summary = _summary(rows, time.perf_counter() - start)
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2))
    (cfg.out / "steps.json").write_text(json.dumps(rows, indent=2))
    plot(rows, cfg.out / "reward.png")
    return summary


def _train(cfg: DemoConfig, model, bridge: TrainerBridge, metrics: Metrics, progress: bool) -> list[dict]:
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    params = SamplingParams(n=cfg.n, max_tokens=4, ignore_eos=True, temperature=1.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    snapshots = {0: copy.deepcopy(model).eval()}  # the policy behind each version, to measure mismatch
    pending = bridge.submit(_prompts(rng, cfg), params)
    rows = []
    bar = tqdm(range(cfg.steps), desc="GRPO", unit="step", disable=not progress)
    for step in bar:
        batch = bridge.collect(pending, timeout=300)
        prompts = pending.prompts
        pending = bridge.submit(_prompts(rng, cfg), params)  # the next batch generates while this one trains
        reward = rewards(prompts, batch)
        mismatch = _mismatch(batch, snapshots)
        model.train()
        new_logprobs = token_logprobs(model, batch)
        loss = clipped_policy_loss(
            new_logprobs, batch.old_logprobs, group_advantages(reward, batch.group_index), batch.response_mask, cfg.clip
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        version = bridge.push(model)
        snapshots[version] = copy.deepcopy(model).eval()
        snapshots.pop(version - cfg.max_staleness - 2, None)
        row = {
            "step": step,
            "reward": float(reward.mean()),
            "loss": loss.item(),
            "version": version,
            "staleness_max": batch.staleness["max"],
            "push_seconds": bridge.last_push_seconds,
            "mismatch_mean_abs": mismatch["mean_abs"],
            "mismatch_max_abs": mismatch["max_abs"],
        }
        rows.append(row)
        metrics.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=step)
        bar.set_postfix(
            reward=f"{row['reward']:.2f}", stale=int(row["staleness_max"]), push_ms=f"{1000 * row['push_seconds']:.0f}"
        )
    pending.result(300)  # let the last rollouts finish before the cluster stops
    return rows


def _prompts(rng: random.Random, cfg: DemoConfig) -> list[str]:
    return [f"{rng.randrange(10)}>" for _ in range(cfg.prompts_per_step)]


@torch.no_grad()
def _mismatch(batch, snapshots: dict) -> dict[str, float]:
    """Rollout vs trainer logprobs, each token against the trainer's weights of the version that sampled it."""
    mask = batch.response_mask.bool()
    recomputed = torch.zeros_like(batch.old_logprobs)
    for version in batch.versions[mask].unique().tolist():
        lp = token_logprobs(snapshots[version], batch)
        at = mask & (batch.versions == version)
        recomputed[at] = lp[at]
    return logprob_mismatch(batch.old_logprobs, recomputed, mask)


def _summary(rows: list[dict], seconds: float) -> dict:
    window = max(1, min(5, len(rows) // 4))
    return {
        "reward_start": sum(r["reward"] for r in rows[:window]) / window,
        "reward_end": sum(r["reward"] for r in rows[-window:]) / window,
        "steps": len(rows),
        "weight_pushes": len(rows),
        "max_staleness_seen": max(r["staleness_max"] for r in rows),
        "mean_abs_logprob_mismatch": sum(r["mismatch_mean_abs"] for r in rows) / len(rows),
        "seconds": seconds,
    }


def plot(rows: list[dict], path: Path) -> None:
    """Reward, staleness and push time per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    axes[0].plot(steps, [r["reward"] for r in rows], color="tab:green")
    axes[0].set_ylabel("mean reward")
    axes[0].set_ylim(0, 1)
    axes[1].step(steps, [r["staleness_max"] for r in rows], where="mid", color="tab:orange")
    axes[1].set_ylabel("max staleness\n(versions)")
    axes[2].plot(steps, [1000 * r["push_seconds"] for r in rows], color="tab:blue")
    axes[2].set_ylabel("push (ms)")
    axes[2].set_xlabel("optimizer step (one weight push each)")
    axes[0].set_title("GRPO on an embedded rollout cluster")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _jsonable(cfg: DemoConfig) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
