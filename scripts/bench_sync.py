"""Weight-sync benchmark (docs/benchmarks.md): push the float32 state dict of a
Qwen2-shaped model (the `bench-sync` preset of scripts/presets.py: vocab
32000, hidden 1024, intermediate 2816, 8 layers, 16 heads, 8 KV heads, tied)
to 2 rollout actors, against two in-memory copies of the same bytes timed in
the same run, and the naive `ray.put` of the dict. Also the longest pause in
token production during a push against the median decode step, while both
actors generate.

    python -m scripts.bench_sync [--pushes 10] [--warmup 3] [--out runs/bench_sync.json]
    python -m scripts.bench_sync --defaults [--pushes 12] [--out runs/bench_sync_defaults.json]

`--defaults` starts the cluster with `rollout.init(path, num_actors=2)` and
nothing else, as a user would, so it measures the object store that
`rollout.init` configures for itself.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import timeit
from pathlib import Path

import torch

import rollout
from rollout import SamplingParams, generation_pause
from scripts.bench import write_json
from scripts.synthetic import qwen2_config, random_state, write_checkpoint

CONFIG = qwen2_config("bench-sync")


class CopyFloor:
    """Two in-memory copies of the push's bytes into warm buffers. Measured
    next to every timed push: this machine's memory bandwidth drifts (the
    same copy took 27 ms in one run and 45 ms in another), so a floor taken
    once would compare pushes against a different machine."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        self.dst = torch.empty_like(self.src).fill_(0)

    def seconds(self, repeats: int = 3) -> float:
        """Best of `repeats` timings of the two copies."""
        return min(timeit.repeat(self._copy_twice, repeat=repeats, number=1))

    def _copy_twice(self) -> None:
        self.dst.copy_(self.src)
        self.dst.copy_(self.src)


def naive_push_seconds(state: dict[str, torch.Tensor], actors) -> float:
    """`ray.put` of the dict of tensors, fetched by every actor (what one-call-per-dict transports do)."""
    import ray

    start = time.perf_counter()
    ref = ray.put(state)
    ray.get([a.remote(ref) for a in actors])
    return time.perf_counter() - start


def longest_pause(cluster, windows: list[tuple[float, float]]) -> dict:
    """Largest gap between consecutive steps of any actor overlapping a push, and the median gap."""
    logs = cluster.step_logs()
    gaps = [b.end_time - a.end_time for log in logs for a, b in zip(log, log[1:], strict=False)]
    longest = max(generation_pause(logs, start, end) for start, end in windows)
    median = statistics.median(gaps)
    return {
        "median_step_s": median,
        "longest_pause_s": longest,
        "pause_in_steps": longest / median,
        "push_while_generating_s": statistics.median(end - start for start, end in windows),
    }


def start_cluster(args):
    """A local Ray with a fixed, preallocated object store and 2 CPU actors."""
    import ray

    ray.init(
        address="local",
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=args.store_mb * 2**20,
        _system_config={"preallocate_plasma_memory": True},
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_sync_"))
    write_checkpoint(tmp, CONFIG)
    return rollout.init(
        tmp,
        num_actors=2,
        num_cpus_per_actor=1,
        max_seq_len=1024,
        kv_cache_tokens=16384,
        max_batch_size=64,
        timeout_s=600,
        bucket_bytes=args.bucket_mb * 2**20,
    )


def default_pushes(args) -> dict:
    """`rollout.init(path, num_actors=2)` with no Ray settings of its own; every push timed
    against the floor measured just before it, the steady state being pushes 4 onwards."""
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="bench_sync_"))
    write_checkpoint(tmp, CONFIG)
    states = [random_state(CONFIG, 1 + k) for k in range(2)]
    floor = CopyFloor(sum(t.nbytes for t in states[0].values()))
    floor.seconds()
    cluster = rollout.init(tmp, num_actors=2)
    store = ray.available_resources().get("object_store_memory")
    times, floors, puts = [], [], []
    for k in range(args.pushes):
        floors.append(floor.seconds())
        start = time.perf_counter()
        handle = cluster.push_weights(states[k % 2], wait=False)  # returns once every bucket is in the store
        puts.append(time.perf_counter() - start)
        handle.result(600)
        times.append(time.perf_counter() - start)
    rollout.shutdown()
    steady = slice(3, None)
    ratios = sorted(f / t for f, t in zip(floors[steady], times[steady], strict=True))
    return {
        "bytes": floor.src.numel(),
        "object_store_bytes": store,
        "floor_two_copies_s": statistics.median(floors[steady]),
        "floor_s_all": floors,
        "push_s_all": times,
        "put_s_all": puts,  # until every bucket is in the store; the rest is the actors' verify, prepare, commit
        "push_s_median": statistics.median(times[steady]),
        "put_s_median": statistics.median(puts[steady]),
        "sync_efficiency": statistics.median(ratios),
        "sync_efficiency_range": (ratios[0], ratios[-1]),
    }


