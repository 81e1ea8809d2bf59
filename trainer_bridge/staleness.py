"""Staleness policy: bound how many policy versions old a training sample may be."""

from __future__ import annotations

from dataclasses import dataclass

from rollout import RolloutOutput

STALE_ACTIONS = ("regenerate", "drop")


@dataclass(frozen=True, slots=True)
class StalenessPolicy:
    """Samples with a token older than `current - max_staleness` are stale.

    A stale prompt group is regenerated (default) or dropped whole: GRPO's
    group-relative advantages need every sample of a group.
    """

    max_staleness: int | None = None  # None: no bound
    action: str = "regenerate"  # "regenerate" | "drop"
    max_regenerations: int = 3  # rounds before giving up and raising

    def __post_init__(self) -> None:
        if self.max_staleness is not None and (
            isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0
        ):
            raise ValueError(f"max_staleness must be an int >= 0 or None, got {self.max_staleness!r}")
        if self.action not in STALE_ACTIONS:
            raise ValueError(f"stale action must be one of {STALE_ACTIONS}, got {self.action!r}")
        if self.max_regenerations < 0:
            raise ValueError(f"max_regenerations must be >= 0, got {self.max_regenerations}")

    def stale_groups(self, outputs: list[RolloutOutput], current_version: int) -> list[int]:
        """Indices of the outputs with any token older than the bound allows."""
        if self.max_staleness is None:
            return []
        oldest = current_version - self.max_staleness
        return [i for i, out in enumerate(outputs) if any(v < oldest for s in out.samples for v in s.versions)]
