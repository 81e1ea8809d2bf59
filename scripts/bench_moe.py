"""Throughput of the engine on a mixture-of-experts model against transformers
`generate()` on the same checkpoint (its MoE forward), in one process and one
run, on a GRPO-shaped workload: 8 prompts of 32 tokens, 8 samples each, 64
tokens per sample (no stop), sampled at temperature 1. The model is the
`bench-moe` preset (scripts/presets.py): a small Qwen3-MoE shape, 8 layers of
16 experts, top 4, hidden 512, random weights. Each side first runs a small
batch untimed (first-touch allocations); then `--repeats` rounds (default 2)
time every side in turn, and the table shows the median tokens/s and the
ratio of each round, as the machine's speed drifts between rounds. The
engine also returns routed experts in one more timed row
(`return_routed_experts=True`), with the whole sparse layer's op
(`moe_block`) off so that the experts alone run in one op after torch's
routing (`engine_moe_experts`, the op before it), and with both off
(`engine_expert_loop`: the per-expert loop of torch GEMMs). `--threads` sets torch's intra-op threads
for both sides (default: torch's own choice).

    python -m scripts.bench_moe [--repeats 2] [--threads N] [--out runs/bench_moe.json]

Prints a table and writes JSON. Timings are never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from rollout import Engine, SamplingParams
from scripts.bench import make_checkpoint, time_engine, time_hf, workload_prompts
from scripts.host import describe
from scripts.presets import preset

CONFIG = preset("bench-moe")
N, PROMPTS, PROMPT_LEN, MAX_TOKENS = 8, 8, 32, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = workload_prompts(PROMPTS, PROMPT_LEN, vocab=CONFIG["vocab_size"])
    params = SamplingParams(n=N, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0)
    routed = SamplingParams(n=N, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0, return_routed_experts=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_checkpoint(Path(tmp), CONFIG)
        engine = Engine(tmp, device="cpu", max_batch_size=PROMPTS * N, max_seq_len=256, kv_cache_tokens=32 * 1024)
        sides = {
            "engine": lambda: time_engine(engine, prompts, params),
            "engine_moe_experts": lambda: _without(
                engine, ("moe_block",), lambda: time_engine(engine, prompts, params)
            ),
            "engine_expert_loop": lambda: _without(
                engine, ("moe_block", "moe_experts"), lambda: time_engine(engine, prompts, params)
            ),
            "engine_routed": lambda: time_engine(engine, prompts, routed),
            "transformers": lambda: time_hf(hf, prompts, N, MAX_TOKENS, stop_ids=None),
        }
        small = SamplingParams(n=2, max_tokens=8, ignore_eos=True, seed=0, return_routed_experts=True)
        time_engine(engine, prompts[:2], small)  # untimed: first-touch allocations
        time_hf(hf, prompts[:2], 2, 8, stop_ids=None)
        rounds = []
        for _ in range(args.repeats):
            rounds.append({name: _rate(*run()) for name, run in sides.items()})
    report = {
        "host": describe(),
        "gemm": engine.model.gemm,
        "kernels": engine.config.kernels,
        "model": CONFIG,
        "workload": dict(prompts=PROMPTS, n=N, prompt_len=PROMPT_LEN, max_tokens=MAX_TOKENS),
        "rounds": rounds,
        "median_tokens_per_s": {k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
        "ratios": [r["engine"] / r["transformers"] for r in rounds],
        "moe_experts_ratios": [r["engine_moe_experts"] / r["transformers"] for r in rounds],
        "loop_ratios": [r["engine_expert_loop"] / r["transformers"] for r in rounds],
        "routed_ratios": [r["engine_routed"] / r["transformers"] for r in rounds],
    }
    _print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


def _without(engine: Engine, names: tuple[str, ...], run):
    """`run()` with the compiled kernels' ops `names` (`moe_block`, `moe_experts`) off:
    sparse layers then fall back to the next path (`rollout.model.moe.sparse_mlp`)."""
    ops = engine.model._ops
    saved = {name: getattr(ops, name, None) for name in names}
    for name in names:
        setattr(ops, name, None)
    try:
        return run()
    finally:
        for name, op in saved.items():
            setattr(ops, name, op)


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds


def _print(report: dict) -> None:
    print(f"# {report['host']}; engine kernels={report['kernels']}, gemm={report['gemm']}")
    for name, rate in report["median_tokens_per_s"].items():
        print(f"{name:>16}: {rate:8.1f} tokens/s (median)")
    ratios = ", ".join(f"{x:.2f}" for x in report["ratios"])
    routed = ", ".join(f"{x:.2f}" for x in report["routed_ratios"])
    print(f"engine / transformers: {statistics.median(report['ratios']):.2f}x (rounds {ratios})")
    print(f"with routed experts:   {statistics.median(report['routed_ratios']):.2f}x (rounds {routed})")
    for title, key in (("experts op (before):", "moe_experts_ratios"), ("expert loop:", "loop_ratios")):
        ratios = ", ".join(f"{x:.2f}" for x in report[key])
        print(f"{title:22} {statistics.median(report[key]):.2f}x (rounds {ratios})")


if __name__ == "__main__":
    main()
