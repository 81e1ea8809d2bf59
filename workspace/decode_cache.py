"""The decode steady-state cache.

In steady state the same ordered set of sequences decodes one token per step.
The cache remembers the `TaskSignature` of the last pure-decode step: the
policy version and the ordered sequence ids. On a match, the previous step's
sampled tokens are copied device-to-device into the next step's input ids,
positions and RNG counters advance by one on the device, and the
sampling-parameter tensors are reused as they are. Any change of membership,
order or policy version rebuilds everything from the host.

`debug=True` runs the host path beside the fast one and raises if they differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .inference_workspace import InferenceWorkspace

# Buffers the fast path reuses untouched.
REUSED = ("temperature", "top_k", "top_p", "min_p", "seed", "sample_index", "mode", "logit_rows", "sample_rows")
# Buffers the fast path advances by one token on the device.
ADVANCED = ("positions", "rng_pos", "context_lens")


@dataclass(slots=True)
class DecodeRows:
    """Host-side truth for one pure-decode batch, row i = sequence i."""

    input_ids: list[int]  # each sequence's last token (the one fed this step)
    positions: list[int]  # position of that token in its sequence
    context_lens: list[int]  # positions + 1
    rng_pos: list[int]  # index of the output token about to be sampled
    sampling: dict[str, list] = field(default_factory=dict)  # the REUSED buffers' values
    in_flight: list[int] = field(default_factory=list)  # rows whose input token the device has, not the host

    def values(self) -> dict[str, list]:
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "context_lens": self.context_lens,
            "rng_pos": self.rng_pos,
            **self.sampling,
        }


@dataclass(frozen=True, slots=True)
class TaskSignature:
    """What a pure-decode step computes, as far as reusing the last step's inputs goes.

    Sequence ids are unique for the life of an engine and never recycled with
    a batch row or a KV slot, so equal ids mean the same sequences in the same
    rows: a new sequence that lands in a finished one's row changes the
    signature even when the batch keeps its size. The policy version is part
    of it because a weight commit between two steps may rewrite what the same
    sequences feed next (a restart drops their outputs, a recompute their KV):
    inputs staged under one version are never reused under another, whichever
    way the commit went.
    """

    version: int  # policy version the step runs under
    seq_ids: tuple[int, ...]  # the decoding sequences, in row order

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)


class DecodeCacheMismatch(AssertionError):
    """The fast path produced different inputs than the host path (debug mode)."""


class DecodeCache:
    """Gates device-side reuse of the last step's tokens and sampling tensors."""

    def __init__(self, workspace: InferenceWorkspace, debug: bool = False) -> None:
        self.ws = workspace
        self.debug = debug
        self._signature: TaskSignature | None = None  # of the last pure-decode step, until consumed
        self.hits = 0
        self.misses = 0

    def prepare(self, signature: TaskSignature, build: Callable[[], DecodeRows]) -> bool:
        """Fill the decode inputs for `signature`'s rows; returns True on a cache hit.

        `build` produces the host truth; it is called only on a miss or in
        debug mode. The signature is consumed: `remember` must be called
        again after the step's sampler has written `out_tokens`.
        """
        hit = signature == self._signature
        self._signature = None
        num_rows = signature.num_rows
        if hit:
            self.hits += 1
            tokens = self.ws.host_view("input_ids", num_rows)
            if tokens is not None:  # the CPU: the same in numpy, on the same memory
                tokens[:] = self.ws.host_view("out_tokens", num_rows)
                for name in ADVANCED:
                    self.ws.host_view(name, num_rows)[:] += 1
            else:
                self.ws.view("input_ids", num_rows).copy_(self.ws.view("out_tokens", num_rows))
                for name in ADVANCED:
                    self.ws.view(name, num_rows).add_(1)
            if self.debug:
                self._check(build())
            return True
        self.misses += 1
        for name, values in build().values().items():
            self.ws.upload(name, values)
        return False

    def remember(self, signature: TaskSignature) -> None:
        """Record that the last step was a pure decode of `signature` whose
        sampled tokens now sit in `out_tokens[: signature.num_rows]`."""
        self._signature = signature

    def invalidate(self) -> None:
        self._signature = None

    def _check(self, rows: DecodeRows) -> None:
        for name, values in rows.values().items():
            fast = self.ws.view(name, len(values)).cpu().clone()  # a copy: the workspace's stays as it is
            slow = torch.tensor(values, dtype=fast.dtype)
            if name == "input_ids" and rows.in_flight:  # tokens the host has not seen yet
                fast[rows.in_flight] = slow[rows.in_flight]
            if not torch.equal(fast, slow):
                raise DecodeCacheMismatch(
                    f"decode cache fast path disagrees with the host path on {name!r}: "
                    f"fast={fast.tolist()} host={slow.tolist()}"
                )
