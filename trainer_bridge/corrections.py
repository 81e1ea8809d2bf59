"""Off-policy corrections on the trainer side: per-token loss weights from the
ratio of the trainer's recomputed logprob to the rollout's (truncated, masked
or IcePop-masked importance sampling), the clipped policy loss that applies
them, and metrics of how far the two policies are apart. The formulas and
their sources are in docs/off_policy.md."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

METHODS = ("tis", "mis", "icepop")
LEVELS = ("token", "sequence")
KEEP = ("ratio", "one")
DENOMINATORS = ("mask", "kept")
# Log-ratios (and a row's sum of them) are clamped to +-20 before exp, as verl's rollout
# correction does: e^20 ~ 4.9e8 is far past any useful weight, and no exp overflows.
LOG_RATIO_BOUND = 20.0
DEFAULTS = {
    "tis": {"clip": 2.0},
    "mis": {"low": 0.5, "high": 2.0, "keep": "ratio"},
    "icepop": {"low": 0.5, "high": 5.0, "keep": "ratio"},
}
METRIC_KEYS = (
    "is/clip_fraction",
    "is/mask_fraction",
    "is/seq_clip_fraction",
    "is/seq_mask_fraction",
    "is/ratio_mean",
    "is/ratio_max",
    "is/seq_ratio_mean",
    "is/seq_ratio_max",
    "is/weight_mean",
    "kl/k1",
    "kl/k2",
    "kl/k3",
)


class CorrectionResult(NamedTuple):
    weights: torch.Tensor  # [B, R] detached loss weights: 0 on padding, on empty rows and on masked tokens
    metrics: dict[str, float]  # METRIC_KEYS -> plain floats, over the tokens (rows) in the mask


@dataclass(slots=True)
class Correction:
    """One off-policy correction, validated on construction.

    With `rho = exp(trainer_logprob - rollout_logprob)` per token (the trainer's
    probability of the sampled token over the rollout engine's) and, at
    sequence level, `rho_seq = exp(sum of the row's masked log-ratios)`:

    - `tis`: truncated importance sampling, weight `min(rho, clip)` per token,
      or `min(rho_seq, clip)` on every token of the row. Ionides, "Truncated
      Importance Sampling" (JCGS, 2008); Yao et al., "Your Efficient RL
      Framework Secretly Brings You Off-Policy RL Training" (2025).
    - `mis`: masked importance sampling, weight 0 where the ratio (`rho`, or
      `rho_seq` for the whole row) leaves `[low, high]`, else the ratio
      (`keep="ratio"`) or 1 (`keep="one"`). Liu, Li et al., "When Speed Kills
      Stability: Demystifying RL Collapse from the Training-Inference Mismatch" (2025).
    - `icepop`: IcePop's two-sided token mask, `M(rho) = rho` inside `[low, high]`,
      0 outside: token-level `mis` arithmetic, token level only. Ling Team,
      "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
      Thinking Model" (2025).

    Bounds are inclusive. A kept token weighs its ratio by default: the
    importance-sampling estimator on the accepted region, as both MIS and
    IcePop define it, each weight at most `high`; "one" is a plain filter.

    A parameter the method does not use must stay None; None takes the
    method's entry in `DEFAULTS`. Bad values raise `TypeError` (wrong type) or
    `ValueError` (out of range), naming the field and what it allows.
    """

    method: str = "tis"  # one of METHODS
    level: str = "token"  # one of LEVELS; icepop is token level only
    clip: float | None = None  # tis only: the truncation C > 0 (default 2.0)
    low: float | None = None  # mis, icepop: keep where low <= ratio <= high, 0 <= low < high
    high: float | None = None  # mis, icepop: finite upper bound (default 2.0 for mis, 5.0 for icepop)
    keep: str | None = None  # mis, icepop: a kept token's weight, "ratio" (default) or "one"

    def __post_init__(self) -> None:
        _choice("method", self.method, METHODS)
        _choice("level", self.level, LEVELS)
        if self.method == "icepop" and self.level != "token":
            raise ValueError(
                f"level must be 'token' for method='icepop' (a token mask), got {self.level!r}; "
                "method='mis' with level='sequence' masks whole sequences"
            )
        used = DEFAULTS[self.method]
        for name in ("clip", "low", "high", "keep"):
            value = getattr(self, name)
            if name not in used and value is not None:
                raise ValueError(f"{name} does not apply to method={self.method!r}, which takes {tuple(used)}")
            if name in used and value is None:
                setattr(self, name, used[name])
        if self.method == "tis":
            self.clip = _number("clip", self.clip)
            if self.clip <= 0:
                raise ValueError(f"clip must be > 0, got {self.clip}")
            return
        self.low, self.high = _number("low", self.low), _number("high", self.high)
        if not 0 <= self.low < self.high:
            raise ValueError(f"low and high must satisfy 0 <= low < high, got low={self.low}, high={self.high}")
        _choice("keep", self.keep, KEEP)

    def weights(
        self, trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> CorrectionResult:
        """Loss weights `[B, R]` and metrics; see `correction_weights`."""
        m = _check_inputs(trainer_logprobs, rollout_logprobs, mask)
        with torch.no_grad():
            d = _log_ratio(trainer_logprobs, rollout_logprobs, m)
            if self.level == "token":
                w, hit = self._apply(d.exp())
            else:
                row_sum = d.sum(dim=1, keepdim=True).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
                w, hit = (t.expand_as(d) for t in self._apply(row_sum.exp()))
            w = w * m
            metrics = _metrics(d, m, w, hit, self.method)
        return CorrectionResult(w.to(torch.promote_types(trainer_logprobs.dtype, torch.float32)), metrics)

    def _apply(self, rho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight and clipped-or-masked flag of each ratio (a token's, or a row's `[B, 1]`)."""
        if self.method == "tis":
            return rho.clamp(max=self.clip), rho > self.clip
        kept = (rho >= self.low) & (rho <= self.high)
        value = rho if self.keep == "ratio" else torch.ones_like(rho)
        return torch.where(kept, value, torch.zeros_like(rho)), ~kept


def correction_weights(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    method: str = "tis",
    level: str = "token",
    clip: float | None = None,
    low: float | None = None,
    high: float | None = None,
    keep: str | None = None,
) -> CorrectionResult:
    """Off-policy loss weights for the tokens a rollout engine sampled.

    `trainer_logprobs`: `[B, R]` the trainer's logprobs of the response tokens
    under the policy that should have sampled them (`token_logprobs(model,
    batch)`, detached or not); `rollout_logprobs`: `[B, R]` the engine's
    (`batch.old_logprobs`); `mask`: `[B, R]` the loss mask
    (`batch.response_mask`), bool or 0/1. The method, level and parameters are
    `Correction`'s. Returns `(weights, metrics)`: `weights` `[B, R]`, detached,
    float32 (or the logprobs' wider float dtype), on their device, 0 wherever
    `mask` is 0 and on rows with no token in the mask; `metrics` maps each of
    `METRIC_KEYS` to a float over the tokens in the mask (all 0.0 when there are
    none): the fractions clipped (TIS) or masked (MIS, IcePop), of tokens and
    of rows; mean and max token and row ratio; the mean weight; and with
    `r = rho` the estimators of KL(rollout || trainer) from Schulman,
    "Approximating KL Divergence" (2020): k1 = mean(-log r),
    k2 = mean((log r)^2 / 2), k3 = mean(r - 1 - log r).

    Computed in float64 with every log-ratio clamped to `[-20, 20]`
    (`LOG_RATIO_BOUND`) before `exp`; values under padding are never read, so
    padding may hold anything. Raises `TypeError` for a non-tensor or
    non-float logprob tensor, `ValueError` for a bad parameter, a shape or
    device mismatch, a mask value other than 0 and 1, or a NaN log-ratio on a
    token in the mask.
    """
    correction = Correction(method, level, clip, low, high, keep)
    return correction.weights(trainer_logprobs, rollout_logprobs, mask)


def corrected_policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    clip: float = 0.2,
    denominator: str = "mask",
) -> torch.Tensor:
    """`trainer_bridge.grpo.clipped_policy_loss` with each token's surrogate
    multiplied by its off-policy weight:

        -sum(w * m * min(ratio * A, clamp(ratio, 1 - clip, 1 + clip) * A)) / max(N, 1)

    `ratio = exp(new - old)`; `new_logprobs`, `old_logprobs`, `mask`, `weights`:
    `[B, R]`; `advantages`: `[B]`; `clip` in `(0, 1]`. `N` is the number of
    tokens in `mask` (`denominator="mask"`: a token a correction zeroed still
    counts, so all-ones weights give `clipped_policy_loss` exactly) or of those
    with a nonzero weight (`"kept"`: a masked token leaves the mean, as if
    removed from the loss mask). Gradients flow through `new_logprobs` only:
    `old_logprobs`, `advantages` and `weights` are detached. Raises `TypeError`
    or `ValueError` on bad input, naming it.
    """
    _choice("denominator", denominator, DENOMINATORS)
    clip = _number("clip", clip)
    if not 0 < clip <= 1:
        raise ValueError(f"clip must be in (0, 1], got {clip}")
    _check_loss_inputs(new_logprobs, old_logprobs, advantages, mask, weights)
    ratio = torch.exp(new_logprobs - old_logprobs.detach())
    adv = advantages.detach()[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    m = mask.float()
    w = torch.where(mask.bool(), weights.detach(), 0.0).to(surrogate.dtype)  # padding may hold anything
    count = m if denominator == "mask" else m * (w != 0)
    return -(surrogate * w * m).sum() / count.sum().clamp(min=1)


def _log_ratio(trainer: torch.Tensor, rollout: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`trainer - rollout` in float64, clamped to +-LOG_RATIO_BOUND; 0 off the mask."""
    d = trainer.detach().double() - rollout.detach().double()
    nan = torch.isnan(d) & m
    if nan.any():
        raise ValueError(
            f"trainer_logprobs - rollout_logprobs is NaN at {int(nan.sum())} token(s) in the mask "
            "(a NaN logprob, or -inf on both sides)"
        )
    return torch.where(m, d, torch.zeros_like(d)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _metrics(d: torch.Tensor, m: torch.Tensor, w: torch.Tensor, hit: torch.Tensor, method: str) -> dict[str, float]:
    """METRIC_KEYS over the tokens in `m` and the rows holding one; one host sync."""
    if not m.any():
        return dict.fromkeys(METRIC_KEYS, 0.0)
    rows = m.any(dim=1)
    lr = d[m]
    rho = lr.exp()
    hit = hit & m
    seq_rho = d.sum(dim=1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()[rows]
    token_hit = hit.double().sum() / m.sum()
    row_hit = hit.any(dim=1)[rows].double().mean()
    zero = torch.zeros((), dtype=torch.float64, device=d.device)
    tis = method == "tis"
    values = [
        token_hit if tis else zero,
        zero if tis else token_hit,
        row_hit if tis else zero,
        zero if tis else row_hit,
        rho.mean(),
        rho.max(),
        seq_rho.mean(),
        seq_rho.max(),
        w[m].mean(),
        (-lr).mean(),
        (0.5 * lr**2).mean(),
        (rho - 1 - lr).mean(),
    ]
    return dict(zip(METRIC_KEYS, torch.stack(values).tolist(), strict=True))


def _check_inputs(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool, after checking the three `[B, R]` tensors agree."""
    named = {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "mask": mask}
    _tensors(named, floating=("trainer_logprobs", "rollout_logprobs"))
    _same_shape(named, "trainer_logprobs", dims=2)
    return _bool_mask("mask", mask)


def _check_loss_inputs(
    new: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor
) -> None:
    named = {"new_logprobs": new, "old_logprobs": old, "mask": mask, "weights": weights}
    _tensors({**named, "advantages": advantages}, floating=("new_logprobs", "old_logprobs", "advantages", "weights"))
    _same_shape(named, "new_logprobs", dims=2)
    if advantages.shape != new.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(new.shape[:1])}, got shape {tuple(advantages.shape)}")
    m = _bool_mask("mask", mask)
    bad = m & ~(torch.isfinite(weights) & (weights >= 0))
    if bad.any():
        raise ValueError(f"weights must be finite and >= 0 on the tokens in mask, got {weights[bad][0].item()}")


def _tensors(named: dict[str, torch.Tensor], floating: tuple[str, ...]) -> None:
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if name in floating and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _same_shape(named: dict[str, torch.Tensor], first: str, dims: int) -> None:
    ref = named[first]
    if ref.dim() != dims:
        raise ValueError(f"{first} must be [B, R] (2-D), got shape {tuple(ref.shape)}")
    for name, t in named.items():
        if t.shape != ref.shape:
            raise ValueError(f"{name} must have the shape of {first}, {tuple(ref.shape)}, got {tuple(t.shape)}")
        if t.device != ref.device:
            raise ValueError(f"{name} must be on the device of {first}, {ref.device}, got {t.device}")


def _bool_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or hold 0 and 1, got {mask.dtype}")
    bad = (mask != 0) & (mask != 1)
    if bad.any():
        raise ValueError(f"{name} must hold only 0 and 1 (or be bool), got {mask[bad][0].item()}")
    return mask.bool()


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {allowed}, got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)