def print_defaults_report(r: dict) -> None:
    store = r["object_store_bytes"]
    print(f"state dict: {r['bytes'] / 2**20:.0f} MiB float32, rollout.init(path, num_actors=2) defaults")
    print(f"object store available after start: {store / 2**20:.0f} MiB" if store else "object store: unknown")
    print(f"pushes 1-3:                    {', '.join(f'{t * 1000:.0f}' for t in r['push_s_all'][:3])} ms")
    steady = r["push_s_all"][3:]
    print(
        f"pushes 4-{len(r['push_s_all'])}: median {r['push_s_median'] * 1000:.1f} ms "
        f"(range {min(steady) * 1000:.0f}-{max(steady) * 1000:.0f}); "
        f"floor (two in-memory copies) {r['floor_two_copies_s'] * 1000:.1f} ms"
    )
    print(
        f"of which in the store after {r['put_s_median'] * 1000:.1f} ms (median); "
        f"the actors' verify, prepare and commit take the rest"
    )
    low, high = r["sync_efficiency_range"]
    print(f"sync_efficiency (pushes 4 on) = {r['sync_efficiency']:.3f} (range {low:.3f}-{high:.3f})")


def timed_pushes(cluster, states, floor: CopyFloor, args) -> dict:
    """Warm-up pushes, then timed ones, each against the copy floor measured just before it."""
    warmup = []
    for k in range(1 + args.warmup):  # each process touches the store's pages on first use
        start = time.perf_counter()
        cluster.push_weights(states[k % 2])
        warmup.append(time.perf_counter() - start)
    times, floors = [], []
    for k in range(args.pushes):
        floors.append(floor.seconds())
        start = time.perf_counter()
        cluster.push_weights(states[k % 2])
        times.append(time.perf_counter() - start)
    ratios = sorted(f / t for f, t in zip(floors, times, strict=True))
    return {
        "floor_two_copies_s": statistics.median(floors),
        "floor_s_all": floors,
        "first_push_s": warmup[0],
        "warmup_push_s": warmup[1:],
        "push_s_median": statistics.median(times),
        "push_s_all": times,
        "sync_efficiency": statistics.median(ratios),  # median over pushes of floor / push
        "sync_efficiency_range": (ratios[0], ratios[-1]),
    }


def run(args) -> dict:
    import ray

    cluster = start_cluster(args)
    states = [random_state(CONFIG, 1 + k) for k in range(2)]
    nbytes = sum(t.nbytes for t in states[0].values())
    floor = CopyFloor(nbytes)
    floor.seconds()
    pushes = timed_pushes(cluster, states, floor, args)
    fetch = ray.remote(num_cpus=0)(lambda ref: len(ref)).options
    naive = naive_push_seconds(states[0], [fetch(), fetch()]) if args.naive else None
    pause = measure_pause(cluster, states, args.pause_pushes)
    rollout.shutdown()
    return {
        "bytes": nbytes,
        **pushes,
        "gb_per_s": nbytes / pushes["push_s_median"] / 1e9,
        "naive_put_dict_s": naive,
        "naive_sync_efficiency": pushes["floor_two_copies_s"] / naive if naive else None,
        **pause,
    }


