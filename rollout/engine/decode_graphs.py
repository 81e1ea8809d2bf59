"""CUDA graphs for the steady-state decode step.

A pure-decode step (every scheduled sequence decodes one token) of `B` rows
whose block tables are `W` pages wide replays the graph captured for the
smallest batch bucket >= B (1, 2, 4, then every 8 rows: `row_buckets`) and
width bucket >= W (powers of two), over the workspace's fixed
buffers: the decode cache has already put the step's inputs there, so the
step costs one replay instead of hundreds of kernel launches. Rows past `B`
are padding: each writes its key to the pool's scratch page, attends to that
one key, and its sample is never read. Real rows compute what the eager path
computes up to floating-point rounding (a padded batch can pick other GEMM
kernels). Graphs are captured on first use and share one memory pool; the
sampler's host-side flags are part of the key, as they pick its branches.

Modes: "cuda" captures and replays; "eager" runs the same padded, bucketed
step without capturing, which checks the bookkeeping on any device (the CPU
tests do) and is the bit-exact reference for a replay; "off" leaves every
step to the eager path; "auto" (the default) is "cuda" on a CUDA device and
"off" elsewhere (the GPU figures in docs/benchmarks.md compare the two).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workspace import InferenceWorkspace

from .sampler import SamplerFlags

MODES = ("auto", "off", "eager", "cuda")

# Values of the padding rows: a harmless sample that nobody reads.
_PAD_VALUES = {
    "input_ids": 0,
    "positions": 0,
    "context_lens": 1,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "seed": 0,
    "sample_index": 0,
    "rng_pos": 0,
    "mode": 0,
}


def resolve_mode(mode: str, device: torch.device) -> str:
    """`mode` checked for `device`, "auto" resolved to "cuda" on a CUDA device
    and "off" elsewhere; raises `ValueError` for an unknown mode or "cuda" off CUDA."""
    if mode not in MODES:
        raise ValueError(f"decode_graphs must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "cuda" if device.type == "cuda" else "off"
    if mode == "cuda" and device.type != "cuda":
        raise ValueError(f"decode_graphs='cuda' needs a CUDA device, got {device}")
    return mode


@dataclass(frozen=True, slots=True)
class GraphKey:
    """What one captured graph computes."""

    rows: int  # batch bucket: rows the graph decodes, padding included
    pages: int  # block-table width bucket
    flags: SamplerFlags  # the sampler's branches, fixed in a captured graph


def buckets(limit: int) -> tuple[int, ...]:
    """Powers of two below `limit`, then `limit`: 1, 2, 4, ..., limit (the block-table widths)."""
    out, size = [], 1
    while size < limit:
        out.append(size)
        size *= 2
    return (*out, limit)


ROW_STEP = 8  # batch buckets past 8 rows are this far apart


def row_buckets(limit: int) -> tuple[int, ...]:
    """Batch buckets: 1, 2, 4, then every 8 rows (8, 16, 24, ...) below `limit`, then `limit`
    (vLLM's capture sizes): a step pads at most 7 rows, where powers of two pad up to half the batch."""
    out = [s for s in (1, 2, 4) if s < limit] + list(range(ROW_STEP, limit, ROW_STEP))
    return (*out, limit)


def bucket_for(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n, or None when n exceeds them all."""
    return next((s for s in sizes if s >= n), None)


class DecodeGraphs:
    """Picks a step's graph, pads the workspace to it, and replays (or runs) it.

    `forward(key)` runs one padded decode step over the first `key.rows`
    rows of the workspace, writing `out_tokens` and `out_logprobs`. With
    `fixed_width`, every graph reads the block tables at their full width
    (the attention kernel stops at each row's context length), so the table
    width is not part of a graph's key.
    """

    def __init__(
        self,
        mode: str,
        workspace: InferenceWorkspace,
        forward: Callable[[GraphKey], None],
        scratch_page: int,
        page_size: int,
        max_graphs: int = 128,
        fixed_width: bool = False,
    ) -> None:
        if mode not in ("eager", "cuda"):
            raise ValueError(f"DecodeGraphs runs in mode 'eager' or 'cuda', got {mode!r}")
        self.mode = mode
        self.ws = workspace
        self._forward = forward
        self.scratch_page = scratch_page
        self.scratch_slot = scratch_page * page_size
        self.row_buckets = row_buckets(workspace.shape.max_rows)
        self.page_buckets = buckets(workspace.shape.max_pages_per_seq)
        if fixed_width:  # attention reads tables of any width (stopping at each row's length): one bucket
            self.page_buckets = self.page_buckets[-1:]
        self.max_graphs = max_graphs
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._failed: dict[GraphKey, str] = {}  # keys whose capture failed: served eagerly, with why
        self._pool = None
        self._iota = torch.arange(workspace.shape.max_rows, device=workspace.device)
        self._padded: tuple[int, int] | None = None  # (rows, bucket) the padding rows are laid out for
        self.replays = 0  # steps served by a captured graph (or its eager stand-in)
        self.eager_steps = 0  # steps the eager forward served instead: prefill chunks, or no graph for the step
        self.eager_decodes = 0  # of those, pure decodes (penalties, beyond the buckets or the graph budget)

    def key(self, rows: int, width: int, flags: SamplerFlags) -> GraphKey | None:
        """The graph for a step of `rows` rows and `width`-page block tables;
        None when the step is beyond the buckets or the graph budget."""
        r, p = bucket_for(rows, self.row_buckets), bucket_for(width, self.page_buckets)
        if r is None or p is None:
            return None
        key = GraphKey(r, p, flags)
        if key in self._failed:
            return None
        if self.mode == "cuda" and key not in self._graphs and len(self._graphs) >= self.max_graphs:
            return None
        return key

    def run(self, rows: int, key: GraphKey) -> None:
        """Pad the workspace from `rows` rows up to `key`, then replay."""
        if self._padded != (rows, key.rows):
            self.pad(rows, key)
        graph = self._graphs.get(key) or (self._capture(key) if self.mode == "cuda" else None)
        if graph is not None:
            graph.replay()
        else:
            self._forward(key)  # "eager", or a capture that failed: the same padded step, uncaptured
        self.replays += 1

    def pad(self, rows: int, key: GraphKey) -> None:
        """Rows `[rows, key.rows)` become padding. They stay valid until a
        step of another shape writes the workspace (`invalidate`): decode
        steps of the same row count write only rows `[0, rows)`. Block-table
        columns past a real row's width hold older page ids (or the scratch
        page), which its context length masks out."""
        if rows < key.rows:
            pad = slice(rows, key.rows)
            for name, value in _PAD_VALUES.items():
                self.ws.buffer(name)[pad] = value
            self.ws.buffer("slot_mapping")[pad] = self.scratch_slot
            self.ws.buffer("logit_rows")[pad] = self._iota[pad]
            self.ws.buffer("block_tables")[pad, : self.page_buckets[-1]] = self.scratch_page
            self.ws.tables.forget(rows, key.rows)  # the decode rows' tables are written again when used
        self._padded = (rows, key.rows)

    def ran_eagerly(self, decode: bool) -> None:
        """A step ran outside the graphs (`decode`: a pure decode): count it, and pad again
        before the next replay, as its uploads may have overwritten the padding rows."""
        self.eager_steps += 1
        self.eager_decodes += decode
        self.invalidate()

    def invalidate(self) -> None:
        """A step outside the graphs wrote the workspace: pad again before the next replay."""
        self._padded = None

    def release(self) -> None:
        """Drop every captured graph and their memory pool (the KV pool they point into is freed)."""
        self._graphs.clear()
        self._pool = None
        self._padded = None

    def _capture(self, key: GraphKey) -> torch.cuda.CUDAGraph | None:
        """Capture `key`'s graph; None (and that key stays eager) if capture fails.

        Other threads may use the device meanwhile (a weight update stages
        on a control thread): "thread_local" capture only forbids unsafe
        calls on this thread, where the global default would fail them all.
        """
        # Warm up on a side stream first (lazy library initialisation must
        # not happen under capture); both runs compute the same values.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(key)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._forward(key)
        except RuntimeError as e:
            # When ending a failed capture raises, torch.cuda.graph never leaves
            # its capture stream: make this thread's stream current again, so
            # later steps stay ordered with work on it (weight commits).
            torch.cuda.set_stream(stream)
            self._failed[key] = str(e)
            warnings.warn(f"decode graph {key} could not be captured, served eagerly: {e}", stacklevel=2)
            return None
        self._graphs[key] = graph
        return graph

    @property
    def capture_failures(self) -> dict[GraphKey, str]:
        return dict(self._failed)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


def graph_stats(graphs: DecodeGraphs | None) -> dict[str, int]:
    """Counters for `Engine.stats()`; zeros when the engine runs without graphs."""
    return {
        "decode_graph_replays": graphs.replays if graphs else 0,
        "decode_graph_eager_steps": graphs.eager_steps if graphs else 0,
        "decode_graph_eager_decodes": graphs.eager_decodes if graphs else 0,
        "decode_graphs_captured": graphs.num_graphs if graphs else 0,
        "decode_graph_capture_failures": len(graphs.capture_failures) if graphs else 0,
    }
