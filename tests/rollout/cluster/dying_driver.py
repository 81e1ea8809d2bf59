"""A trainer process for test_driver_death: it joins a running Ray by
address, starts a one-actor cluster and, once told to go on, pushes weights;
once the actor holds every bucket of the push, before it is prepared or
committed, it reports and waits to be killed.

    python -m tests.rollout.cluster.dying_driver GCS_ADDRESS CHECKPOINT REPORT_DIR

Each report is a JSON file in REPORT_DIR, written whole (renamed into place):
`started.json` (the actors' ids and pids, the placement group's id) and
`staged.json` (the bytes the push put in the object store). It pushes once
REPORT_DIR holds a file named `go`."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import ray
from safetensors.torch import load_file

from rollout import RolloutCluster
from rollout.cluster.actor_pool import ActorPool

CLUSTER = dict(
    num_actors=1,
    num_cpus_per_actor=1,
    max_seq_len=128,
    kv_cache_tokens=1024,
    max_batch_size=8,
    timeout_s=60,
    bucket_bytes=128 * 1024,
)


def report(folder: Path, name: str, **fields) -> None:
    tmp = folder / f"{name}.tmp"
    tmp.write_text(json.dumps(fields))
    tmp.rename(folder / f"{name}.json")


def stop_once_staged(folder: Path) -> None:
    """Make this process stop for good right after its actors received every bucket of a push."""
    collect, put, buckets = ActorPool.collect, ray.put, []

    def put_and_record(value, **kwargs):
        buckets.append(sum(segment.nbytes for segment in value))
        return put(value, **kwargs)

    def collect_then_stop(self, calls, what, timeout=None, **kwargs):
        out = collect(self, calls, what, timeout, **kwargs)
        if what.startswith("receiving weight push"):
            report(folder, "staged", buckets=buckets, received=[repr(r) for _, r in out])
            threading.Event().wait()  # until killed
        return out

    ray.put, ActorPool.collect = put_and_record, collect_then_stop


def main(address: str, checkpoint: str, folder: Path) -> None:
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    cluster = RolloutCluster(checkpoint, **CLUSTER)
    state = {k: v * 1.01 for k, v in load_file(str(Path(checkpoint) / "model.safetensors")).items()}
    health = cluster.health()
    report(
        folder,
        "started",
        actors=[slot.handle._actor_id.hex() for slot in cluster._slots],
        pids=[h["pid"] for h in health],
        placement_group=cluster._pool._pg.id.hex(),
    )
    deadline = time.monotonic() + 60
    while not (folder / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("never told to push")
        time.sleep(0.01)
    stop_once_staged(folder)
    cluster.push_weights(state)
    raise AssertionError("the push was meant to stop before it committed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
