"""GRPO's two pieces: group-relative advantages and the clipped policy loss
with the rollout logprobs as the old policy."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`(r - mean of its group) / (std of its group + eps)` per row; 0 for a group whose rewards are all equal."""
    rewards = rewards.float()
    out = torch.zeros_like(rewards)
    for g in group_index.unique():
        rows = group_index == g
        r = rewards[rows]
        std = r.std(unbiased=False) if r.numel() > 1 else torch.tensor(0.0)
        out[rows] = (r - r.mean()) / (std + eps) if std > 0 else 0.0
    return out


def clipped_policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
) -> torch.Tensor:
    """PPO-style clipped surrogate, averaged over the tokens in `mask`.

    `new_logprobs`, `old_logprobs`, `mask`: `[B, R]`; `advantages`: `[B]`.
    """
    ratio = torch.exp(new_logprobs - old_logprobs)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    m = mask.float()
    return -(surrogate * m).sum() / m.sum().clamp(min=1)
