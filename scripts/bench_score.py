"""Scoring throughput: `Engine.score` on the SmolLM2 GRPO batch (16 chat
prompts x 8 sampled responses of up to 128 tokens, scripts/bench_real.py's
workload, sampled once by the engine), against two peers in the same run:

- transformers' teacher-forced forward of the same sequences (right-padded
  batches of `--hf-batch` rows, log-softmax and gather of each next token:
  what a trainer without an engine runs for reference or teacher logprobs);
- the engine's own prefill of the same sequences (`generate` with
  `max_tokens=1`: every position computed, the last row's logits only).

Three scores: every position (`start=1`), the responses only
(`start=len(prompt)`: the prompts' pages from the prefix cache, as a
reference-KL or distillation call runs), and the responses with top-20
alternatives; and every position again without the fused path (the head's
whole-vocabulary logits for 128 rows at a time, then torch's logsumexp: what
scoring ran before `score_block`). The prefix cache is emptied before every timed engine call (a
weight commit of one unchanged tensor), so no call reuses another's pages.
Rounds alternate the sides; tokens/s counts every token of the sequences.

The floor of each engine side (docs/scoring.md, "Throughput and its floor"):
the layers' GEMMs for the tokens the side computes (the engine's
`computed_tokens`: the prefix cache spares a prefill and a score the prompt
pages a group's earlier samples brought there) and the LM head's GEMM for the
rows it projects (a score: the positions it scores that no earlier sequence
of the call shares, `shared_scores`; a prefill: each sequence's last), at the
GEMM rates measured in the same run (`gemm_rates`, once a round, the best
taken: every layer projection's packed weight at 512 rows, the head in the
fused path's row blocks and slices); and "prefill + head": the prefill's
measured time per computed token plus the side's extra head rows at the
head's GEMM rate.

    .venv/bin/python -m scripts.bench_score [--rounds 3] [--hf-batch 8] [--n 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, replace

import torch

from rollout import Engine, SamplingParams
from rollout.engine.scoring import FUSED_ROWS, FUSED_VOCAB
from rollout.engine.shared_scores import plan_shares
from rollout.model.linear import GEMM_CHUNK, onednn_linear
from scripts.bench_real import Workload
from scripts.host import describe


def sequences(engine: Engine, work: Workload, n: int) -> tuple[list[list[int]], list[int]]:
    """The GRPO batch's prompt + response sequences (`n` per prompt) and each one's prompt length."""
    outs = engine.generate(work.prompts(engine), replace(work.params, n=n))
    seqs = [o.prompt_token_ids + s.token_ids for o in outs for s in o.samples]
    starts = [len(o.prompt_token_ids) for o in outs for _ in o.samples]
    return seqs, starts


def hf_forward(model, seqs: list[list[int]], batch: int) -> list[torch.Tensor]:
    """Teacher-forced logprobs of every next token, `batch` rows at a time."""
    out = []
    with torch.no_grad():
        for lo in range(0, len(seqs), batch):
            rows = seqs[lo : lo + batch]
            width = max(map(len, rows))
            ids = torch.zeros(len(rows), width, dtype=torch.int64)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(rows):
                ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            lp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)
            out.extend(lp[i, : len(r) - 1] for i, r in enumerate(rows))
    return out


def clear_cache(engine: Engine) -> None:
    """Empty the prefix cache: a weight commit clears it (here of one tensor, unchanged)."""
    name = "model.norm.weight"
    engine.update_weights({name: engine.model.weight_slots()[name].view().clone()})


def unfused(engine: Engine, seqs: list[list[int]]):
    """`engine.score(seqs)` on the torch path: the fused fold switched off for the call."""
    kernel, engine.stepper.score_kernel = engine.stepper.score_kernel, None
    try:
        return engine.score(seqs)
    finally:
        engine.stepper.score_kernel = kernel


CLOCK = time.perf_counter  # `--cpu-time`: time.process_time, the process's CPU seconds (all its threads)


def timed(fn) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


def layer_flops(engine: Engine) -> int:
    """FLOPs of a token's pass through the layers' projections (2 per multiply-add), from
    the projections' own shapes."""
    return sum(2 * p.shape[0] * p.shape[1] for layer in engine.model._projections for _, p in layer)


