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
(`return_routed_experts=True`), and runs once more with the whole sparse
layer's op (`moe_block`) off (`engine_expert_loop`: torch's routing and the
per-expert loop of torch GEMMs, decode steps through the Python layer loop).
`--threads` sets torch's intra-op threads for both sides (default: torch's
own choice). `--profile` instead splits one generate of each side by op
(torch.profiler self times, decode steps of 64 rows apart from the rest), the
engine with `moe_block` and without it (whose torch ops show the sparse
layer's parts).

    python -m scripts.bench_moe [--repeats 2] [--threads N] [--profile] [--out runs/bench_moe.json]

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
    parser.add_argument("--profile", action="store_true")
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
            "engine_expert_loop": lambda: _without_moe_block(engine, lambda: time_engine(engine, prompts, params)),
            "engine_routed": lambda: time_engine(engine, prompts, routed),
            "transformers": lambda: time_hf(hf, prompts, N, MAX_TOKENS, stop_ids=None),
        }
        small = SamplingParams(n=2, max_tokens=8, ignore_eos=True, seed=0, return_routed_experts=True)
        time_engine(engine, prompts[:2], small)  # untimed: first-touch allocations
        time_hf(hf, prompts[:2], 2, 8, stop_ids=None)
        if args.profile:
            return _profile(sides)
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
        "loop_ratios": [r["engine_expert_loop"] / r["transformers"] for r in rounds],
        "routed_ratios": [r["engine_routed"] / r["transformers"] for r in rounds],
    }
    _print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


def _without_moe_block(engine: Engine, run):
    """`run()` with the compiled `moe_block` off: sparse layers then route with torch's
    ops and loop over experts (`rollout.model.moe.sparse_mlp`), and decode steps run the
    Python layer loop (the one-op decode calls `moe_block`)."""
    model = engine.model
    one_op, model._one_op, model._ops.moe_block = model._one_op, False, None
    try:
        return run()
    finally:
        model._one_op, model._ops.moe_block = one_op, model._ops.lib.moe_block


# Profile categories: an op by name, a GEMM by its weight's shape (`_gemm_names`).
_OPS = {
    # A pure-decode step's layers in one op: its own kernels (sparse layers, attention, norms) as
    # its self time; its GEMMs go through the dispatcher and are counted as GEMMs.
    "rollout::decode_layers": "layers' kernels in one op (decode_layers)",
    "rollout::moe_block": "sparse layer, one op (moe_block)",
    "aten::index_add_": "combine (index_add_)",
    "rollout::paged_decode": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "rollout::sample_rows": "sampler",
    "aten::cat": "KV cache (cat)",
}
_ROUTING = ("aten::topk", "aten::_softmax", "aten::sort", "aten::bincount", "aten::index_select", "aten::div")


def _gemm_names() -> dict[tuple[int, ...], str]:
    h, e, i = CONFIG["hidden_size"], CONFIG["num_experts"], CONFIG["moe_intermediate_size"]
    q, kv = CONFIG["num_attention_heads"] * CONFIG["head_dim"], CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
    names = {(e, h): "router GEMM", (q + 2 * kv, h): "qkv GEMM", (q, h): "q GEMM", (kv, h): "k/v GEMM"}
    names.update({(h, q): "o GEMM", (CONFIG["vocab_size"], h): "LM head GEMM"})
    names.update({(2 * i, h): "expert GEMMs", (h, i): "expert GEMMs", (i, h): "expert GEMMs"})
    names.update({(h, q + 2 * kv): "qkv GEMM", (h, q): "q GEMM", (h, kv): "k/v GEMM", (q, h): "o GEMM"})
    return names


def _profile(sides) -> None:
    """Prints seconds per decode step (64 rows) and in total for the rest (prefill,
    and expert GEMMs of any step) of each category of op, with the GEMMs' GFLOP/s.
    Self times, but a GEMM's includes the BLAS calls under it."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    gemms, rows = _gemm_names(), PROMPTS * N
    for name in ("engine", "engine_expert_loop", "transformers"):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            tokens, wall = sides[name]()
        seconds, flops = defaultdict(float), defaultdict(float)
        for ev in prof.key_averages(group_by_input_shape=True):
            shapes = [list(x) for x in ev.input_shapes if isinstance(x, list | tuple)]
            first = shapes[0] if shapes else []
            kind = "decode" if first[:1] == [rows] or (ev.key == "aten::mm" and first[:1] == [rows]) else "other"
            cat, sec = _OPS.get(ev.key), ev.self_cpu_time_total / 1e6
            if ev.key in ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm") and len(shapes) > 1:
                w = tuple(shapes[1])
                cat = gemms.get(w, gemms.get(w[::-1], f"GEMM {w}"))
                kind = "all" if cat == "expert GEMMs" else kind  # rows per expert: decode and prefill alike
                flops[(kind, cat)] += 2 * first[0] * w[0] * w[1] * ev.count
                sec = ev.cpu_time_total / 1e6  # with the BLAS calls under it
            elif ev.key in _ROUTING and first and first[-1] in (CONFIG["num_experts"], CONFIG["num_experts_per_tok"]):
                cat = "routing + grouping (torch ops)"
            seconds[(kind, cat or "other ops")] += sec
        outside = wall - sum(seconds.values())
        steps = MAX_TOKENS - 1  # the engine's decode steps; transformers' too after its prefill
        print(f"{name}: {tokens / wall:.0f} tokens/s profiled, {wall:.2f} s; outside ops {outside:.2f} s")
        for (kind, cat), sec in sorted(seconds.items(), key=lambda kv: -kv[1]):
            if sec / wall < 0.003:
                continue
            per = f"{1e3 * sec / steps:7.2f} ms/step" if kind == "decode" else f"{sec:7.3f} s total "
            rate = f"  {flops[(kind, cat)] / sec / 1e9:5.1f} GFLOP/s" if flops.get((kind, cat)) else ""
            print(f"  {kind:6} {cat:44} {per} {sec / wall:6.1%}{rate}")


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds


def _print(report: dict) -> None:
    print(f"# {report['host']}; engine kernels={report['kernels']}, gemm={report['gemm']}")
    for name, rate in report["median_tokens_per_s"].items():
        print(f"{name:>16}: {rate:8.1f} tokens/s (median)")
    rows = (
        ("engine / transformers:", "ratios"),
        ("with routed experts:", "routed_ratios"),
        ("expert loop:", "loop_ratios"),
    )
    for title, key in rows:
        ratios = ", ".join(f"{x:.2f}" for x in report[key])
        print(f"{title:22} {statistics.median(report[key]):.2f}x (rounds {ratios})")


if __name__ == "__main__":
    main()
