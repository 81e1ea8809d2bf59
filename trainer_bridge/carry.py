"""`Carry`: what one group collect leaves to the next. A collect with
`leftover="keep"` leaves the finished groups it read and did not batch, and
the sources still running; a collect that raised (a timeout) leaves every
group it read and did not drop, so a retry loses nothing. A source whose
generation failed is not carried: the groups read from it are, the ones it
never delivered are lost with it. Each group keeps the `SamplingParams` it
was sampled with."""

from __future__ import annotations

from .group_collector import Group, GroupCollector, GroupSource


class Carry:
    def __init__(self) -> None:
        self.ready: list[Group] = []  # finished, read from their sources, not batched yet
        self.sources: list[GroupSource] = []  # still running, oldest first

    @property
    def waiting(self) -> int:
        """Groups carried: finished and unread, or still to come."""
        return len(self.ready) + sum(s.source.remaining for s in self.sources)

    def sources_with(self, pending: GroupSource) -> list[GroupSource]:
        """The carried sources, then `pending` unless it is among them (a retry after a timeout)."""
        if any(s.source is pending.source for s in self.sources):
            return list(self.sources)
        return [*self.sources, pending]

    def keep_all(self, collector: GroupCollector) -> None:
        """After a collect that raised: everything it read and did not drop, every
        running source (a failed one has nothing `remaining`: it is not kept)."""
        self.ready, self.sources = collector.unread(), collector.live()

    def settle(self, collector: GroupCollector, leftover: str) -> int:
        """After a collect that returned: carry what the batch did not take
        (`"keep"`) or abort it (`"abort"`); returns how many groups that is."""
        self.ready, self.sources = list(collector.ready), collector.live()
        waiting = self.waiting
        if leftover == "abort":
            self.abort()
        return waiting

    def forget(self, source: object) -> None:
        """Drop `source` and its groups: a plain collect delivered them all."""
        self.ready = [g for g in self.ready if g.source is not source]
        self.sources = [s for s in self.sources if s.source is not source]

    def abort(self) -> int:
        """Abort every running source and drop the unread groups; returns how many groups that drops."""
        dropped = self.waiting
        for s in self.sources:
            s.source.abort()  # its outputs still arrive, unread: the KV is what matters
        self.ready, self.sources = [], []
        return dropped
