"""The GRPO demo's training loop: a plain PyTorch loop on the transformers
model of the task (task.py) while an embedded local Ray cluster of rollout
actors generates one step ahead, a weight push after every optimizer step.
`run` writes the summary, the per-step rows and the reward plot.

`colocate`: one process, no actors: an in-process engine that sleeps
(level 1, its KV pool freed) during each optimizer step and wakes for the
next rollouts, which then wait for the step (on-policy). `lora`: the model
trains LoRA adapters (PEFT) and each push sends the adapters only.

Needs the `demo` extra (transformers, matplotlib).
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
from examples.grpo_demo import task
from rollout import SamplingParams
from rollout.checks import check_int
from trainer_bridge.bridge import TrainerBridge
from trainer_bridge.corrections import corrected_policy_loss, correction_weights
from trainer_bridge.grpo import clipped_policy_loss, group_advantages
from trainer_bridge.logprobs import logprob_mismatch, token_logprobs
from trainer_bridge.metrics import Metrics

TASKS = ("rule", "tool", "distill")


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
    task: str = "rule"  # "rule": one turn (task.py); "tool": ask, then answer (tool.py); "distill" (distill.py)
    oversample: float = 0.0  # submit this much more, train on the first prompts_per_step groups, carry the rest
    tis: bool = False  # truncated importance sampling against the trainer's own logprobs (docs/off_policy.md)
    colocate: bool = False  # one process: an in-process engine asleep during each optimizer step
    lora: bool = False  # train LoRA adapters (PEFT); pushes send the adapters only
    # "moe": a Qwen3-MoE policy, trained with routing replay (the rollouts' experts forced, docs/moe.md)
    model: str = "dense"
    # The distill task's loss: 0, the sampled reverse KL (`reverse_kl_loss`); k > 0, the reverse KL
    # over the teacher's top k, the sampled token and a tail bucket (`topk_reverse_kl_loss`).
    distill_top_k: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "actors", "prompts_per_step", "n"):
            check_int(name, getattr(self, name), 1)
        if not isinstance(self.oversample, (int, float)) or not 0 <= self.oversample <= 4:
            raise ValueError(f"oversample must be a fraction in [0, 4], got {self.oversample!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.colocate and (self.task != "rule" or self.oversample):
            raise ValueError("colocate runs the rule task without oversample (rollouts wait for each step)")
        if self.model not in ("dense", "moe"):
            raise ValueError(f"model must be 'dense' or 'moe', got {self.model!r}")
        if self.model == "moe" and self.task != "rule":
            raise ValueError("model 'moe' runs the 'rule' task (a cluster session returns no routed experts)")
        check_int("distill_top_k", self.distill_top_k, 0, "and <= 20 (0: the sampled reverse KL)")
        if self.distill_top_k > 20 or (self.distill_top_k and self.task != "distill"):
            raise ValueError(
                f"distill_top_k must be in [0, 20] and only set with task 'distill', got {self.distill_top_k}"
            )
        if self.model == "moe" and self.lora:
            raise ValueError("model 'moe' trains every weight (lora adapts the dense projections only)")
        self.out = Path(self.out)


def run(cfg: DemoConfig, progress: bool = True) -> dict:
    """Train for `cfg.steps` steps on a fresh local cluster; writes summary.json,
    steps.json and reward.png under `cfg.out` and returns the summary."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)  # the actors have the other cores
    from examples.grpo_demo import distill, tool

    symbols = tool.SYMBOLS if cfg.task == "tool" else task.SYMBOLS
    train = {"tool": tool.train, "distill": distill.train}.get(cfg.task, _train)
    shape = "grpo-demo-moe" if cfg.model == "moe" else "grpo-demo"
    model = task.make_task_model(cfg.out / "checkpoint", cfg.seed, symbols, shape)
    if cfg.lora:
        model = _with_lora(model)
    teacher = None
    if cfg.task == "distill":  # a teacher that knows the rule scores the student's samples in this process
        distill.make_teacher(cfg.out / "teacher", cfg.seed)
        teacher = rollout.Engine(cfg.out / "teacher", device="cpu", max_seq_len=32, kv_cache_tokens=4096)
    metrics = Metrics(project="rollout-demo", config=_jsonable(cfg), dir=cfg.out, enabled=cfg.wandb)
    sizes = dict(max_seq_len=32, kv_cache_tokens=4096, max_batch_size=256)
    if cfg.colocate:
        target = rollout.Engine(cfg.out / "checkpoint", device="cpu", seed=cfg.seed, **sizes)
    else:
        cores = max(os.cpu_count() or 1, cfg.actors)
        target = rollout.init(
            cfg.out / "checkpoint",
            num_actors=cfg.actors,
            num_cpus_per_actor=1,
            timeout_s=300,
            ray_init_kwargs={"num_cpus": cores, "log_to_driver": False},
            **sizes,
        )
    start = time.perf_counter()
    try:
        bridge = TrainerBridge(
            target,
            max_staleness=cfg.max_staleness,
            metrics=metrics,
            teacher=teacher,
            teacher_top_logprobs=cfg.distill_top_k,
        )
        rows = train(cfg, model, bridge, metrics, progress)
        peak = peak_memory(target)
    finally:
        if cfg.colocate:
            target.close()
        else:
            rollout.shutdown()
        if teacher is not None:
            teacher.close()
        metrics.finish()
    summary = _summary(rows, time.perf_counter() - start) | peak
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2))
    (cfg.out / "steps.json").write_text(json.dumps(rows, indent=2))
    plot(rows, cfg.out / "reward.png")
    return summary