def measure_pause(cluster, states, pushes: int) -> dict:
    prompts = [[5 + i, 6, 7, 8] for i in range(16)]
    handle = cluster.submit(prompts, SamplingParams(n=4, max_tokens=400, ignore_eos=True))
    deadline = time.monotonic() + 120
    while not all(h.get("running", 0) for h in cluster.health()):
        assert time.monotonic() < deadline, "actors never started generating"
        time.sleep(0.05)
    time.sleep(1.0)  # steady-state decode before the first push
    windows = []
    for k in range(pushes):
        start = time.time()
        cluster.push_weights(states[k % 2], inflight="keep")
        windows.append((start, time.time()))
        time.sleep(0.5)
    handle.result(600)
    return longest_pause(cluster, windows)


def print_report(r: dict, bucket_mb: int) -> None:
    print(f"state dict: {r['bytes'] / 2**20:.0f} MiB float32, 2 actors, {bucket_mb} MiB buckets")
    print(f"floor (two in-memory copies): {r['floor_two_copies_s'] * 1000:8.1f} ms (median)")
    print(f"first push (cold buffers):     {r['first_push_s'] * 1000:8.1f} ms")
    print(f"warm-up pushes:                {', '.join(f'{t * 1000:.0f}' for t in r['warmup_push_s'])} ms")
    print(
        f"push, median of {len(r['push_s_all'])}:          {r['push_s_median'] * 1000:8.1f} ms "
        f"({r['gb_per_s']:.2f} GB/s)"
    )
    if r["naive_put_dict_s"]:
        print(
            f"naive ray.put(dict):           {r['naive_put_dict_s'] * 1000:8.1f} ms "
            f"(efficiency {r['naive_sync_efficiency']:.3f})"
        )
    low, high = r["sync_efficiency_range"]
    print(
        f"sync_efficiency = floor_time / push_time = {r['sync_efficiency']:.3f} "
        f"(median over pushes, each against the floor measured just before it; range {low:.3f}-{high:.3f})"
    )
    print(
        f"longest pause during a push: {r['longest_pause_s'] * 1000:.1f} ms = "
        f"{r['pause_in_steps']:.2f} x median decode step ({r['median_step_s'] * 1000:.1f} ms); "
        f"a push while both actors generate: {r['push_while_generating_s'] * 1000:.0f} ms (median)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_sync", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--defaults", action="store_true", help="rollout.init(path, num_actors=2) as a user would; pushes only"
    )
    parser.add_argument("--pushes", type=int, default=None, help="timed pushes (10; with --defaults all 12)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed pushes after the first")
    parser.add_argument(
        "--store-mb", type=int, default=1536, help="object store size: room for the live and the next version"
    )
    parser.add_argument("--pause-pushes", type=int, default=3, help="pushes during generation")
    parser.add_argument("--no-naive", dest="naive", action="store_false", help="skip the slow naive baseline")
    parser.add_argument("--bucket-mb", type=int, default=256, help="bucket size in MiB")
    parser.add_argument("--out", type=Path, default=None, help="runs/bench_sync.json (--defaults: _defaults.json)")
    args = parser.parse_args()
    if args.defaults:
        args.pushes = args.pushes or 12
        if args.pushes < 4:
            parser.error("--defaults needs at least 4 pushes: the steady state starts at the fourth")
        results = default_pushes(args)
        print_defaults_report(results)
        write_json(args.out or Path("runs/bench_sync_defaults.json"), results)
        return
    args.pushes = args.pushes or 10
    results = run(args)
    print_report(results, args.bucket_mb)
    write_json(args.out or Path("runs/bench_sync.json"), results)


if __name__ == "__main__":
    main()
