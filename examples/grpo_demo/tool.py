"""The multi-turn demo task, "ask, then answer": the environment holds a
secret digit the prompt does not show. The model sees `>`; if its turn
is `?` (it asks), the environment answers with the digit and `=`, and
the model's next turn is scored as in the single-turn task: the fraction of
four tokens equal to the digit's successor. Any other first turn ends the
episode with reward 0, so the reward is reachable only through what the
environment answers. GRPO over episodes (`TrainerBridge.submit_episodes`):
one row per episode, the loss on the sampled tokens only.

    python -m examples.grpo_demo --task tool
"""

from __future__ import annotations

import copy
import random

import torch

from examples.grpo_demo import task
from examples.grpo_demo.trainer import DemoConfig, _mismatch, _policy_step, push_and_record
from rollout import SamplingParams

ASK = "?"
SYMBOLS = [str(d) for d in range(10)] + [">", ASK, "="]  # with the specials, the grpo-demo vocab of 16
PROMPT = ">"


def token_id(symbol: str) -> int:
    return len(task.SPECIALS) + SYMBOLS.index(symbol)


class AskEnv:
    """One episode: ask for the secret digit, then answer its successor."""

    def __init__(self, secret: int) -> None:
        self.secret = secret
        self.asked = False

    def reset(self) -> str:
        return PROMPT

    def step(self, sample):
        if not self.asked:
            if sample.token_ids != [token_id(ASK)]:  # the first turn is one token: `?` asks
                return None, 0.0, True
            self.asked = True
            return [token_id(str(self.secret)), token_id("=")], 0.0, False
        target = token_id(str((self.secret + 1) % 10))
        return None, sum(t == target for t in sample.token_ids) / task.ANSWER_TOKENS, True


def envs(rng: random.Random, groups: int, n: int) -> list[AskEnv]:
    """`groups` secret digits, `n` episodes each (a GRPO group shares its digit)."""
    secrets = [rng.randrange(10) for _ in range(groups)]
    return [AskEnv(s) for s in secrets for _ in range(n)]


def train(cfg: DemoConfig, model, bridge, metrics, progress: bool) -> list[dict]:
    """GRPO over episodes, generation one step ahead; the rows the summary and plot read."""
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    # One token to ask with, then the answer's four.
    params = [
        SamplingParams(max_tokens=1, ignore_eos=True, temperature=1.0),
        SamplingParams(max_tokens=task.ANSWER_TOKENS, ignore_eos=True, temperature=1.0),
    ]
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    snapshots = {0: copy.deepcopy(model).eval()}
    submit = lambda: bridge.submit_episodes(envs(rng, cfg.prompts_per_step, cfg.n), params, 2, cfg.n)  # noqa: E731
    pending = submit()
    rows = []
    bar = tqdm(range(cfg.steps), desc="GRPO (tool)", unit="step", disable=not progress)
    for step in bar:
        batch = bridge.collect(pending, timeout=300)
        pending = submit()  # the next episodes run while this batch trains
        mismatch = _mismatch(batch, snapshots)
        loss = _policy_step(model, optimizer, batch, batch.rewards, cfg.clip)
        row = push_and_record(cfg, model, bridge, snapshots, step, batch, batch.rewards, loss, mismatch)
        row["ask_rate"] = float(_asked(batch).float().mean())
        rows.append(row)
        metrics.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=step)
        bar.set_postfix(reward=f"{row['reward']:.2f}", ask=f"{row['ask_rate']:.2f}", stale=int(row["staleness_max"]))
    pending.result(300)
    return rows


def _asked(batch) -> torch.Tensor:
    """[B] bool: the episode asked (the environment's answer sits in its response, unmasked)."""
    return (batch.response_attention - batch.response_mask).sum(dim=1) > 0