def _train(cfg: DemoConfig, model, bridge: TrainerBridge, metrics: Metrics, progress: bool) -> list[dict]:
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    replay = cfg.model == "moe"  # the rollouts return their experts and the trainer's forwards replay them
    params = SamplingParams(
        n=cfg.n, max_tokens=task.ANSWER_TOKENS, ignore_eos=True, temperature=1.0, return_routed_experts=replay
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=cfg.lr)
    snapshots = {0: copy.deepcopy(model).eval()}  # the policy behind each version, to measure mismatch
    submitted = cfg.prompts_per_step + round(cfg.prompts_per_step * cfg.oversample)
    pending = bridge.submit(task.prompts(rng, submitted), params)
    rows = []
    bar = tqdm(range(cfg.steps), desc="GRPO", unit="step", disable=not progress)
    for step in bar:
        if cfg.oversample:  # the first groups to finish; the others run on into the next step
            batch = bridge.collect(pending, timeout=300, min_groups=cfg.prompts_per_step, leftover="keep")
            prompts = batch.prompts
        else:
            batch, prompts = bridge.collect(pending, timeout=300), pending.prompts
        if not cfg.colocate:  # the next batch generates while this one trains
            pending = bridge.submit(task.prompts(rng, submitted), params)
        reward = task.rewards(prompts, batch)
        mismatch = _mismatch(batch, snapshots, replay)
        if cfg.colocate:  # the engine's KV pool goes back while the trainer steps
            bridge.target.sleep(level=1)
        loss = _policy_step(model, optimizer, batch, reward, cfg.clip, cfg.tis, replay)
        row = push_and_record(cfg, model, bridge, snapshots, step, batch, reward, loss, mismatch)
        if replay:  # what the mismatch would be without replay
            row["mismatch_unreplayed_mean_abs"] = _mismatch(batch, snapshots, False)["mean_abs"]
        if cfg.colocate:
            bridge.target.wake_up()
            pending = bridge.submit(task.prompts(rng, submitted), params)
        rows.append(row)
        metrics.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=step)
        bar.set_postfix(
            reward=f"{row['reward']:.2f}", stale=int(row["staleness_max"]), push_ms=f"{1000 * row['push_seconds']:.0f}"
        )
    pending.result(300)  # let the last rollouts finish before the cluster stops
    return rows


def push_and_record(cfg: DemoConfig, model, bridge, snapshots: dict, step, batch, reward, loss, mismatch) -> dict:
    """Push the trained weights, keep their snapshot for the mismatch metric, and return the step's row."""
    version = bridge.push(model)
    snapshots[version] = copy.deepcopy(model).eval()
    snapshots.pop(version - cfg.max_staleness - 2, None)
    return {
        "step": step,
        "reward": float(reward.mean()),
        "loss": loss,
        "version": version,
        "staleness_max": batch.staleness["max"],
        "push_seconds": bridge.last_push_seconds,
        "push_bytes": bridge.last_push.bytes_sent,
        "mismatch_mean_abs": mismatch["mean_abs"],
        "mismatch_max_abs": mismatch["max_abs"],
    }


def _with_lora(model):
    """The model with LoRA adapters on every projection and the LM head (PEFT); only they train.
    Without the head's adapter the tiny model's frozen random head kept the reward flat."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))


def peak_memory(target) -> dict[str, int]:
    """The peak resident memory of this process and, on a cluster, the actors' resident memory now."""
    from rollout.cluster.host import resident_bytes

    out = {"peak_rss_bytes": resident_bytes("VmHWM")}
    if not isinstance(target, rollout.Engine):
        out["actors_rss_bytes"] = sum(h.get("rss_bytes", 0) for h in target.health())
    return out


