"""Penalties' cost (docs/api.md, SamplingParams): tokens/s of a batch whose
rows all carry frequency, presence and repetition penalties and a logit
bias, against the same batch without them, in the same run, on the
`bench-25m` model (random weights, float32, CPU; `--vocab` overrides its
vocabulary, as the per-step count tensors are rows x vocabulary). The
median of `--repeats` alternating runs of each.

    python -m scripts.bench_penalties [--prompts 32] [--tokens 64] [--vocab 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import rollout
from rollout import SamplingParams
from scripts.host import describe
from scripts.synthetic import qwen2_config, write_checkpoint


def tokens_per_second(engine: rollout.Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    return sum(len(s.token_ids) for o in outputs for s in o.samples) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    plain = SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=1, temperature=0.9)
    penalised = SamplingParams(
        max_tokens=args.tokens,
        ignore_eos=True,
        seed=1,
        temperature=0.9,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        repetition_penalty=1.2,
        logit_bias={7: 1.5, 11: -3.0},
    )
    prompts = [[(13 * i + j) % args.vocab for j in range(64)] for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench-25m"
        write_checkpoint(path, qwen2_config("bench-25m", vocab_size=args.vocab))
        engine = rollout.Engine(path, device="cpu", max_seq_len=512, max_batch_size=args.prompts)
        try:
            tokens_per_second(engine, prompts[:2], penalised)  # warm-up
            a, b = [], []
            for _ in range(args.repeats):
                a.append(tokens_per_second(engine, prompts, plain))
                b.append(tokens_per_second(engine, prompts, penalised))
        finally:
            engine.close()
    x, y = statistics.median(a), statistics.median(b)
    print(describe())
    print(f"{args.prompts} x {args.tokens} tokens, vocabulary {args.vocab}: {x:.0f} tokens/s without, {y:.0f} with")
    print(f"penalised / plain: {y / x:.2f}")


if __name__ == "__main__":
    main()
