from __future__ import annotations

import pytest
import torch

from workspace import InferenceWorkspace, KVPool, WorkspaceShape


def test_cpu_workspace_is_unpinned_and_uploads_into_fixed_buffers():
    ws = InferenceWorkspace(WorkspaceShape(32, 4, 3), "cpu")
    assert not ws.pinned
    buf = ws.buffer("input_ids")
    view = ws.upload("input_ids", [4, 5, 6])
    assert view.data_ptr() == buf.data_ptr() and view.tolist() == [4, 5, 6]
    tables = ws.upload_block_tables([[1, 2], [3]], width=2)
    assert tables.tolist() == [[1, 2], [3, 0]]
    with pytest.raises(ValueError, match="input_ids"):
        ws.upload("input_ids", list(range(33)))
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        ws.upload_block_tables([[1]], width=4)
    with pytest.raises(ValueError, match="max_rows"):
        WorkspaceShape(1, 0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_workspace_pins_host_staging():
    ws = InferenceWorkspace(WorkspaceShape(32, 4, 3), "cuda")
    assert ws.pinned
    assert ws.upload("positions", [1, 2]).device.type == "cuda"


def test_kv_pool_write_gather_and_copy_on_write_pages():
    pool = KVPool(
        num_layers=2,
        num_pages=4,
        page_size=2,
        num_kv_heads=1,
        head_dim=3,
        dtype=torch.float64,
        device=torch.device("cpu"),
    )
    assert float(pool.k.abs().sum()) == 0  # zeroed: padded reads stay finite
    k = torch.arange(9, dtype=torch.float64).view(3, 1, 3)
    pool.write(1, torch.tensor([2, 3, 6]), k, -k)  # page 1 full, page 3 offset 0
    got_k, got_v = pool.gather(1, torch.tensor([[1, 3]]))
    assert got_k.shape == (1, 4, 1, 3)
    assert torch.equal(got_k[0, :3], k) and torch.equal(got_v[0, :3], -k)
    pool.copy_pages(torch.tensor([1]), torch.tensor([0]))
    assert torch.equal(pool.k[:, 0], pool.k[:, 1]) and torch.equal(pool.v[:, 0], pool.v[:, 1])
    assert KVPool.bytes_per_token(2, 1, 3, torch.float64) == 2 * 2 * 3 * 8
