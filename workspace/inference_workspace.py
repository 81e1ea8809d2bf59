"""`InferenceWorkspace`: every per-step input and output tensor, allocated once
at start-up and sliced per step.

Each buffer has a device tensor and, on CUDA, a pinned host mirror: a step
writes its host-side values into the mirror and issues one asynchronous copy
per buffer. On a CPU device the host and device tensors are the same memory
and nothing is pinned (pinning needs a CUDA context and buys nothing there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .block_tables import BlockTables


@dataclass(frozen=True, slots=True)
class WorkspaceShape:
    """Upper bounds that size every buffer."""

    max_step_tokens: int  # tokens computed in one step (prefill chunks plus decodes)
    max_rows: int  # sequences sampled in one step (the engine's max_batch_size)
    max_pages_per_seq: int  # block-table width: ceil(max_seq_len / page_size)

    def __post_init__(self) -> None:
        for name in ("max_step_tokens", "max_rows", "max_pages_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# name -> (dtype, extent): "tokens" buffers are indexed by the flattened step
# tokens, "rows" buffers by sampled row; block_tables is rows x pages.
_SPEC: dict[str, tuple[torch.dtype, str]] = {
    "input_ids": (torch.int64, "tokens"),
    "positions": (torch.int64, "tokens"),
    "slot_mapping": (torch.int64, "tokens"),
    "logit_rows": (torch.int64, "rows"),  # token row whose hidden state yields logits
    "sample_rows": (torch.int64, "rows"),  # which logits row each sampled row reads
    "context_lens": (torch.int64, "rows"),  # decode rows: tokens in context incl. the new one
    "block_tables": (torch.int64, "rows_pages"),
    "temperature": (torch.float32, "rows"),
    "top_k": (torch.int64, "rows"),
    "top_p": (torch.float32, "rows"),
    "min_p": (torch.float32, "rows"),
    "seed": (torch.int64, "rows"),
    "sample_index": (torch.int64, "rows"),  # which of the request's n samples
    "rng_pos": (torch.int64, "rows"),  # index of the output token being sampled
    "mode": (torch.int64, "rows"),  # logprobs mode code, see rollout.engine.sampler
    "out_tokens": (torch.int64, "rows"),
    "out_logprobs": (torch.float32, "rows"),
    "out_covered": (torch.bool, "rows"),  # the device sampler's candidates covered the row's kept set
}

BUFFER_NAMES = tuple(_SPEC)


class InferenceWorkspace:
    """The fixed per-step buffers of one engine."""

    def __init__(self, shape: WorkspaceShape, device: torch.device | str) -> None:
        self.shape = shape
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        extents = {
            "tokens": (shape.max_step_tokens,),
            "rows": (shape.max_rows,),
            "rows_pages": (shape.max_rows, shape.max_pages_per_seq),
        }
        self._dev: dict[str, torch.Tensor] = {}
        self._host: dict[str, torch.Tensor] = {}
        self._host_np: dict[str, np.ndarray] = {}
        for name, (dtype, extent) in _SPEC.items():
            dev = torch.zeros(extents[extent], dtype=dtype, device=self.device)
            host = torch.zeros(extents[extent], dtype=dtype, pin_memory=True) if pin else dev
            self._dev[name] = dev
            self._host[name] = host
            self._host_np[name] = host.numpy()
        self._separate_host = pin
        self.tables = BlockTables(self._host["block_tables"], self._dev["block_tables"], pin)  # decode rows' tables

    @property
    def pinned(self) -> bool:
        return self._separate_host and self._host["input_ids"].is_pinned()

    def buffer(self, name: str) -> torch.Tensor:
        """The whole device buffer `name`."""
        return self._dev[name]

    def view(self, name: str, n: int) -> torch.Tensor:
        """The first `n` entries (rows) of device buffer `name`."""
        return self._dev[name][:n]

    def host_view(self, name: str, n: int) -> np.ndarray | None:
        """The first `n` entries of buffer `name` as a numpy array sharing its memory, where
        the device buffer is host memory (the CPU); None elsewhere. On the CPU a few numpy
        operations on small per-step buffers cost less than as many torch ops."""
        return None if self._separate_host or self.device.type != "cpu" else self._host_np[name][:n]

    def upload(self, name: str, values: Sequence[int] | Sequence[float] | np.ndarray) -> torch.Tensor:
        """Write `values` into the head of buffer `name` and return that device slice."""
        n = len(values)
        if n > self._host_np[name].shape[0]:
            raise ValueError(f"{name}: {n} values exceed the workspace size {self._host_np[name].shape[0]}")
        self._host_np[name][:n] = values
        if self._separate_host:
            self._dev[name][:n].copy_(self._host[name][:n], non_blocking=True)
        return self._dev[name][:n]

    def upload_block_tables(self, tables: Sequence[Sequence[int]], width: int) -> torch.Tensor:
        """Rows of page ids, zero-padded to `width` pages; returns `[len(tables), width]`.

        Padding points at page 0; readers mask by context length, so the
        padding is never attended to.
        """
        if width > self.shape.max_pages_per_seq:
            raise ValueError(f"block table width {width} exceeds max_pages_per_seq {self.shape.max_pages_per_seq}")
        host = self._host_np["block_tables"]
        n = len(tables)
        self.tables.forget(0, n)  # rows written here, not through `tables`
        host[:n, :width] = 0
        for i, row in enumerate(tables):
            host[i, : len(row)] = row
        if self._separate_host:
            self._dev["block_tables"][:n, :width].copy_(self._host["block_tables"][:n, :width], non_blocking=True)
        return self._dev["block_tables"][:n, :width]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._dev.values())
