"""trainer_bridge/grpo.py against hand-computed values on tiny cases, and
against a float64 recompute of the definitions on random ones.

Definitions (grpo.py): an advantage is `(r - mean) / (std + 1e-6)` over the
row's group, the std without Bessel's correction, 0 for a group whose rewards
are all equal (one row included); the loss is minus the mean over the
masked tokens of `min(ratio * A, clamp(ratio, 1 - clip, 1 + clip) * A)`,
`ratio = exp(new - old)`.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer_bridge.grpo import clipped_policy_loss, group_advantages

EPS = 1e-6  # group_advantages' default


def test_group_advantages_by_hand():
    # Groups interleave, as rows of a batch may:
    #   group 0, rows 0 2 4 6: rewards 1 0 0 1 -> mean 0.5, deviations +-0.5, std sqrt(4 * 0.25 / 4) = 0.5
    #     -> +-0.5 / (0.5 + 1e-6) = +-0.999998
    #   group 1, rows 1 3 5: rewards 3 0 0 -> mean 1, deviations 2 -1 -1, variance (4 + 1 + 1) / 3 = 2,
    #     std sqrt(2) = 1.4142136 -> 2 / 1.4142146 = 1.4142126, -1 / 1.4142146 = -0.7071063
    #     (with Bessel's correction the std would be sqrt(3) and the advantages 1.1547, -0.5774)
    #   group 2, rows 7 8: rewards 0.25 0.25 -> std 0 -> 0 (not 0 / 1e-6 noise)
    #   group 3, row 9 alone -> 0
    rewards = torch.tensor([1, 3, 0, 0, 0, 0, 1, 0.25, 0.25, 5])
    groups = torch.tensor([0, 1, 0, 1, 0, 1, 0, 2, 2, 3])
    half = 0.5 / (0.5 + EPS)
    root2 = math.sqrt(2) + EPS
    expected = [half, 2 / root2, -half, -1 / root2, -half, -1 / root2, half, 0.0, 0.0, 0.0]
    got = group_advantages(rewards, groups)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(expected, rel=1e-6)
    assert got[0].item() == pytest.approx(0.999998, abs=1e-7)
    assert got[1].item() == pytest.approx(1.4142126, abs=1e-6)


def test_group_advantages_integer_rewards_become_float():
    # rewards 1 0 0 1 as integers: the same +-0.999998 as floats
    got = group_advantages(torch.tensor([1, 0, 0, 1]), torch.tensor([0, 0, 0, 0]))
    assert got.tolist() == pytest.approx([0.999998, -0.999998, -0.999998, 0.999998], abs=1e-7)


def test_group_advantages_match_a_float64_recompute():
    g = torch.Generator().manual_seed(0)
    groups = torch.randint(0, 7, (64,), generator=g)
    rewards = torch.rand(64, generator=g)
    rewards[groups == 3] = 0.5  # one group of equal rewards
    want = torch.zeros(64, dtype=torch.float64)
    for k in groups.unique().tolist():
        rows = groups == k
        r = rewards[rows].double()
        std = math.sqrt(((r - r.mean()) ** 2).mean().item())
        if std > 0:
            want[rows] = (r - r.mean()) / (std + EPS)
    got = group_advantages(rewards, groups)
    assert (got[groups == 3] == 0).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def _logprobs(log_ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Old logprobs and new ones `log_ratio` above them."""
    old = torch.tensor([[-1.0, -2.0, -0.5]] * len(log_ratios))
    return old + torch.tensor(log_ratios), old


def test_clipped_policy_loss_by_hand():
    # clip 0.2: ratios are clamped to [0.8, 1.2].
    # row 0, advantage +1, ratios 1.5 0.5 1.0, all three tokens in the mask:
    #   1.5: min(1.5 * 1, 1.2 * 1) = 1.2 (above the range: clipped)
    #   0.5: min(0.5 * 1, 0.8 * 1) = 0.5 (below the range, but the unclipped term is smaller)
    #   1.0: min(1, 1) = 1.0
    # row 1, advantage -2, ratios 1.5 0.5 e^5, the last token masked out:
    #   1.5: min(-3.0, -2.4) = -3.0 (a negative advantage keeps the unclipped, larger ratio)
    #   0.5: min(-1.0, -1.6) = -1.6 (clipped)
    #   e^5: excluded (it would be min(-296.8, -2.4) = -296.8)
    # 5 tokens: sum 1.2 + 0.5 + 1.0 - 3.0 - 1.6 = -1.9, mean -0.38, loss +0.38
    new, old = _logprobs([[math.log(1.5), math.log(0.5), 0.0], [math.log(1.5), math.log(0.5), 5.0]])
    new.requires_grad_(True)
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss = clipped_policy_loss(new, old, advantages, mask)
    assert loss.item() == pytest.approx(0.38, abs=1e-6)
    # d loss / d new = -(ratio * A) / 5 where the unclipped term is the minimum, 0 where the
    # clipped one is (the clamp is flat there) and on masked tokens:
    #   row 0: 1.5 clipped -> 0; 0.5 -> -(0.5 * 1) / 5 = -0.1; (ratio 1.0 is a tie, left out)
    #   row 1: 1.5 -> -(1.5 * -2) / 5 = 0.6; 0.5 clipped -> 0; masked -> 0
    loss.backward()
    grad = new.grad
    assert [grad[0, 0].item(), grad[0, 1].item()] == pytest.approx([0.0, -0.1], abs=1e-6)
    assert [grad[1, 0].item(), grad[1, 1].item(), grad[1, 2].item()] == pytest.approx([0.6, 0.0, 0.0], abs=1e-6)


def test_clipped_policy_loss_clip_width_and_empty_mask():
    # clip 0.6: the range is [0.4, 1.6], so row 0's ratio 1.5 is no longer clipped:
    # row 0, A = +1: 1.5 + 0.5 + 1.0 = 3.0 over 3 tokens -> loss -1.0
    new, old = _logprobs([[math.log(1.5), math.log(0.5), 0.0]])
    loss = clipped_policy_loss(new, old, torch.tensor([1.0]), torch.ones(1, 3), clip=0.6)
    assert loss.item() == pytest.approx(-1.0, abs=1e-6)
    # no token in the mask: 0 / max(0, 1) = 0, not NaN
    empty = clipped_policy_loss(new, old, torch.tensor([1.0]), torch.zeros(1, 3))
    assert empty.item() == 0.0


def test_clipped_policy_loss_matches_a_float64_recompute():
    g = torch.Generator().manual_seed(1)
    old = -3 * torch.rand(6, 7, generator=g)
    new = old + 0.5 * torch.randn(6, 7, generator=g)  # ratios on both sides of the clip range
    advantages = torch.randn(6, generator=g)
    mask = (torch.rand(6, 7, generator=g) < 0.7).long()
    ratio = (new.double() - old.double()).exp()
    a = advantages.double()[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
    want = -(surrogate[mask.bool()]).mean()
    got = clipped_policy_loss(new, old, advantages, mask)
    assert ((ratio > 1.2) & mask.bool()).any() and ((ratio < 0.8) & mask.bool()).any()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
