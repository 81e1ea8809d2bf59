"""Weight pushes beyond full ones (docs/weight_sync.md), each against a full
push in the same run: delta pushes after real AdamW steps on float32 master
weights at several learning rates (bytes, time, changed fraction), LoRA
adapter pushes against a full push of the merged weights, and sleep/wake of
an in-process engine (memory freed, time to sleep and to wake).

The model is the `bench-sync` preset (Qwen2-shaped, 123M parameters,
tied), served in bfloat16 by 2 actors of one CPU each. Gradients are random
normals: the optimizer's update is AdamW's own, its size set by the
learning rate, which is what decides how many bf16 values change.

Each push's wall time comes with its CPU time in the driver and the actors
(every thread's, from /proc): on a shared host the wall time follows the
load, the CPU time much less. After the delta pushes, full and delta pushes
at the last learning rate go in turn on the same cluster, so a load that
drifts over the run weighs on both alike.

With `--nodes 2` the local Ray is two nodes on this host
(`ray.cluster_utils.Cluster`): the driver's node runs no actor and both
actors run on the second, so every bucket crosses from one node's object
store to the other's, as it does for an actor on another machine (at this
host's loopback speed, not a network's). `--parts` picks what to run;
`phases` (not run by default) times the parts of whole and delta pushes
at the first learning rate in this process, without Ray or a transfer:
the trainer's encoding, packing, an actor's receipt (checksums), phase one
and commit, and the update of the trainer's copy.

    python -m scripts.bench_sync_kinds [--pushes 4] [--lrs 1e-6,1e-5,1e-4,1e-3] [--rank 16] \
        [--nodes 1] [--parts delta,lora,sleep] [--out runs/bench_sync_kinds.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import rollout
from rollout.cluster.host import resident_bytes
from scripts.bench import write_json
from scripts.bench_sync import start_local_ray
from scripts.host import describe
from scripts.synthetic import qwen2_config, random_state, write_checkpoint

CONFIG = qwen2_config("bench-sync")
BF16 = torch.bfloat16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Trainer:
    """float32 master weights and AdamW with random gradients."""

    def __init__(self, state: dict[str, torch.Tensor], seed: int = 0) -> None:
        self.params = {k: torch.nn.Parameter(v.clone()) for k, v in state.items()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=1e-5, weight_decay=0.0)
        self.g = torch.Generator().manual_seed(seed)

    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.g)
        self.opt.step()

    def cast(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().to(BF16) for k, p in self.params.items()}


def cpu_seconds(pids: list[int]) -> float:
    """CPU time so far of every thread of `pids` (Linux `/proc/PID/task/*/schedstat`, in ns)."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
                pass
    return total / 1e9


def _push(cluster, state, delta: bool = False) -> dict:
    pids = [os.getpid(), *(slot.pid for slot in cluster._slots)]  # the driver and the actors: all on this host
    cpu = cpu_seconds(pids)
    cluster.push_weights(state, delta=delta)
    cpu = cpu_seconds(pids) - cpu
    c = cluster.last_push
    return dict(
        seconds=c.seconds,
        cpu_s=cpu,
        bytes_sent=c.bytes_sent,
        bytes_full=c.bytes_full,
        changed=c.changed_fraction,
        encoding=c.encoding,
        tensors=c.tensors,
    )


def bench_delta(cluster, trainer: Trainer, lrs: list[float], pushes: int) -> dict:
    for _ in range(2):  # warm-up: the store's and the scratch segments' pages
        trainer.step(lrs[0])
        _push(cluster, trainer.cast())
    full = []
    for _ in range(pushes):
        trainer.step(lrs[0])
        full.append(_push(cluster, trainer.cast()))
    out = {"full": full, "delta": {}}
    _push(cluster, trainer.cast(), delta=True)  # fills the copy deltas are taken against (a whole push)
    for lr in lrs:
        runs = []
        for _ in range(pushes):
            trainer.step(lr)
            runs.append(_push(cluster, trainer.cast(), delta=True))
        out["delta"][str(lr)] = runs
    # At the last learning rate, full and delta pushes in turn on the same cluster, so a load that drifts
    # over the run weighs on both alike. A full push here keeps the trainer's copy too (by store views).
    out["alternating"] = {"lr": lrs[-1], "full": [], "delta": []}
    for _ in range(pushes):
        for kind in ("full", "delta"):
            trainer.step(lrs[-1])
            out["alternating"][kind].append(_push(cluster, trainer.cast(), delta=kind == "delta"))
    out["reference_bytes"] = cluster.reference_bytes
    return out


