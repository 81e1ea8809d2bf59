"""What lets a step be launched before the last one's tokens are read back
(`rollout.engine.pipeline`): the staging of a launched step's tokens and
logprobs, the device-side feed of tokens the host has not seen, and the fence
that keeps the host from rewriting pinned inputs a queued copy still reads.

On the CPU there is nothing to wait for: staging is a copy and the fence a no-op."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Values
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from workspace import InferenceWorkspace

from .sequence import Sequence

if TYPE_CHECKING:
    from .stepper import RowExtras


class Launched(NamedTuple):
    """A launched step: where its tokens and logprobs are read from once `ready`."""

    num_rows: int
    tokens: torch.Tensor  # the workspace's out buffer, or a staging copy when collected later
    logprobs: torch.Tensor
    ready: torch.cuda.Event | None  # recorded after the staging copy (CUDA); None: readable now
    version: int
    extras: RowExtras
    needs_host: bool  # its rows' next step reads their tokens on the host: penalties, grammars, scored prompts


class Staging:
    """Two (tokens, logprobs) staging buffers, used in turn (pinned on CUDA), and
    an event after each step's host-to-device input copies."""

    def __init__(self, workspace: InferenceWorkspace) -> None:
        self.ws = workspace
        self._cuda = workspace.device.type == "cuda"
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # allocated at the first staged step
        self._next = 0
        self._uploads_read: torch.cuda.Event | None = None

    def stage(self, tokens: torch.Tensor, logprobs: torch.Tensor):
        """Copy a step's tokens and logprobs to the next buffer (on CUDA without waiting,
        with an event that says when they landed): `(tokens, logprobs, event or None)`."""
        if not self._buffers:
            rows = self.ws.buffer("out_tokens").shape[0]
            pin = self._cuda
            self._buffers = [
                (torch.empty(rows, dtype=torch.int64, pin_memory=pin), torch.empty(rows, pin_memory=pin))
                for _ in range(2)
            ]
        staged_tokens, staged_logprobs = self._buffers[self._next]
        self._next ^= 1
        n = tokens.shape[0]
        staged_tokens[:n].copy_(tokens, non_blocking=self._cuda)
        staged_logprobs[:n].copy_(logprobs, non_blocking=self._cuda)
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record()
        return staged_tokens, staged_logprobs, ready

    def uploaded(self) -> None:
        """Mark the end of a step's input copies (pinned host buffers -> device)."""
        if self.ws.pinned:
            self._uploads_read = torch.cuda.Event()
            self._uploads_read.record()

    def wait_for_uploads(self) -> None:
        """Wait until the last step's input copies have run: the host may then rewrite
        their pinned buffers. Usually they have: the device runs that step meanwhile."""
        if self._uploads_read is not None:
            self._uploads_read.synchronize()


def feed_in_flight(
    ws: InferenceWorkspace, spans: Iterable[tuple[Sequence, int, int]], last_samplers: list[Sequence]
) -> None:
    """Rows whose input is a token the last launched step sampled (its result not
    collected yet) take it from that step's out buffer (`last_samplers` are its rows), on
    the device. `spans`: the step's `(sequence, start, length)` in order (`StepPlan.spans`)."""
    dst, src, offset, rows = [], [], 0, None
    for seq, start, length in spans:
        offset += length
        if seq.pending and start + length > seq.num_tokens:  # its last input is still on the device
            if rows is None:
                rows = {s.seq_id: r for r, s in enumerate(last_samplers)}
            dst.append(offset - 1)
            src.append(rows[seq.seq_id])
    if dst:
        sampled = ws.buffer("out_tokens").index_select(0, to_device(src, ws.device))
        ws.buffer("input_ids").index_copy_(0, to_device(dst, ws.device), sampled)


def to_device(values: Values[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`; on CUDA copied from pinned memory
    without waiting (a plain copy from pageable memory waits for the device)."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
