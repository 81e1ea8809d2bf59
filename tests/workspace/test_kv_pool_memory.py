"""The CPU KV pool reserves its memory and touches it as it is written."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout.cluster.host import resident_bytes
from workspace import KVPool
from workspace.kv_pool import zero_pages

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")


def measure_a_large_pool() -> dict[str, int | bool]:
    """Builds, reads, writes and frees a 512 MiB pool; returns the resident memory at each step.

    It runs in a process of its own (`python -c`), so the only memory the
    process's resident count sees move is the pool's: threads left by other
    tests (servers, Ray's driver) cannot allocate in between.
    """
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
    out: dict[str, int | bool] = {"nbytes": pool.nbytes, "allocated": resident_bytes() - before}

    # Unwritten slots read as zeros (reads map the OS's zero page, not new memory).
    got_k, got_v = pool.gather(3, torch.tensor([[0, 4095]]))
    out["reads_zero"] = float(pool.k.abs().max()) == 0 and float(pool.v.abs().max()) == 0
    out["gathers_zero"] = not got_k.any() and not got_v.any()

    # Writing pages makes them resident: two layers of K, 128 MiB.
    out["written"] = pool.k[:2].nbytes
    start = resident_bytes()
    pool.k[:2].fill_(1.0)
    out["grown"] = resident_bytes() - start
    out["rest_zero"] = float(pool.k[2:].abs().max()) == 0 and float(pool.v.abs().max()) == 0

    # Slot writes land where gathers read them; the rest of the page stays zero.
    k = torch.full((3, 4, 64), 2.0)
    pool.write(3, torch.tensor([16, 17, 40]), k, -k)
    got_k, got_v = pool.gather(3, torch.tensor([[1, 2]]))
    out["slots_land"] = torch.equal(got_k[0, [0, 1, 24]], k) and torch.equal(got_v[0, [0, 1, 24]], -k)
    out["page_rest_zero"] = not got_k[0, 2:24].any() and not got_v[0, 25:].any()  # slot 40: page 2, offset 8

    del pool, got_k, got_v
    gc.collect()
    out["left"] = resident_bytes() - before
    return out


def test_a_large_pool_is_not_resident_until_written():
    code = (
        "import json; from tests.workspace.test_kv_pool_memory import measure_a_large_pool as m; print(json.dumps(m()))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])

    assert got["nbytes"] == 512 * MiB
    assert got["allocated"] < got["nbytes"] // 4, (
        f"allocating a 512 MiB pool made {got['allocated'] / MiB:.0f} MiB resident"
    )
    assert got["reads_zero"] and got["gathers_zero"] and got["rest_zero"]
    written, grown = got["written"], got["grown"]
    assert written * 3 // 4 <= grown <= written * 5 // 4 + 32 * MiB, (
        f"wrote {written / MiB:.0f} MiB, grew {grown / MiB:.0f}"
    )
    assert got["slots_land"] and got["page_rest_zero"]
    assert got["left"] < 64 * MiB, (
        f"{got['left'] / MiB:.0f} MiB still resident after the pool went"
    )  # the mapping is returned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_pages_is_a_contiguous_writable_zero_tensor(dtype):
    t = zero_pages((3, 5, 7), dtype, torch.device("cpu"))
    assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous() and not t.any()
    t[1, 2, 3] = 1.5
    assert float(t.sum()) == 1.5
    assert zero_pages((0, 4), dtype, torch.device("cpu")).shape == (0, 4)