def gemm_rates(engine: Engine, repeats: int = 5) -> tuple[float, float]:
    """FLOP/s of the layers' projections (each packed weight at `GEMM_CHUNK` rows, the
    prefill's chunk) and of the LM head (`FUSED_ROWS` rows through `head_slices`, as the
    fused score runs it), the best of `repeats`; (0, 0) without oneDNN's packed weights."""
    model, cfg = engine.model, engine.model_config
    if model.packed is None or model.gemm != "onednn":
        return 0.0, 0.0
    g = torch.Generator().manual_seed(0)
    weights = [model.packed.weight(name) for name in model.packed.names if name not in ("embed", "lm_head")]
    inputs = {w.shape[1]: torch.randn(GEMM_CHUNK, w.shape[1], generator=g) for w in weights}
    h = torch.randn(FUSED_ROWS, cfg.hidden_size, generator=g)

    def layers() -> None:
        for w in weights:
            onednn_linear(inputs[w.shape[1]], w)

    def head() -> None:
        for _ in model.head_slices(h, FUSED_VOCAB):
            pass

    layer_rate = GEMM_CHUNK * layer_flops(engine) / min(timed(layers) for _ in range(repeats))
    head_rate = 2 * FUSED_ROWS * cfg.vocab_size * cfg.hidden_size / min(timed(head) for _ in range(repeats))
    return layer_rate, head_rate


def scored_rows(seqs: list[list[int]], starts: list[int]) -> int:
    """Rows a score of `seqs` from `starts` projects through the head: each sequence's
    positions from its start on that no earlier sequence shares (`plan_shares`)."""
    shares = plan_shares(seqs, starts)
    return sum(len(s) - (b if share is None else share.end) for s, b, share in zip(seqs, starts, shares, strict=True))