def adapters(rank: int, seed: int) -> dict[str, torch.Tensor]:
    h, i = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    kv = CONFIG["num_key_value_heads"] * (h // CONFIG["num_attention_heads"])
    shapes = dict(
        q_proj=(h, h), k_proj=(kv, h), v_proj=(kv, h), o_proj=(h, h), gate_proj=(i, h), up_proj=(i, h), down_proj=(h, i)
    )
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        for proj, (rows, cols) in shapes.items():
            part = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
            name = f"model.layers.{layer}.{part}.{proj}.weight"
            out[name + "@lora.A"] = torch.randn(rank, cols, generator=g) * 0.01
            out[name + "@lora.B"] = torch.randn(rows, rank, generator=g) * 0.01
            out[name + "@lora.scaling"] = torch.tensor([2.0], dtype=torch.float64)
    return out


def merged(base: dict[str, torch.Tensor], lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(base)
    for key in lora:
        if key.endswith("@lora.A"):
            name = key.removesuffix("@lora.A")
            delta = lora[name + "@lora.B"] @ lora[key] * float(lora[name + "@lora.scaling"])
            out[name] = (base[name].float() + delta).to(BF16)
    return out


def bench_lora(cluster, base: dict[str, torch.Tensor], rank: int, pushes: int) -> dict:
    """Rounds of four pushes: the merged model whole (which drops the actors'
    adapter bases; the trainer's merge that makes it is timed apart), a
    first adapter push over it (its live weights become the bases), then
    two later adapter pushes (merged from the kept bases, as in a LoRA
    training loop; from the second on, into the staging buffers the one
    before freed). The first round warms up."""
    kinds = ("full_merged", "lora_first", "lora_second", "lora")
    out = {"rank": rank, **{kind: [] for kind in kinds}}
    for k in range(pushes + 1):
        lora = adapters(rank, seed=k)
        start = time.perf_counter()
        whole = merged(base, lora)  # what a trainer pushing the merged model computes first
        merge_s = time.perf_counter() - start
        runs = [
            {**_push(cluster, whole), "trainer_merge_s": merge_s},
            _push(cluster, adapters(rank, seed=1000 + k)),
            _push(cluster, adapters(rank, seed=2000 + k)),
            _push(cluster, lora),
        ]
        if k:
            for kind, run in zip(kinds, runs, strict=True):
                out[kind].append(run)
    return out


def bench_sleep(path: Path, state: dict[str, torch.Tensor]) -> dict:
    engine = rollout.Engine(
        path, device="cpu", dtype="bfloat16", max_batch_size=64, max_seq_len=1024, kv_cache_tokens=65536
    )
    engine.kv_pool.k.fill_(0)  # the pool resident, as after long use
    engine.kv_pool.v.fill_(0)
    weights = sum(p.nbytes for p in engine.model.parameters())
    kv = engine.kv_pool.nbytes
    out = {"weights_bytes": weights, "kv_bytes": kv}
    for level in (1, 2):
        before = resident_bytes()
        start = time.perf_counter()
        engine.sleep(level)
        out[f"sleep{level}_s"] = time.perf_counter() - start
        out[f"sleep{level}_freed_bytes"] = before - resident_bytes()
        if level == 2:
            start = time.perf_counter()
            engine.update_weights(state)
            out["push_after_level2_s"] = time.perf_counter() - start
        start = time.perf_counter()
        engine.wake_up()
        out[f"wake{level}_s"] = time.perf_counter() - start
        engine.kv_pool.k.fill_(0)
        engine.kv_pool.v.fill_(0)
    engine.close()
    return out


def bench_phases(path: Path, trainer: Trainer, lr: float, pushes: int) -> dict:
    """Seconds of each part of `pushes` whole, then `pushes` delta, pushes into
    one in-process actor; the first of each kind warms up and is left out."""
    from rollout.cluster.actor import RolloutWorker
    from rollout.cluster.wire import Manifest
    from rollout.cluster.wire_receive import assemble
    from rollout.cluster.wire_send import BucketPacker
    from rollout.engine.delta_encoder import DeltaEncoder

    engine = dict(device="cpu", dtype="bfloat16", max_batch_size=8, max_seq_len=128, kv_cache_tokens=1024)
    worker, encoder, packer = RolloutWorker(path, engine), DeltaEncoder(), BucketPacker()
    out, version = {"whole": [], "delta": []}, 0
    for n, delta in enumerate([False] * (pushes + 1) + [True] * (pushes + 1)):
        trainer.step(lr)
        state, times, push_id = trainer.cast(), {}, f"phases-{n}"
        start = time.perf_counter()
        encoded = encoder.encode(state, version, delta)  # whole: the copy of every tensor the trainer keeps
        times["encode_s"] = _lap(start)
        start = time.perf_counter()
        packed = list(packer.pack_buckets(encoded.state_dict))
        manifest = Manifest(tuple(e for p in packed for e in p.entries), tuple(p.nbytes for p in packed))
        times["pack_s"] = _lap(start)
        buckets = [assemble([seg.copy() for seg in p.segments])[0] for p in packed]  # one run, as a store lays it
        start = time.perf_counter()
        for p, bucket in zip(packed, buckets, strict=True):
            worker.stage_bucket(push_id, p.index, p.entries, [bucket], checksums=True)
        times["receive_s"] = _lap(start)
        start = time.perf_counter()
        worker.prepare_push(push_id, manifest)
        times["prepare_s"] = _lap(start)
        start = time.perf_counter()
        version = worker.commit_push(push_id, version + 1, "keep")
        times["commit_s"] = _lap(start)
        start = time.perf_counter()
        encoder.commit(encoded)
        times["copy_update_s"] = _lap(start)
        times["bytes_sent"], times["changed"] = encoded.cost.bytes_sent, encoded.cost.changed_fraction
        if n % (pushes + 1):
            out["delta" if delta else "whole"].append(times)
    worker.engine.close()
    return out


def _lap(start: float) -> float:
    return time.perf_counter() - start


def bench_cluster(args, path: Path, trainer: Trainer, lrs: list[float], parts: set[str]) -> dict:
    """The pushes through a cluster of 2 CPU actors: delta and LoRA against full."""
    import ray

    nodes = start_ray(args.nodes, args.store_mb)
    cluster = rollout.init(
        path,
        num_actors=2,
        num_cpus_per_actor=1,
        dtype="bfloat16",
        max_seq_len=1024,
        kv_cache_tokens=16384,
        max_batch_size=64,
        timeout_s=600,
    )
    out = {}
    try:
        out["actors_off_node"] = cluster.actors_off_node()
        if "delta" in parts:
            out["delta"] = bench_delta(cluster, trainer, lrs, args.pushes)
        if "lora" in parts:
            out["lora"] = bench_lora(cluster, trainer.cast(), args.rank, args.pushes)
    finally:
        cluster.shutdown()
        ray.shutdown()
        if nodes is not None:
            nodes.shutdown()
    return out


def start_ray(nodes: int, store_mb: int):
    """A local Ray of `nodes` nodes; returns the `Cluster` to shut down, or None for one node."""
    if nodes == 1:
        start_local_ray(store_mb)
        return None
    import ray
    from ray.cluster_utils import Cluster

    store = {"object_store_memory": store_mb * 2**20, "_system_config": {"preallocate_plasma_memory": True}}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **store})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=2, object_store_memory=store_mb * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_sync_kinds", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pushes", type=int, default=4)
    parser.add_argument("--lrs", default="1e-6,1e-5,1e-4,1e-3")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--store-mb", type=int, default=1536)
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1)
    parser.add_argument("--parts", default="delta,lora,sleep")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_sync_kinds.json"))
    args = parser.parse_args()
    lrs = [float(x) for x in args.lrs.split(",")]
    parts = set(args.parts.split(","))
    if not parts or parts - {"delta", "lora", "sleep", "phases"}:
        parser.error(f"--parts must name some of delta, lora, sleep, phases; got {args.parts!r}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_sync_kinds_"))
    write_checkpoint(tmp, CONFIG)
    trainer = Trainer(random_state(CONFIG, 0))
    results = {"host": describe(), "pushes": args.pushes, "nodes": args.nodes}
    if parts & {"delta", "lora"}:
        results.update(bench_cluster(args, tmp, trainer, lrs, parts))
    if "sleep" in parts:
        results["sleep"] = bench_sleep(tmp, trainer.cast())
    if "phases" in parts:
        results["phases"] = bench_phases(tmp, trainer, lrs[0], args.pushes)
    write_json(args.out, results)
    report(results)


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(r: dict) -> None:
    print(r["host"])
    if "actors_off_node" in r:
        where = "on another node than the driver" if r["actors_off_node"] else "on the driver's node"
        print(f"{r['nodes']} Ray node(s), actors {where}")
    if "delta" in r:
        report_delta(r["delta"])
    if "lora" in r:
        report_lora(r["lora"])
    if "sleep" in r:
        report_sleep(r["sleep"])
    if "phases" in r:
        report_phases(r["phases"])


