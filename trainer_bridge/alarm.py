"""`MismatchAlarm`: catches a broken weight sync from the rollout-vs-trainer
logprob mismatch.

When the engine serves the weights the trainer holds, the engine's logprob
of each sampled token and the trainer's recompute of it agree to float
rounding: about 1e-7 nats in float32, about 1e-2 in bfloat16. A push that
went wrong (a tensor missed, names mismatched, a stale version served)
moves whole distributions: the mean |difference| jumps to tenths of a nat
or more. The alarm compares each batch's `mismatch["mean_abs"]` (set by
`token_logprobs`) with `threshold` and warns once per run (`action="warn"`),
or raises `WeightSyncError` (`action="raise"`).
"""

from __future__ import annotations

import warnings

ACTIONS = ("warn", "raise")
DEFAULT_THRESHOLD = 0.05  # nats of mean |trainer - rollout| logprob: far above bfloat16 noise


class WeightSyncError(RuntimeError):
    """The rollout and trainer logprobs disagree beyond what numerics explain."""


class MismatchAlarm:
    def __init__(self, threshold: float = DEFAULT_THRESHOLD, action: str = "warn") -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
            raise ValueError(f"threshold must be a positive number of nats, got {threshold!r}")
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        self.threshold = float(threshold)
        self.action = action
        self.fired = 0  # batches over the threshold so far
        self._warned = False

    def check(self, mismatch: dict[str, float] | None) -> bool:
        """True when `mismatch` crosses the threshold (then warn once, or raise)."""
        if not mismatch or mismatch["mean_abs"] <= self.threshold:
            return False
        self.fired += 1
        message = (
            f"rollout and trainer logprobs differ by {mismatch['mean_abs']:.4g} nats on average "
            f"(max {mismatch['max_abs']:.4g}), above the alarm's {self.threshold:g}: the engine is probably not "
            "serving the trainer's weights (a push that missed tensors or names, or a stale version)"
        )
        if self.action == "raise":
            raise WeightSyncError(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return True
