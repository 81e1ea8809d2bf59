"""Over-sampling benchmark (docs/benchmarks.md): trainer-visible throughput of
a GRPO-style loop on a workload with a long tail of response lengths, with
and without over-sampling (APRIL, arXiv 2509.18521), in one run.

The `bench-25m` model (random weights, float32, CPU) answers `--groups`
prompts × n=4 per step, up to 256 tokens, stopping at any of the 40 ids
10..49 (about 1% a token: most answers end early, a few run to 256). The
loop generates one step ahead and "trains" for `--train-ms` per step (a
sleep standing in for the optimizer). Three ways to fill each step's batch:

- `all`: submit `--groups` groups, wait for all of them (the usual loop);
- `abort`: submit 25% more, take the first `--groups` to finish, abort the rest;
- `keep`: submit `--groups`, take the first `--groups` to finish from this
  and earlier submissions, keep the rest running into the next step.

Reported: groups and response tokens per second that reach the trainer, and
the mean response length (over-sampling favours short answers; `keep`
brings the long ones in a step later).

    python -m scripts.bench_rl_loop [--steps 6] [--groups 16] [--train-ms 200] [--out runs/bench_rl_loop.json]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import rollout
from rollout import SamplingParams
from scripts.bench import write_json
from scripts.host import describe
from scripts.synthetic import qwen2_config, write_checkpoint
from trainer_bridge import TrainerBridge

PARAMS = SamplingParams(n=4, max_tokens=256, temperature=1.0, stop_token_ids=list(range(10, 50)), ignore_eos=True)


def prompts(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.randrange(100, 4096) for _ in range(32)] for _ in range(count)]


def run_mode(engine, mode: str, steps: int, groups: int, train_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    bridge = TrainerBridge(engine)
    submitted = groups + (groups // 4 if mode == "abort" else 0)
    pending = bridge.submit(prompts(rng, submitted), PARAMS)
    delivered_groups = delivered_tokens = 0
    start = time.perf_counter()
    for _ in range(steps):
        if mode == "all":
            batch = bridge.collect(pending, timeout=600)
        else:
            batch = bridge.collect(pending, timeout=600, min_groups=groups, leftover=mode)
        pending = bridge.submit(prompts(rng, submitted), PARAMS)  # the next step generates while this one trains
        delivered_groups += int(batch.group_index.max()) + 1
        delivered_tokens += int(batch.response_mask.sum())
        time.sleep(train_s)
    seconds = time.perf_counter() - start
    pending.source.abort()
    bridge.abort_carried()
    return {
        "mode": mode,
        "seconds": seconds,
        "groups_per_s": delivered_groups / seconds,
        "tokens_per_s": delivered_tokens / seconds,
        "mean_response_tokens": delivered_tokens / (delivered_groups * PARAMS.n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_rl_loop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--groups", type=int, default=16, help="prompt groups a training step needs")
    parser.add_argument("--train-ms", type=float, default=200.0, help="the optimizer step a sleep stands for")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_rl_loop.json"))
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp(prefix="bench_rl_loop_"))
    write_checkpoint(path, qwen2_config("bench-25m"))
    engine = rollout.Engine(path, device="cpu", max_batch_size=256, max_seq_len=512, kv_cache_tokens=65536)
    engine.generate([[5] * 32], SamplingParams(max_tokens=8))  # warm-up
    print(f"host: {describe()}; bench-25m, {args.groups} groups x n={PARAMS.n} per step, up to 256 tokens")
    rows = []
    for mode in ("all", "abort", "keep"):
        row = run_mode(engine, mode, args.steps, args.groups, args.train_ms / 1000, seed=7)
        rows.append(row)
        deadline = time.monotonic() + 60
        while engine.stats()["kv_pages_used"] and time.monotonic() < deadline:  # aborted leftovers drain
            time.sleep(0.05)
    base = rows[0]
    print(f"{'mode':6} {'groups/s':>9} {'tokens/s':>9} {'vs all':>7} {'mean tokens':>12}")
    for r in rows:
        print(
            f"{r['mode']:6} {r['groups_per_s']:9.2f} {r['tokens_per_s']:9.0f} "
            f"{r['groups_per_s'] / base['groups_per_s']:6.2f}x {r['mean_response_tokens']:12.1f}"
        )
    write_json(args.out, {"host": describe(), "rows": rows})


if __name__ == "__main__":
    main()
