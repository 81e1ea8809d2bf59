"""The decode rows' persistent block tables: a row is written only when its
page list changed, padded with zeros, and rewritten after someone else wrote
it; decode slots computed on the device against hand-computed ones."""

from __future__ import annotations

import pytest
import torch

from rollout.engine.decode_graphs import DecodeGraphs
from rollout.engine.sampler import SamplerFlags
from workspace import InferenceWorkspace, WorkspaceShape, decode_slots
from workspace.block_tables import device_decode_slots


def test_only_changed_rows_are_written_and_padding_is_zero():
    ws = InferenceWorkspace(WorkspaceShape(64, 4, 5), "cpu")
    ws.buffer("block_tables").fill_(9)  # stale values a fresh row must not show
    tables = [[3, 1], [7], [2, 4, 6]]
    assert ws.tables.write(tables, 3).tolist() == [[3, 1, 0], [7, 0, 0], [2, 4, 6]]
    assert ws.tables.rows_written == 3
    assert ws.tables.write(tables, 3).tolist() == [[3, 1, 0], [7, 0, 0], [2, 4, 6]]
    assert ws.tables.rows_written == 3  # nothing changed: nothing written
    tables[1].append(8)  # a new page, in place, as the KV manager appends
    assert ws.tables.write(tables, 2).tolist() == [[3, 1], [7, 8], [2, 4]]
    assert ws.tables.rows_written == 4
    tables = [[3, 1], [5], [2, 4, 6], [0, 11]]  # row 1 gets another, shorter list; row 3 joins
    assert ws.tables.write(tables, 3).tolist() == [[3, 1, 0], [5, 0, 0], [2, 4, 6], [0, 11, 0]]
    assert ws.tables.rows_written == 6
    assert ws.buffer("block_tables")[1].tolist() == [5, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        ws.tables.write(tables, 6)
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        ws.tables.write([[1] * 6], 1)
    with pytest.raises(ValueError, match="max_rows"):
        ws.tables.write([[1]] * 5, 1)


def test_rows_padded_by_a_decode_graph_are_written_again():
    ws = InferenceWorkspace(WorkspaceShape(64, 4, 3), "cpu")
    graphs = DecodeGraphs("eager", ws, lambda key: None, scratch_page=30, page_size=16)
    tables = [[1], [2], [3], [4, 5]]
    ws.tables.write(tables, 2)
    plain = SamplerFlags(False, False, False)
    graphs.run(3, graphs.key(3, 1, plain))  # row 3 becomes padding: the scratch page
    assert ws.buffer("block_tables")[3].tolist() == [30, 30, 30]
    assert ws.tables.write(tables, 2).tolist() == [[1, 0], [2, 0], [3, 0], [4, 5]]
    ws.upload_block_tables([[6]], 1)  # a write that bypasses the record: row 0 is written again too
    assert ws.tables.write(tables, 2)[0].tolist() == [1, 0]


@pytest.mark.parametrize("slots", [decode_slots, device_decode_slots], ids=["host", "torch_ops"])
def test_decode_slots_from_positions_and_tables(slots):
    tables = torch.tensor([[3, 1, 0], [7, 8, 0], [2, 4, 6]])
    positions = torch.tensor([17, 4, 40])
    out = torch.empty(3, dtype=torch.int64)
    slots(tables, positions, 16, out)
    assert out.tolist() == [1 * 16 + 1, 7 * 16 + 4, 6 * 16 + 8]
    # A strided view of a wider buffer, as the workspace hands out, into a slice of a larger output.
    g = torch.Generator().manual_seed(0)
    buffer = torch.randint(0, 100, (8, 6), generator=g)
    positions = torch.randint(0, 4 * 16, (5,), generator=g)
    out = torch.full((7,), -1)
    slots(buffer[:5, :4], positions, 16, out[2:])
    want = [int(buffer[i, p // 16]) * 16 + p % 16 for i, p in enumerate(positions.tolist())]
    assert out[2:].tolist() == want and out[:2].tolist() == [-1, -1]
