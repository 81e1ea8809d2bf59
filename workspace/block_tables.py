"""The decode rows' block tables, kept in the workspace from step to step.

Row i of the workspace's `block_tables` holds the page list of the sequence
that decodes in row i. A steady decode keeps its rows: a row's list changes
only when its sequence gets a new page (every `page_size` tokens), and a
batch change moves some rows. `BlockTables.write` compares each row's list
with a copy of what the row last received and writes (and, on CUDA, uploads)
only the rows that differ, so a step with no new page writes nothing.
Columns past a row's pages are zero, as a fresh upload leaves them.

Whoever writes rows of the buffer another way (the decode graphs' padding
rows) calls `forget` for them: a forgotten row is written again when a
sequence next decodes in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch


class BlockTables:
    """Incremental writer of the `block_tables` buffer of one workspace."""

    def __init__(self, host: torch.Tensor, dev: torch.Tensor, separate_host: bool) -> None:
        self._host_t = host  # [max_rows, max_pages] host mirror, pinned on CUDA (the device tensor on the CPU)
        self._host = host.numpy()
        self._dev = dev
        self._separate_host = separate_host
        self._rows: list[list[int] | None] = []  # per row: a copy of the list it holds; None: unknown
        self.rows_written = 0  # rows (re)written since start: a counter for tests and benchmarks

    @property
    def max_pages(self) -> int:
        return self._host.shape[1]

    def write(self, tables: Sequence[list[int]], width: int) -> torch.Tensor:
        """Rows `[0, len(tables))` hold `tables`, zero-padded; returns `[len(tables), width]` of the buffer.

        Only rows whose list differs from what they last received are written.
        """
        n = len(tables)
        if width > self.max_pages:
            raise ValueError(f"block table width {width} exceeds max_pages_per_seq {self.max_pages}")
        if n > self._host.shape[0]:
            raise ValueError(f"{n} block-table rows exceed the workspace's max_rows {self._host.shape[0]}")
        known = self._rows
        if len(known) < n:
            known.extend([None] * (n - len(known)))
        if tables != known[:n]:  # one C-level comparison when nothing changed
            changed = [i for i in range(n) if tables[i] != known[i]]
            self._write_rows(changed, [tables[i] for i in changed])
            for i in changed:
                known[i] = list(tables[i])
        return self._dev[:n, :width]

    def forget(self, start: int, stop: int) -> None:
        """Rows `[start, stop)` were written by someone else: write them again when next used."""
        for i in range(start, min(stop, len(self._rows))):
            self._rows[i] = None

    def _write_rows(self, rows: list[int], tables: list[list[int]]) -> None:
        lens = np.fromiter(map(len, tables), np.int64, len(tables))
        if lens.size and int(lens.max()) > self.max_pages:
            raise ValueError(f"a block table of {int(lens.max())} pages exceeds max_pages_per_seq {self.max_pages}")
        flat = np.fromiter(chain.from_iterable(tables), np.int64, int(lens.sum()))
        index = np.asarray(rows, dtype=np.int64)
        self._host[index] = 0
        row_of = np.repeat(index, lens)
        col_of = np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)
        self._host[row_of, col_of] = flat
        self.rows_written += len(rows)
        if self._separate_host:  # one copy of the span of changed rows (rows between them are current)
            lo, hi = rows[0], rows[-1] + 1
            self._dev[lo:hi].copy_(self._host_t[lo:hi], non_blocking=True)


def decode_slots(tables: torch.Tensor, positions: torch.Tensor, page_size: int, out: torch.Tensor) -> torch.Tensor:
    """KV slot of each decode row's token, `tables[i, p // page_size] * page_size + p % page_size`
    for `p = positions[i]`, computed on the tables' device into `out` (on the CPU in numpy:
    a handful of small torch ops would cost more than the arithmetic)."""
    if tables.device.type == "cpu":
        t, p, o = tables.numpy(), positions.numpy(), out.numpy()
        page = p // page_size
        np.multiply(t[np.arange(len(p)), page], page_size, out=o)
        o += p - page * page_size
        return out
    return device_decode_slots(tables, positions, page_size, out)


def device_decode_slots(
    tables: torch.Tensor, positions: torch.Tensor, page_size: int, out: torch.Tensor
) -> torch.Tensor:
    """`decode_slots` in torch ops on the tables' device (no host sync: the CUDA path)."""
    page = torch.div(positions, page_size, rounding_mode="floor")
    torch.mul(tables.gather(1, page[:, None]).squeeze(1), page_size, out=out)
    return out.add_(positions - page * page_size)
