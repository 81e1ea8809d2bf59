"""Host time per decode step: what a step costs beyond the model's own work.

A steady decode at batch 256 (256 prompts of 16 random tokens, 96 new tokens
each, temperature 1, `ignore_eos`) on a tiny Llama (2 layers, hidden 64,
vocabulary 512, written by transformers), the engine with its default
settings on the CPU. Per decode step of the full batch it reads:

- **step**: the wall time from one step's end to the next's (`StepInfo.end_time`
  of consecutive steps: the whole loop, bookkeeping outside the guard included),
  and the step's own time under the guard (`StepInfo.seconds`);
- **model**: the model and the sampler (the stepper's `_run`: a graph replay or
  the eager forward and sampling);
- **host** = step - model, the median and the mean over the steady steps;
- the same in the stepping thread's CPU time (`*_cpu`, `time.thread_time`):
  on a shared host the wall clock also counts the time other processes held
  the core, the thread's CPU time does not; with `--threads 1` the model runs
  on that thread, so `host_cpu` is the host's own work per step;
- its parts, where the engine has them as methods (each timed by wrapping the
  method on the instance; a part the code does not have is left out):
  `schedule` (the scheduler's plan), `prepare` (the stepper's inputs, of which
  `metadata` is the attention metadata), `finish` (the tokens and logprobs read
  back), `update` (the scheduler applying them), and `stepper` (the stepper's
  whole step: prepare, model and finish).

The first `generate` is a warm-up; then `--rounds` (default 3) generates are
timed and their steady steps pooled. Only the decode steps of the full batch
count (256 rows, 256 tokens). Written against the engine's internals by name
and robust to a missing one, so the same script measures older code:

    python -m scripts.bench_host [--rounds 3] [--batch 256] [--tokens 96] [--threads N]
                                 [--against CHECKOUT] [--out runs/bench_host.json]

With `--against` (another checkout of the project, e.g. a worktree of an
older commit) each round runs once over that code and once over this one,
alternating, each in a fresh process (this script with the other checkout
first on the path), and the ratio of their host times is printed.

Prints a table and writes JSON. Timings are never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from rollout import Engine, SamplingParams
from scripts.host import describe

TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
PROMPT_LEN = 16
# (part, owner attribute on the engine, method names tried in order): the first one present is timed.
PARTS = (
    ("model", "stepper", ("_run",)),
    ("stepper", "stepper", ("launch", "step")),  # a step's launch: prepare, model, finish (older code: step)
    ("schedule", "scheduler", ("schedule",)),
    ("prepare", "stepper", ("_prepare",)),
    ("metadata", "stepper", ("_attention_metadata",)),
    ("finish", "stepper", ("_finish",)),
    ("update", "scheduler", ("apply", "update")),  # the tokens applied (older code: the whole update)
)


class PartTimer:
    """Wraps methods of the engine's objects on the instances; each call's seconds
    are added to its part's total for the current step."""

    def __init__(self, engine: Engine) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.found: dict[str, str] = {}  # part -> "owner.method" that was wrapped
        for part, owner_name, names in PARTS:
            owner = getattr(engine, owner_name, None)
            name = next((n for n in names if owner is not None and hasattr(owner, n)), None)
            if name is None:
                continue
            self.found[part] = f"{owner_name}.{name}"
            setattr(owner, name, self._timed(part, getattr(owner, name)))

    def _timed(self, part: str, method):
        current = self.current

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                current[part] += time.perf_counter() - start
                current[part + "_cpu"] += time.thread_time() - cpu

        return timed

    def take(self) -> dict[str, float]:
        out = dict(self.current)
        self.current.clear()
        return out


def tiny_checkpoint(path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA)).save_pretrained(path)