def report_delta(d: dict) -> None:
    full_s, full_b = _median(d["full"], "seconds"), _median(d["full"], "bytes_sent")
    full_cpu = _median(d["full"], "cpu_s")
    print(f"full push: {full_b / 2**20:.0f} MiB bf16, median {full_s * 1e3:.0f} ms, {full_cpu * 1e3:.0f} ms of CPU")
    print(
        "delta pushes after AdamW steps (medians): lr, changed fraction, bytes sent / full, time / full, "
        "CPU time (driver and actors) / full"
    )
    for lr, runs in d["delta"].items():
        b, s, cpu = _median(runs, "bytes_sent"), _median(runs, "seconds"), _median(runs, "cpu_s")
        changed = _median(runs, "changed")
        print(
            f"  {lr:>6}: {changed:6.2%} changed, bytes {b / full_b:.3f}x, {s * 1e3:.0f} ms = {s / full_s:.2f}x, "
            f"CPU {cpu * 1e3:.0f} ms = {cpu / full_cpu:.2f}x"
        )
    if "alternating" in d:
        alt = d["alternating"]
        full_s, full_cpu = _median(alt["full"], "seconds"), _median(alt["full"], "cpu_s")
        s, cpu, changed = (_median(alt["delta"], k) for k in ("seconds", "cpu_s", "changed"))
        print(
            f"  in turn at {alt['lr']}: full {full_s * 1e3:.0f} ms, delta ({changed:.2%} changed) {s * 1e3:.0f} ms "
            f"= {s / full_s:.2f}x, CPU {cpu / full_cpu:.2f}x"
        )
    print(f"trainer's copy for deltas: {d['reference_bytes'] / 2**20:.0f} MiB")


