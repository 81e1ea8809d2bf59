"""Multi-turn benchmark (docs/benchmarks.md), on the `bench-25m` model (random
weights, float32, CPU):

1. Computed tokens per turn against the context length: one session of
   `--turns` turns, each 16 sampled tokens and a 13-token observation. Side by
   side in the same run: the session (its KV kept between turns), a new
   session per turn from the same token ids (what the prefix cache alone
   keeps: full pages), and a stateless re-prefill of the whole context (what
   a client that resends the conversation without a prefix cache computes).
2. Episodes per second with a slow environment (`--env-ms` per step, a
   blocking sleep as a tool call would be) at `--episodes` concurrent
   episodes (`Engine.run_episodes`), against the same episodes run one after
   another.

    python -m scripts.bench_episodes [--turns 24] [--episodes 64] [--env-ms 50] [--out runs/bench_episodes.json]
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

TURN = SamplingParams(max_tokens=16, ignore_eos=True, seed=1)
OBSERVATION = 13  # not a whole page: the prefix cache keeps only full pages


def engine_for(path: Path, **kwargs) -> rollout.Engine:
    return rollout.Engine(path, device="cpu", max_seq_len=2048, **kwargs)


def tokens_per_turn(path: Path, turns: int) -> list[dict]:
    """Per turn: context before it, tokens computed by each way of continuing, seconds."""
    engine = engine_for(path, kv_cache_tokens=16384)
    rng = random.Random(0)
    rows = []
    with engine.session([rng.randrange(4096) for _ in range(64)]) as sess:
        for _ in range(turns):
            context = len(sess.token_ids)
            # First what a client that resends the conversation finds: the prefix cache's full pages.
            with engine.session(sess.token_ids) as fresh:
                before = engine.stats()["computed_tokens"]
                fresh.generate(TURN)
                prefix_only = engine.stats()["computed_tokens"] - before
            before, start = engine.stats()["computed_tokens"], time.perf_counter()
            sess.generate(TURN)
            seconds = time.perf_counter() - start
            computed = engine.stats()["computed_tokens"] - before
            rows.append(
                {
                    "context": context,
                    "session": computed,
                    "prefix_cache_only": prefix_only,
                    "stateless": context + TURN.max_tokens - 1,
                    "session_s": seconds,
                }
            )
            sess.append([rng.randrange(4096) for _ in range(OBSERVATION)])
    engine.close()
    return rows


class SlowEnv:
    """Three turns; every step blocks for `seconds` (a tool call) and answers OBSERVATION tokens."""

    def __init__(self, k: int, seconds: float) -> None:
        self.k, self.seconds, self.turn = k, seconds, 0

    def reset(self) -> list[int]:
        rng = random.Random(self.k)
        return [rng.randrange(4096) for _ in range(64)]

    def step(self, sample):
        time.sleep(self.seconds)
        self.turn += 1
        return [(self.k * 31 + i) % 4096 for i in range(OBSERVATION)], 0.0, self.turn >= 3


def episodes_per_second(path: Path, episodes: int, env_s: float) -> dict:
    engine = engine_for(path, max_batch_size=episodes, kv_cache_tokens=episodes * 512)
    engine.run_episodes([SlowEnv(k, env_s) for k in range(2)], TURN)  # warm-up
    start = time.perf_counter()
    together = engine.run_episodes([SlowEnv(k, env_s) for k in range(episodes)], TURN, max_turns=3)
    concurrent = time.perf_counter() - start
    start = time.perf_counter()
    alone = [engine.run_episodes([SlowEnv(k, env_s)], TURN, max_turns=3)[0] for k in range(episodes)]
    sequential = time.perf_counter() - start
    assert [e.token_ids for e in together] == [e.token_ids for e in alone], "concurrent episodes differ"
    engine.close()
    return {
        "episodes": episodes,
        "env_step_s": env_s,
        "concurrent_s": concurrent,
        "sequential_s": sequential,
        "concurrent_eps": episodes / concurrent,
        "sequential_eps": episodes / sequential,
        "speedup": sequential / concurrent,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_episodes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=24, help="turns of the tokens-per-turn session")
    parser.add_argument("--episodes", type=int, default=64, help="concurrent episodes")
    parser.add_argument("--env-ms", type=float, default=50.0, help="environment step time (ms)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_episodes.json"))
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp(prefix="bench_episodes_"))
    write_checkpoint(path, qwen2_config("bench-25m"))
    print(f"host: {describe()}; model bench-25m (float32)")
    rows = tokens_per_turn(path, args.turns)
    print(f"tokens computed per turn ({TURN.max_tokens} sampled + {OBSERVATION} observed per turn)")
    print(f"{'context':>8} {'session':>8} {'prefix cache only':>18} {'stateless':>10} {'turn ms':>8}")
    for r in rows[:: max(1, len(rows) // 8)] + ([rows[-1]] if len(rows) % 8 else []):
        print(
            f"{r['context']:8d} {r['session']:8d} {r['prefix_cache_only']:18d} {r['stateless']:10d} "
            f"{r['session_s'] * 1000:8.0f}"
        )
    eps = episodes_per_second(path, args.episodes, args.env_ms / 1000)
    print(
        f"{eps['episodes']} episodes of 3 turns, environment {args.env_ms:.0f} ms per step: "
        f"concurrent {eps['concurrent_s']:.1f} s ({eps['concurrent_eps']:.1f} episodes/s), one after another "
        f"{eps['sequential_s']:.1f} s ({eps['sequential_eps']:.2f} episodes/s): {eps['speedup']:.1f}x"
    )
    write_json(args.out, {"host": describe(), "tokens_per_turn": rows, "episodes": eps})


if __name__ == "__main__":
    main()
