"""Time to recover from a hung rollout actor: a local 2-actor CPU cluster on a
small synthetic checkpoint generates, one actor is stopped (SIGSTOP: alive to
the OS, silent to Ray) while it holds its share, and the drill reports when
the watchdog replaced it, when the generation returned every prompt and when
the replacement served. The hang bounds are the cluster's defaults unless given.

    python -m scripts.hang_drill [--ping-interval 5] [--liveness-timeout 30] [--progress-timeout 60]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import time
from pathlib import Path

from rollout import RolloutCluster, SamplingParams
from scripts.synthetic import qwen2_config, write_checkpoint

CLUSTER = dict(num_actors=2, num_cpus_per_actor=1, device="cpu", max_seq_len=128, kv_cache_tokens=4096)


def drill(ping_interval_s: float, liveness_timeout_s: float, progress_timeout_s: float) -> dict[str, float]:
    """Seconds from the stop to: the actor killed as hung, the generation returning, every actor alive."""
    path = Path(tempfile.mkdtemp(prefix="hang_drill_"))
    write_checkpoint(path, qwen2_config("soak"), seed=0)
    bounds = dict(
        ping_interval_s=ping_interval_s, liveness_timeout_s=liveness_timeout_s, progress_timeout_s=progress_timeout_s
    )
    cluster = RolloutCluster(path, **CLUSTER, **bounds)
    try:
        victim = cluster._slots[0]
        pid = victim.pid
        params = SamplingParams(n=2, max_tokens=96, ignore_eos=True, seed=1)
        handle = cluster.submit([[3 + (i * k) % 90 for i in range(24)] for k in range(1, 17)], params)
        while not cluster.health()[0].get("running"):
            time.sleep(0.01)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            while victim.state == "alive" and victim.generation == 0:
                time.sleep(0.01)
            detected = time.monotonic() - stopped
            outs = handle.result(600)
            returned = time.monotonic() - stopped
            cluster.wait_until_healthy(600)
            healthy = time.monotonic() - stopped
        finally:
            _kill_if_stopped(pid)
        assert sorted(o.index for o in outs) == list(range(len(outs)))
        return {"hang detected, actor killed": detected, "generate returned": returned, "every actor alive": healthy}
    finally:
        cluster.shutdown()


def _kill_if_stopped(pid: int) -> None:
    """Kill `pid` if it is still stopped (the drill failed before the cluster killed it)."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                os.kill(pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.hang_drill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ping-interval", type=float, default=5.0)
    parser.add_argument("--liveness-timeout", type=float, default=30.0)
    parser.add_argument("--progress-timeout", type=float, default=60.0)
    args = parser.parse_args()
    times = drill(args.ping_interval, args.liveness_timeout, args.progress_timeout)
    for what, seconds in times.items():
        print(f"{what}: {seconds:.1f} s after the stop")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
