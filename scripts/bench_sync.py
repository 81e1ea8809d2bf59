"""Weight-sync benchmark (docs/benchmarks.md): push the float32 state dict of a
Qwen2-shaped model (the `bench-sync` preset of scripts/presets.py: vocab
32000, hidden 1024, intermediate 2816, 8 layers, 16 heads, 8 KV heads, tied)
to 2 rollout actors, against two in-memory copies of the same bytes timed in
the same run, and the naive `ray.put` of the dict. Then, for each in-flight
mode (`recompute`, the default, `keep`, `drain`, `restart`), pushes while both
actors decode a GRPO-shaped batch: the longest pause in token production, the
time until every sequence runs again, and the tokens recomputed and thrown
away per push.

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
from rollout import INFLIGHT_MODES, SamplingParams, generation_pause
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


def start_local_ray(store_mb: int) -> None:
    """A local Ray for 2 CPU actors and the driver, with a fixed, preallocated object store."""
    import ray

    ray.init(
        address="local",
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=store_mb * 2**20,
        _system_config={"preallocate_plasma_memory": True},
    )


def start_cluster(args):
    """A local Ray with a fixed, preallocated object store and 2 CPU actors."""
    start_local_ray(args.store_mb)
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
    modes = measure_modes(cluster, states, args.pause_pushes)
    rollout.shutdown()
    keep = modes["modes"]["keep"]
    return {
        "bytes": nbytes,
        **pushes,
        "gb_per_s": nbytes / pushes["push_s_median"] / 1e9,
        "naive_put_dict_s": naive,
        "naive_sync_efficiency": pushes["floor_two_copies_s"] / naive if naive else None,
        "median_step_s": modes["median_step_s"],
        "longest_pause_s": keep["longest_gap_s"],
        "pause_in_steps": keep["longest_gap_s"] / modes["median_step_s"],
        "push_while_generating_s": keep["push_s"],
        "inflight_modes": modes,
    }


MODE_PROMPT_TOKENS = 96  # a GRPO-like prompt: recompute shares its full pages across the group
MODE_WORKLOAD = dict(prompts=16, n=4, max_tokens=160)


def _counters(cluster) -> tuple[int, int]:
    health = cluster.health()
    return sum(h["recomputed_tokens"] for h in health), sum(h["discarded_tokens"] for h in health)


def _recovery(cluster, since: float, version: int, timeout: float = 300.0) -> float:
    """Per actor, from its last step under the old weights to its first step under
    `version` that finds no sequence waiting (every in-flight one runs again); the
    longest. Waits, bounded, until every actor is back."""
    deadline = time.monotonic() + timeout
    while True:
        spans = []
        for log in cluster.step_logs(since):
            old = [info.end_time for info in log if info.version < version]
            back = [info.end_time for info in log if info.version >= version and info.num_waiting == 0]
            spans.append(back[0] - old[-1] if old and back else None)
        if spans and None not in spans:
            return max(spans)
        assert time.monotonic() < deadline, f"actors not back to steady decoding {timeout} s after a push"
        time.sleep(0.1)


def measure_modes(cluster, states, pushes: int) -> dict:
    """For each in-flight mode, `pushes` pushes while both actors decode a
    GRPO-shaped batch: the push's latency, the longest gap between steps
    during it, the time until every sequence runs again, and the tokens
    recomputed and thrown away per push."""
    prompts = [[5 + i] + list(range(10, 10 + MODE_PROMPT_TOKENS - 1)) for i in range(MODE_WORKLOAD["prompts"])]
    params = SamplingParams(n=MODE_WORKLOAD["n"], max_tokens=MODE_WORKLOAD["max_tokens"], ignore_eos=True)
    report = {}
    for mode in INFLIGHT_MODES:
        recomputed, discarded = _counters(cluster)
        began = time.time()
        handle = cluster.submit(prompts, params)
        deadline = time.monotonic() + 120
        while not all(h.get("running", 0) for h in cluster.health()):
            assert time.monotonic() < deadline, "actors never started generating"
            time.sleep(0.05)
        time.sleep(1.0)  # steady-state decode before the first push
        windows, recoveries = [], []
        for k in range(pushes):
            start = time.time()
            version = cluster.push_weights(states[k % 2], inflight=mode)
            windows.append((start, time.time()))
            if mode != "drain":
                recoveries.append(_recovery(cluster, start - 5.0, version))
                time.sleep(0.5)
        handle.result(600)
        wall = time.time() - began
        logs = cluster.step_logs(began)
        after = _counters(cluster)
        report[mode] = {
            "push_s": statistics.median(end - start for start, end in windows),
            "push_s_max": max(end - start for start, end in windows),
            "longest_gap_s": max(generation_pause(logs, start, end) for start, end in windows),
            "recovery_s": max(recoveries) if recoveries else None,
            "recomputed_tokens_per_push": (after[0] - recomputed) / pushes,
            "discarded_tokens_per_push": (after[1] - discarded) / pushes,
            "workload_s": wall,
        }
    gaps = [b.end_time - a.end_time for log in cluster.step_logs() for a, b in zip(log, log[1:], strict=False)]
    return {"median_step_s": statistics.median(gaps), "modes": report}


def print_modes(r: dict) -> None:
    w = MODE_WORKLOAD
    print(
        f"in-flight modes, {w['prompts']} prompts of {MODE_PROMPT_TOKENS} tokens x n={w['n']}, "
        f"{w['max_tokens']} tokens each, a push 0.5 s after the last one's recovery; "
        f"median decode step {r['median_step_s'] * 1000:.1f} ms"
    )
    head = ("mode", "push ms", "gap ms", "back ms", "recomputed", "discarded", "batch s")
    print(f"{head[0]:10} " + " ".join(f"{h:>10}" for h in head[1:]))
    for mode, m in r["modes"].items():
        back = f"{m['recovery_s'] * 1000:10.0f}" if m["recovery_s"] is not None else f"{'-':>10}"
        print(
            f"{mode:10} {m['push_s_max'] * 1000:10.0f} {m['longest_gap_s'] * 1000:10.0f} {back} "
            f"{m['recomputed_tokens_per_push']:10.0f} {m['discarded_tokens_per_push']:10.0f} {m['workload_s']:10.1f}"
        )
    print(
        "push: the longest push; gap: longest time between two steps of an actor during a push; back: from "
        "an actor's last step on the old weights until no sequence waits; recomputed/discarded: tokens per push"
    )


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
    parser.add_argument("--pause-pushes", type=int, default=3, help="pushes during generation, per in-flight mode")
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
    print_modes(results["inflight_modes"])
    write_json(args.out or Path("runs/bench_sync.json"), results)


if __name__ == "__main__":
    main()
