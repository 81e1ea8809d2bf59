"""The logprobs a score call's sequences share, computed once.

Position p's logprob depends on tokens 0 .. p only, so two sequences of one
`score` call that agree on their first L tokens have the same logprobs (and
top logprobs) at positions 1 .. L - 1. A GRPO batch's samples of one prompt
share the prompt: scoring every position of each would compute the prompt's
logits once per sample, and, since the positions whose logits a request needs
never come from the prefix cache (`PromptScores.cache_limit`), its layers too.

`plan_shares` finds, for each sequence, the earlier sequence of the call
with the longest common prefix whose own wanted positions cover the shared
ones (an earlier or equal `start`). The sequence's request then asks for
logprobs from position L only (its prefix match may cover the first L - 1
tokens, so the cache serves the shared pages once its donor has published
them), and `ShareMerge` fills positions `start` .. L - 1 from the donor's
result; a sequence inside an earlier one runs no request at all. A result
stays of one policy version: when a weight commit fell between a sequence's
own positions and its donor's, the sequence is scored again alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..outputs import ScoredSequence


@dataclass(frozen=True, slots=True)
class Share:
    """Positions `[start, end)` of a sequence are taken from sequence `donor`'s result."""

    donor: int  # an earlier sequence of the call
    end: int  # the common prefix's length: the sequence's own logprobs start here


def plan_shares(token_lists: list[list[int]], starts: list[int]) -> list[Share | None]:
    """Per sequence, its `Share`, or None where no earlier sequence covers one of its wanted positions."""
    root: list = [{}, 0, -1]  # a trie node: children by token, the least start through it, and that sequence
    shares: list[Share | None] = []
    for j, (ids, start) in enumerate(zip(token_lists, starts, strict=True)):
        node, best = root, None
        for depth, token in enumerate(ids, 1):
            node = node[0].get(token)
            if node is None:
                break
            if node[1] <= start:  # a sequence with this prefix wants every position this one does
                best = Share(node[2], depth)
        shares.append(best if best is not None and best.end > start else None)
        node = root
        for token in ids:
            child = node[0].get(token)
            if child is None:
                child = node[0][token] = [{}, start, j]
            elif start < child[1]:
                child[1], child[2] = start, j
            node = child
    return shares


class ShareMerge:
    """Completes the results of the sequences with a `Share` from their donors' (call order:
    a donor comes first, and may itself have one)."""

    def __init__(self, token_lists, texts, starts: list[int], shares: list[Share | None], top: int) -> None:
        self.token_lists, self.texts, self.starts, self.shares, self.top = token_lists, texts, starts, shares, top
        self.done: dict[int, ScoredSequence] = {}  # call index -> complete result
        self.own: dict[int, ScoredSequence | None] = {}  # a sharing sequence's own result, once in
        self.waiting = {j for j, s in enumerate(shares) if s is not None}  # sharing sequences not yet complete
        self.dependents: dict[int, list[int]] = {}  # donor -> the sequences sharing its prefix
        for j, share in enumerate(shares):
            if share is not None:
                self.dependents.setdefault(share.donor, []).append(j)
        self._due: list[int] = []  # waiting sequences that may have become complete

    def runs_request(self, index: int) -> bool:
        """Whether sequence `index` has positions of its own to compute."""
        share = self.shares[index]
        return share is None or share.end < len(self.token_lists[index])

    def add(self, index: int, result: ScoredSequence) -> None:
        """The result of sequence `index`'s own request; complete when it has no `Share`, and
        the result it gets scored again alone (see `resolve`)."""
        if index in self.waiting and index not in self.own:
            self.own[index] = result
            self._due.append(index)
        else:
            self._complete(index, result)

    def _complete(self, index: int, result: ScoredSequence) -> None:
        self.waiting.discard(index)
        self.own.pop(index, None)
        self.done[index] = result
        self._due.extend(self.dependents.get(index, ()))

    def resolve(self) -> list[tuple[int, ScoredSequence | None]]:
        """The sharing sequences complete now, (index, result), each once; result None: its
        own positions and its donor's are of different policy versions, so it is to be
        scored again alone, its result then given to `add`."""
        out = []
        while self._due:
            j = self._due.pop()
            donor = self.done.get(self.shares[j].donor)
            if j not in self.waiting or donor is None or (self.runs_request(j) and j not in self.own):
                continue
            merged = self.merge(j, self.own.get(j), donor)
            if merged is not None:
                self._complete(j, merged)
            else:
                self.waiting.discard(j)  # resolved once: its result scored alone goes to `add`
            out.append((j, merged))
        return out

    def merge(self, index: int, own: ScoredSequence | None, donor: ScoredSequence) -> ScoredSequence | None:
        share, start, ids = self.shares[index], self.starts[index], self.token_lists[index]
        if own is None:  # inside the donor: nothing of its own
            version, logprobs = donor.version, [None] * len(ids)
            top = [None] * len(ids) if self.top else None
        else:
            if -1 not in (own.version, donor.version) and own.version != donor.version:
                return None
            version = own.version if own.version != -1 else donor.version
            logprobs, top = list(own.logprobs), None if own.top_logprobs is None else list(own.top_logprobs)
        logprobs[start : share.end] = donor.logprobs[start : share.end]
        if top is not None and donor.top_logprobs is not None:
            top[start : share.end] = [None if d is None else dict(d) for d in donor.top_logprobs[start : share.end]]
        return ScoredSequence(list(ids), logprobs, top, version, self.texts[index], index)
