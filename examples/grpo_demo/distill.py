"""The distillation demo task: on-policy distillation of the rule task
(task.py) from a teacher that knows the rule. The teacher is a tiny model of
the same shape taught the rule by supervised steps on its answers (a few
seconds); the student starts from random weights, samples on the rollout
cluster, the teacher (an in-process `Engine` of its checkpoint) scores every
sampled token through `TrainerBridge(teacher=...)`, and the student steps on
the per-token reverse KL (`trainer_bridge.distill.reverse_kl_loss`), with no
reward in the loss. The reward is logged to show it learns the rule anyway.
With `--distill-top-k k` the teacher also returns its k most likely tokens
per position and the loss is the reverse KL over them, the sampled token and
a tail bucket (`topk_reverse_kl_loss`): dense per position, not sampled.

    python -m examples.grpo_demo --task distill [--distill-top-k 5]
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import torch

from examples.grpo_demo import task
from examples.grpo_demo.trainer import DemoConfig, _mismatch, push_and_record
from rollout import SamplingParams
from trainer_bridge.distill import response_log_softmax, reverse_kl_loss, topk_reverse_kl_loss
from trainer_bridge.logprobs import token_logprobs

TEACHER_STEPS = 300  # supervised steps that teach the teacher the rule (it reaches ~1.0 reward)


def make_teacher(path: Path, seed: int):
    """A checkpoint of the task's shape taught the rule: cross-entropy on every
    prompt's right answer ("4>" -> "5555"); returns the transformers model."""
    model = task.make_task_model(path, seed + 1000)
    digits = torch.arange(10)
    answer = (digits + 1) % 10 + len(task.SPECIALS)
    prompt = torch.stack([torch.full_like(digits, 1), digits + len(task.SPECIALS), torch.full_like(digits, 13)], 1)
    ids = torch.cat([prompt, answer[:, None].expand(10, task.ANSWER_TOKENS)], 1)  # <s> d > a a a a
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(TEACHER_STEPS):
        logits = model(ids).logits[:, prompt.shape[1] - 1 : -1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, prompt.shape[1] :].reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(path)
    return model


def train(cfg: DemoConfig, model, bridge, metrics, progress: bool) -> list[dict]:
    """Reverse-KL steps on the teacher's scores of the student's samples, generation one step ahead."""
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    params = SamplingParams(n=cfg.n, max_tokens=task.ANSWER_TOKENS, ignore_eos=True, temperature=1.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    snapshots = {0: copy.deepcopy(model).eval()}
    pending = bridge.submit(task.prompts(rng, cfg.prompts_per_step), params)
    rows = []
    bar = tqdm(range(cfg.steps), desc="distill", unit="step", disable=not progress)
    for step in bar:
        batch, prompts = bridge.collect(pending, timeout=300), pending.prompts  # scored by the teacher
        pending = bridge.submit(task.prompts(rng, cfg.prompts_per_step), params)
        reward = task.rewards(prompts, batch)
        mismatch = _mismatch(batch, snapshots)
        model.train()
        if cfg.distill_top_k:  # the reverse KL over the teacher's top k at every position
            loss, stats = topk_reverse_kl_loss(response_log_softmax(model, batch), batch)
            m = batch.response_mask
            stats["distill/reverse_kl"] = float(((batch.old_logprobs - batch.teacher_logprobs) * m).sum() / m.sum())
        else:
            new = token_logprobs(model, batch)
            loss, stats = reverse_kl_loss(
                new, batch.old_logprobs, batch.teacher_logprobs, batch.response_mask, cfg.clip
            )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        row = push_and_record(cfg, model, bridge, snapshots, step, batch, reward, loss.item(), mismatch)
        row["reverse_kl"] = stats["distill/reverse_kl"]
        if cfg.distill_top_k:
            row["topk_reverse_kl"] = stats["distill/topk_reverse_kl"]
        rows.append(row)
        metrics.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=step)
        bar.set_postfix(reward=f"{row['reward']:.2f}", kl=f"{row['reverse_kl']:.3f}")
    pending.result(300)
    return rows