def run(path: str | Path, rounds: int, batch: int, tokens: int, **engine_kwargs) -> dict:
    """`rounds` timed generates of `batch` prompts on the checkpoint at `path` (after an
    untimed one): a record per decode step of the full batch, and what the engine ran with."""
    g = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(1, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0)
    steps: list[dict] = []
    records: list = []
    timers: list[PartTimer] = []  # the engine's, once it exists
    # Called after each step, outside the guard, on the stepping thread: its record, CPU clock and parts.
    engine = Engine(
        path,
        **{"device": "cpu", **engine_kwargs},
        step_callback=lambda info: records.append((info, time.thread_time(), timers[0].take())),
    )
    timer = PartTimer(engine)
    timers.append(timer)
    try:
        engine.generate(prompts, params)  # warm-up: first-touch pages, kernels loaded
        for _ in range(rounds):
            records.clear()
            engine.generate(prompts, params)
            for (prev, prev_cpu, _), (info, cpu, parts) in zip(records, records[1:], strict=False):
                if info.num_tokens == batch and info.num_sampled == batch:
                    interval = dict(interval=info.end_time - prev.end_time, interval_cpu=cpu - prev_cpu)
                    steps.append(dict(interval, guarded=info.seconds, **parts))
        meta = dict(
            kernels=engine.config.kernels,
            gemm=getattr(engine.model, "gemm", "unknown"),
            decode_graphs=engine.config.decode_graphs,
            timed=timer.found,
        )
    finally:
        engine.close()
    return dict(meta, steps=steps)


def summarise(steps: list[dict]) -> dict[str, dict[str, float]]:
    """Median and mean milliseconds per step of every column, host included."""
    for s in steps:
        s["host"] = s["interval"] - s.get("model", 0.0)
        s["host_guarded"] = s["guarded"] - s.get("model", 0.0)
        s["host_cpu"] = s["interval_cpu"] - s.get("model_cpu", 0.0)
    table = {}
    for k in steps[0] if steps else ():
        values = [1e3 * s[k] for s in steps]
        table[k] = dict(median_ms=statistics.median(values), mean_ms=statistics.mean(values))
    return table


def child(code: Path, args: argparse.Namespace, out: Path) -> dict:
    """One round of this script over the code of checkout `code`, in a fresh process."""
    cmd = [sys.executable, __file__, "--rounds", "1", "--batch", str(args.batch), "--tokens", str(args.tokens)]
    cmd += ["--out", str(out)] + (["--threads", str(args.threads)] if args.threads else [])
    env = dict(os.environ, PYTHONPATH=str(code))
    subprocess.run(cmd, cwd=code, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def compare(args: argparse.Namespace) -> dict:
    """Rounds alternating between this checkout and `args.against`, each in its own process."""
    sides = {"this": Path(__file__).resolve().parents[1], "against": Path(args.against).resolve()}
    pooled: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, code in sides.items():
                got = child(code, args, Path(tmp) / f"{name}{r}.json")
                side = pooled.setdefault(name, {k: v for k, v in got.items() if k not in ("steps", "table")})
                side.setdefault("steps", []).extend(got["steps"])
                for key in ("host", "host_cpu"):
                    side.setdefault(f"round_{key}_ms", []).append(got["table"][key]["median_ms"])
    return pooled


def print_table(table: dict[str, dict[str, float]]) -> None:
    print(f"{'per step':<14} {'median ms':>10} {'mean ms':>10}")
    for name, row in table.items():
        print(f"{name:<14} {row['median_ms']:>10.3f} {row['mean_ms']:>10.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--against", default=None, help="another checkout: rounds alternate between it and this one")
    ap.add_argument("--out", default="runs/bench_host.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    host = describe()
    print(host)
    if args.against:
        sides = compare(args)
        record = dict(host=host, args=vars(args))
        for name, side in sides.items():
            side["table"] = summarise(side.pop("steps"))
            print(f"\n{name} ({args.against if name == 'against' else 'this checkout'}):")
            print(f"kernels {side['kernels']}, GEMM {side['gemm']}, decode graphs {side['decode_graphs']}")
            for key in ("host", "host_cpu"):
                print(f"{key} ms per round (medians):", ", ".join(f"{x:.3f}" for x in side[f"round_{key}_ms"]))
            print_table(side["table"])
            record[name] = side
        for key in ("host", "host_cpu"):
            ratio = sides["this"]["table"][key]["median_ms"] / sides["against"]["table"][key]["median_ms"]
            record[f"{key}_ratio"] = ratio
            print(f"{key} per step, this / against (medians): {ratio:.3f}")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tiny_checkpoint(Path(tmp))
            result = run(tmp, args.rounds, args.batch, args.tokens)
        steps = result.pop("steps")
        table = summarise(steps)
        print(f"kernels {result['kernels']}, GEMM {result['gemm']}, decode graphs {result['decode_graphs']}")
        print(f"steady decode steps at batch {args.batch}: {len(steps)} over {args.rounds} rounds")
        print_table(table)
        record = dict(host=host, args=vars(args), table=table, steps=steps, **result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