def _policy_step(
    model, optimizer, batch, reward: torch.Tensor, clip: float, tis: bool = False, replay: bool = False
) -> float:
    """One GRPO optimizer step on `batch`: group-relative advantages, the clipped
    surrogate against the rollout logprobs; returns the loss. With `tis`, the
    surrogate is taken against the trainer's own logprobs before the step and
    each token weighted by the truncated ratio to the rollout's (TIS)."""
    advantages = group_advantages(reward, batch.group_index)
    if tis:
        with torch.no_grad():
            trainer_old = token_logprobs(model.eval(), batch, replay_routing=replay)
        weights, _ = correction_weights(trainer_old, batch.old_logprobs, batch.response_mask, "tis", clip=2.0)
        model.train()
        new = token_logprobs(model, batch, replay_routing=replay)
        loss = corrected_policy_loss(new, trainer_old, advantages, batch.response_mask, weights, clip)
    else:
        model.train()
        new = token_logprobs(model, batch, replay_routing=replay)
        loss = clipped_policy_loss(new, batch.old_logprobs, advantages, batch.response_mask, clip)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
def _mismatch(batch, snapshots: dict, replay: bool = False) -> dict[str, float]:
    """Rollout vs trainer logprobs, each token against the trainer's weights of the version that sampled it.

    With `replay` (an MoE policy), over the tokens of each sample's last version only: a commit
    mid-sample recomputes the sample's KV, and its routing, under the new weights, so the routing
    the engine returns is that of the last version (docs/moe.md); earlier tokens were sampled
    under a routing no forward of the whole sample can reproduce."""
    mask = batch.response_mask.bool()
    if replay:
        mask &= batch.versions == batch.versions.max(dim=1, keepdim=True).values
    recomputed = torch.zeros_like(batch.old_logprobs)
    for version in batch.versions[mask].unique().tolist():
        lp = token_logprobs(snapshots[version], batch, replay_routing=replay)
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
        **(
            {"mean_abs_logprob_mismatch_unreplayed": sum(r["mismatch_unreplayed_mean_abs"] for r in rows) / len(rows)}
            if "mismatch_unreplayed_mean_abs" in rows[0]
            else {}
        ),
        **({"ask_rate_end": sum(r["ask_rate"] for r in rows[-window:]) / window} if "ask_rate" in rows[0] else {}),
        **(_kl_summary(rows, window) if "reverse_kl" in rows[0] else {}),
        "seconds": seconds,
    }


def _kl_summary(rows: list[dict], window: int) -> dict:
    return {
        "reverse_kl_start": sum(r["reverse_kl"] for r in rows[:window]) / window,
        "reverse_kl_end": sum(r["reverse_kl"] for r in rows[-window:]) / window,
    }


def plot(rows: list[dict], path: Path) -> None:
    """Reward, staleness and push time per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    axes[0].plot(steps, [r["reward"] for r in rows], color="tab:green", label="reward")
    if "ask_rate" in rows[0]:  # the tool task: how often the first turn asks the environment
        axes[0].plot(steps, [r["ask_rate"] for r in rows], color="tab:purple", label="asks")
        axes[0].legend(loc="lower right")
    if "reverse_kl" in rows[0]:  # the distill task: the student's reverse KL to its teacher, on its own axis
        kl = axes[0].twinx()
        kl.plot(steps, [r["reverse_kl"] for r in rows], color="tab:red")
        kl.set_ylabel("reverse KL to the teacher", color="tab:red")
    axes[0].set_ylabel("mean reward")
    axes[0].set_ylim(0, 1)
    axes[1].step(steps, [r["staleness_max"] for r in rows], where="mid", color="tab:orange")
    axes[1].set_ylabel("max staleness\n(versions)")
    axes[2].plot(steps, [1000 * r["push_seconds"] for r in rows], color="tab:blue")
    axes[2].set_ylabel("push (ms)")
    axes[2].set_xlabel("optimizer step (one weight push each)")
    if "reverse_kl" in rows[0]:
        axes[0].set_title("On-policy distillation on an embedded rollout cluster")
    else:
        axes[0].set_title("GRPO on an embedded rollout cluster" + (" (multi-turn)" if "ask_rate" in rows[0] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _jsonable(cfg: DemoConfig) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