def report_lora(lo: dict) -> None:
    fb, fs = _median(lo["full_merged"], "bytes_sent"), _median(lo["full_merged"], "seconds")
    fcpu, merge_s = _median(lo["full_merged"], "cpu_s"), _median(lo["full_merged"], "trainer_merge_s")
    print(
        f"LoRA rank {lo['rank']}: the merged model whole, {fb / 2**20:.0f} MiB in {fs * 1e3:.0f} ms "
        f"({fcpu * 1e3:.0f} ms of CPU), after the trainer's merge of {merge_s * 1e3:.0f} ms "
        "(torch, in this process); adapter pushes against the push alone (medians):"
    )
    rows = (("lora", "a later adapter push"), ("lora_second", "the second"), ("lora_first", "the first after it"))
    for kind, what in rows:
        b, t, cpu = (_median(lo[kind], k) for k in ("bytes_sent", "seconds", "cpu_s"))
        print(
            f"  {what}: {b / 2**20:.1f} MiB ({b / fb:.3f}x) in {t * 1e3:.0f} ms = {t / fs:.2f}x, "
            f"CPU {cpu * 1e3:.0f} ms = {cpu / fcpu:.2f}x"
        )


def report_sleep(s: dict) -> None:
    total = s["weights_bytes"] + s["kv_bytes"]
    for level in (1, 2):
        print(
            f"sleep({level}): freed {s[f'sleep{level}_freed_bytes'] / 2**20:.0f} MiB "
            f"({s[f'sleep{level}_freed_bytes'] / total:.0%} of weights + KV, {total / 2**20:.0f} MiB) in "
            f"{s[f'sleep{level}_s'] * 1e3:.1f} ms; wake_up {s[f'wake{level}_s'] * 1e3:.1f} ms"
        )
    print(f"push after sleep(2): {s['push_after_level2_s'] * 1e3:.0f} ms")


def report_phases(r: dict) -> None:
    print("parts of a push in one process (medians, ms): kind, MiB, changed, then each part")
    for kind, runs in r.items():
        keys = [k for k in runs[0] if k.endswith("_s")]
        parts = ", ".join(f"{k.removesuffix('_s')} {_median(runs, k) * 1e3:.0f}" for k in keys)
        mib, changed = _median(runs, "bytes_sent") / 2**20, _median(runs, "changed")
        print(f"  {kind}: {mib:.1f} MiB, {changed:.2%} changed: {parts}")


if __name__ == "__main__":
    main()