def random_sequences(n: int, length: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """`--random`: 16 x `n` sequences of `length` random token ids, the first half a "prompt"
    (scoring's cost does not depend on the tokens: no generation needed first)."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(16 * n)]
    return seqs, [length // 2] * len(seqs)


def run(rounds: int, hf_batch: int, n: int, random_length: int = 0) -> dict:
    from transformers import AutoModelForCausalLM

    work = Workload()
    engine = Engine(work.path, device="cpu")
    if random_length:
        seqs, starts = random_sequences(n, random_length, engine.model_config.vocab_size)
    else:
        seqs, starts = sequences(engine, work, n)
    tokens = sum(map(len, seqs))
    hf = AutoModelForCausalLM.from_pretrained(str(work.path), dtype=torch.float32).eval()
    prefill = SamplingParams(max_tokens=1, temperature=0)
    sides = {
        "score, every position": lambda: engine.score(seqs),
        "score, every position, unfused": lambda: unfused(engine, seqs),
        "score, responses (start=prompt)": lambda: engine.score(seqs, start=starts),
        "score, responses, top-20": lambda: engine.score(seqs, top_logprobs=20, start=starts),
        "engine prefill (max_tokens=1)": lambda: engine.generate(seqs, prefill),
        "transformers forward": lambda: hf_forward(hf, seqs, hf_batch),
    }
    check = engine.score(seqs[:8])  # the engine's numbers against transformers', once
    ref = hf_forward(hf, seqs[:8], hf_batch)
    diff = max((torch.tensor(s.logprobs[1:]) - r).abs().max().item() for s, r in zip(check, ref, strict=True))
    print(f"{work.name}: {len(seqs)} sequences, {tokens} tokens; max |score - transformers| {diff:.2e}", flush=True)
    every, responses = scored_rows(seqs, [1] * len(seqs)), scored_rows(seqs, starts)
    head_rows = {  # rows each side projects through the LM head: those it scores, or each one's last (prefill)
        "score, every position": every,
        "score, every position, unfused": every,
        "score, responses (start=prompt)": responses,
        "score, responses, top-20": responses,
        "engine prefill (max_tokens=1)": len(seqs),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    computed: dict[str, int] = {}
    gemm = []
    for k in range(rounds):
        gemm.append(gemm_rates(engine))
        for name, fn in sides.items():
            if not name.startswith("transformers"):
                clear_cache(engine)
            before = engine.stats()["computed_tokens"]
            times[name].append(timed(fn))
            computed[name] = engine.stats()["computed_tokens"] - before
            print(f"round {k + 1}: {name} {tokens / times[name][-1]:.0f} tokens/s", flush=True)
    rates = {name: [tokens / t for t in ts] for name, ts in times.items()}
    layer_rate, head_rate = max(g[0] for g in gemm), max(g[1] for g in gemm)  # the least disturbed
    cost = Cost(layer_flops(engine), 2 * engine.model_config.vocab_size * engine.model_config.hidden_size)
    work_of = {name: (computed[name], rows) for name, rows in head_rows.items()}
    return {
        "host": describe(),
        "model": work.name,
        "rows": len(seqs),
        "tokens": tokens,
        "rates": rates,
        "diff": diff,
        "work": work_of,
        "gemm": (layer_rate, head_rate),
        "cost": cost,
    }


@dataclass(frozen=True)
class Cost:
    layer: int  # FLOPs of a token through the layers' projections
    head: int  # FLOPs of a row through the LM head

    def floor(self, tokens: int, work: tuple[int, int], rates: tuple[float, float]) -> float:
        """tokens/s if the side's GEMMs (`work`: tokens computed, head rows) ran at `rates` and nothing else ran."""
        return tokens / (work[0] * self.layer / rates[0] + work[1] * self.head / rates[1])

    def over_prefill(self, tokens: int, work: tuple[int, int], prefill: tuple[int, int], seconds: float, rate) -> float:
        """tokens/s of the prefill's measured time per computed token, plus the side's extra head rows at `rate`."""
        return tokens / (seconds * work[0] / prefill[0] + (work[1] - prefill[1]) * self.head / rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (8: the GRPO batch's 128 rows)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by the process's CPU seconds, not the wall clock: on a host other work loads (with --threads 1)",
    )
    parser.add_argument("--random", type=int, default=0, help="score 16 x n random sequences of this many tokens")
    args = parser.parse_args()
    global CLOCK
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        CLOCK = time.process_time
    print(describe() + ("; CPU time" if args.cpu_time else ""), flush=True)
    r = run(args.rounds, args.hf_batch, args.n, args.random)
    medians = {name: statistics.median(v) for name, v in r["rates"].items()}
    prefill = "engine prefill (max_tokens=1)"
    hf, pre = medians["transformers forward"], medians[prefill]
    layer_rate, head_rate = r["gemm"]
    cost, tokens, work = r["cost"], r["tokens"], r["work"]
    print(f"GEMM rates: layers {layer_rate / 1e9:.0f} GFLOP/s, head {head_rate / 1e9:.0f} GFLOP/s; "
          f"{cost.layer / 1e6:.0f} MFLOP a computed token, {cost.head / 1e6:.0f} MFLOP a head row")  # fmt: skip
    for name, rates in r["rates"].items():
        rounds = ", ".join(f"{x:.0f}" for x in rates)
        line = f"{name:34s} {medians[name]:8.0f} tokens/s  {medians[name] / hf:5.2f}x transformers  "
        line += f"{medians[name] / pre:5.2f}x prefill"
        if name in work and layer_rate:
            floor = cost.floor(tokens, work[name], r["gemm"])
            line += f"  computed {work[name][0]}, head rows {work[name][1]}: "
            line += f"floor {floor:.0f} ({medians[name] / floor:.2f}x)"
            if name != prefill:
                over = cost.over_prefill(tokens, work[name], work[prefill], tokens / pre, head_rate)
                line += f", prefill + head {over:.0f} ({medians[name] / over:.2f}x)"
        print(f"{line}  (rounds {rounds})")


if __name__ == "__main__":
    main()
