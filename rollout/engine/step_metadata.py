"""A step's attention metadata: where each token's KV goes (the slot mapping)
and what each row attends to (prefill spans, the decode rows' block tables).

Prefill chunks come first in a step; their slots are computed on the host,
a chunk at a time. Decode rows (one token each, after the prefills) are the
bulk of most steps, and their inputs are on the device already: their block
tables are the workspace's persistent rows (`workspace.BlockTables`, written
only where a row's pages changed) and their slots are computed on the device
from their positions and those tables. `host_metadata` builds the same
from the host, row by row: the reference that `check` compares against
(the engine's `debug_decode_cache=True`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from workspace import DecodeCacheMismatch, InferenceWorkspace, decode_slots

from ..model.attention import AttentionMetadata, PrefillSpan
from .inflight_io import to_device
from .plan import ScheduledChunk, StepPlan


def attention_metadata(
    ws: InferenceWorkspace,
    plan: StepPlan,
    page_size: int,
    decode_kernel: Callable[..., None] | None = None,
    prefill_kernel: Callable[..., None] | None = None,
    check: bool = False,
) -> AttentionMetadata:
    """The metadata of the step of `plan`, whose input positions the workspace
    holds; with `check`, compared with `host_metadata` (raises `DecodeCacheMismatch`)."""
    ps = page_size
    prefills: list[PrefillSpan] = []
    num_prefill_tokens = 0
    if plan.pure_decode:  # the steady decode reads the plan's rows, not chunks
        tables, starts = [s.block_table for s in plan.decodes], plan.starts
    else:
        chunks = plan.chunks
        p = 0
        while p < len(chunks) and chunks[p].length != 1:  # prefill chunks come first
            p += 1
        if p:
            slots = []
            for c in chunks[:p]:
                table = np.asarray(c.seq.block_table[: -(-(c.start + c.length) // ps)], dtype=np.int64)
                positions = np.arange(c.start, c.start + c.length)
                slots.append(table[positions // ps] * ps + positions % ps)
                block = to_device(table, ws.device)  # pinned on CUDA: no wait for the step in flight
                prefills.append(PrefillSpan(num_prefill_tokens, c.length, c.start + c.length, block))
                num_prefill_tokens += c.length
            ws.upload("slot_mapping", np.concatenate(slots))
        tables, starts = [c.seq.block_table for c in chunks[p:]], [c.start for c in chunks[p:]]
    num_decodes = len(tables)
    decode_tables = context_lens = None
    if num_decodes:
        width = max(starts) // ps + 1  # pages up to each row's token
        decode_tables = ws.tables.write(tables, width)
        end = num_prefill_tokens + num_decodes
        positions, slots = ws.view("positions", end), ws.view("slot_mapping", end)
        if num_prefill_tokens:
            positions, slots = positions[num_prefill_tokens:], slots[num_prefill_tokens:]
        decode_slots(decode_tables, positions, ps, slots)
        context_lens = ws.view("context_lens", num_decodes)
    meta = AttentionMetadata(
        slot_mapping=ws.view("slot_mapping", num_prefill_tokens + num_decodes),
        prefills=prefills,
        num_prefill_tokens=num_prefill_tokens,
        num_decodes=num_decodes,
        decode_block_tables=decode_tables,
        decode_context_lens=context_lens,
        decode_kernel=decode_kernel,
        prefill_kernel=prefill_kernel,
    )
    if check:
        _check(meta, host_metadata(plan.chunks, ps))
    return meta


def host_metadata(chunks: list[ScheduledChunk], page_size: int) -> tuple[list[int], list[list[int]]]:
    """The slot of every token and each decode row's pages up to the step's width
    (zero-padded), computed row by row from the sequences' block tables."""
    ps = page_size
    slots: list[int] = []
    decode_tables: list[list[int]] = []
    for c in chunks:
        table = c.seq.block_table
        slots.extend(table[p // ps] * ps + p % ps for p in range(c.start, c.start + c.length))
        if c.length == 1:
            decode_tables.append(table)
    width = max((c.start // ps + 1 for c in chunks if c.length == 1), default=0)
    return slots, [(t[:width] + [0] * width)[:width] for t in decode_tables]


def _check(meta: AttentionMetadata, host: tuple[list[int], list[list[int]]]) -> None:
    slots, tables = host
    got_slots = meta.slot_mapping.cpu().tolist()
    got_tables = [] if meta.decode_block_tables is None else meta.decode_block_tables.cpu().tolist()
    for name, got, want in (("slot_mapping", got_slots, slots), ("block_tables", got_tables, tables)):
        if got != want:
            raise DecodeCacheMismatch(
                f"device-built attention metadata disagrees with the host's on {name!r}: device={got} host={want}"
            )
