"""The CPU KV pool reserves its memory and touches it as it is written."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from rollout.cluster.host import resident_bytes
from workspace import KVPool
from workspace.kv_pool import zero_pages

MiB = 1 << 20

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")


def test_a_large_pool_is_not_resident_until_written():
    gc.collect()
    before = resident_bytes()
    # 4 layers x 4096 pages x 16 tokens x 4 heads x 64 x float32: 256 MiB each for K and V.
    pool = KVPool(
        num_layers=4,
        num_pages=4096,
        page_size=16,
        num_kv_heads=4,
        head_dim=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert pool.nbytes == 512 * MiB
    allocated = resident_bytes() - before
    assert allocated < pool.nbytes // 4, f"allocating a 512 MiB pool made {allocated / MiB:.0f} MiB resident"

    # Unwritten slots read as zeros (reads map the OS's zero page, not new memory).
    assert float(pool.k.abs().max()) == 0 and float(pool.v.abs().max()) == 0
    got_k, got_v = pool.gather(3, torch.tensor([[0, 4095]]))
    assert not got_k.any() and not got_v.any()

    # Writing pages makes them resident: two layers of K, 128 MiB.
    written = pool.k[:2].nbytes
    start = resident_bytes()
    pool.k[:2].fill_(1.0)
    grown = resident_bytes() - start
    assert written * 3 // 4 <= grown <= written * 5 // 4 + 32 * MiB, (
        f"wrote {written / MiB:.0f} MiB, grew {grown / MiB:.0f}"
    )
    assert float(pool.k[2:].abs().max()) == 0 and float(pool.v.abs().max()) == 0

    # Slot writes land where gathers read them; the rest of the page stays zero.
    k = torch.full((3, 4, 64), 2.0)
    pool.write(3, torch.tensor([16, 17, 40]), k, -k)
    got_k, got_v = pool.gather(3, torch.tensor([[1, 2]]))
    assert torch.equal(got_k[0, [0, 1, 24]], k) and torch.equal(got_v[0, [0, 1, 24]], -k)
    assert not got_k[0, 2:24].any() and not got_v[0, 25:].any()  # slot 40: page 2, offset 8

    del pool, got_k, got_v
    gc.collect()
    assert resident_bytes() - before < 64 * MiB  # the mapping is returned when the pool goes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_pages_is_a_contiguous_writable_zero_tensor(dtype):
    t = zero_pages((3, 5, 7), dtype, torch.device("cpu"))
    assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous() and not t.any()
    t[1, 2, 3] = 1.5
    assert float(t.sum()) == 1.5
    assert zero_pages((0, 4), dtype, torch.device("cpu")).shape == (0, 4)
