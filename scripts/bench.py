"""Throughput of the engine against transformers `generate()` on the
`bench-25m` workload (docs/benchmarks.md), in one process and one run, plus
the compute floor, a batch-1 latency row and a long-prompt prefill row.
On the CPU the engine also runs with `kernels="torch"` (torch ops only:
pages gathered for SDPA, unfused norms, rotary and SiLU, the torch-op
sampler, torch's BLAS) to show what the compiled kernels of
`rollout.kernels` and the GEMM choice pay, and two rows time the sampler
alone at Qwen2.5's vocabulary (where it costs as much as the LM head, and
with top-p several times more), without filters and with top_p 0.95. The
floor uses the fastest of torch's BLAS and oneDNN on plain and on packed
weights, all measured here. Each side runs the whole workload once before it
is timed (first-touch allocations); then `--repeats` rounds (default 3) time
every side in turn, each round followed by the floor's GEMM timing, so a
round's fraction of the floor compares it with the machine as it was then
(this machine's speed drifts: its BLAS rate fell by a third for minutes in
one run). The table shows medians and the figures of each round.

Last, the engine's start-up: `import rollout`, `Engine(path, device="cpu")`
with default sizes and a first `generate` of 4 tokens, in fresh
subprocesses with the kernels already built, and the resident memory right
after, for `bench-25m` and for the `smollm2-135m` preset (random weights).

With `--workload smollm2` (or `all`, the default) the real-model rows of
`scripts/bench_real.py` follow: SmolLM2-135M's shapes on a GRPO batch, with
their own floor, start-up and per-op profile; `--profile` adds the per-op
profile of the bench-25m workload.

    python -m scripts.bench [--workload all|bench-25m|smollm2] [--profile] [--out runs/bench.json]
                            [--skip-hf] [--startup-only]

Prints a table and writes JSON. Timings are never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rollout import Engine, SamplingParams
from rollout.model.linear import onednn_linear
from scripts import bench_real
from scripts.host import describe
from scripts.presets import preset

BENCH_25M = preset("bench-25m")
STOP_IDS = list(range(10, 50))
N, PROMPTS, PROMPT_LEN, MAX_TOKENS = 8, 16, 32, 128
ENGINE_SIZES = dict(device="cpu", max_batch_size=PROMPTS * N, max_seq_len=2048, kv_cache_tokens=64 * 1024)
STARTUP_MODELS = ("bench-25m", "smollm2-135m")
STARTUP_RUNS = 3
# Run by a fresh interpreter with the checkpoint's path; prints one JSON line.
STARTUP_CHILD = """
import json, sys, time
start = time.perf_counter()
import rollout
imported = time.perf_counter()
engine = rollout.Engine(sys.argv[1], device="cpu")
loaded = time.perf_counter()
engine.generate([[1, 2, 3, 4]], rollout.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
done = time.perf_counter()
from rollout.cluster.host import resident_bytes
print(json.dumps(dict(
    import_s=imported - start, engine_s=loaded - imported, generate_s=done - loaded, total_s=done - start,
    rss_bytes=resident_bytes("VmRSS"), peak_rss_bytes=resident_bytes("VmHWM"),
    kv_cache_tokens=engine.config.kv_cache_tokens, kv_pool_bytes=engine.kv_pool.nbytes,
    kernels=engine.config.kernels, gemm=engine.model.gemm,
)))
"""


def make_checkpoint(path: Path, config: dict = BENCH_25M, dtype: torch.dtype = torch.float32):
    """A random checkpoint of `config` (a preset of scripts/presets.py) written
    by transformers at `path`; returns the model (on the CPU).

    Built under a default dtype rather than with `from_config(dtype=...)`, which
    older transformers lack; a cast afterwards would also round the rotary
    inv_freq buffer and move a bf16 reference by up to 0.01 logprob.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).eval()
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(path)
    return model


def workload_prompts(count: int, length: int, seed: int = 0, vocab: int = BENCH_25M["vocab_size"]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(50, vocab, (length,), generator=g).tolist() for _ in range(count)]


def real_tokens(row: list[int], stop_ids=STOP_IDS) -> int:
    """Generated tokens up to and including the first stop token."""
    for i, t in enumerate(row):
        if t in stop_ids:
            return i + 1
    return len(row)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_engine(engine: Engine, prompts, params) -> tuple[int, float]:
    sync(engine.config.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(engine.config.device)
    return sum(len(s.token_ids) for o in outs for s in o.samples), time.perf_counter() - start


def time_hf(model, prompts, n: int, max_tokens: int, greedy: bool = False, stop_ids=STOP_IDS) -> tuple[int, float]:
    """Real tokens and seconds of transformers `generate()` on the model's device;
    `stop_ids=None` generates exactly `max_tokens` per row."""
    ids = torch.tensor(prompts, device=model.device).repeat_interleave(n, dim=0)
    kwargs = dict(do_sample=not greedy, max_new_tokens=max_tokens, pad_token_id=0, return_dict_in_generate=True)
    if stop_ids:
        kwargs.update(eos_token_id=list(stop_ids), output_scores=True)
    else:
        kwargs.update(min_new_tokens=max_tokens)
    if not greedy:
        kwargs.update(temperature=1.0, top_k=0, top_p=1.0)
    sync(model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    sync(model.device)
    seconds = time.perf_counter() - start
    new = out.sequences[:, ids.shape[1] :].tolist()
    return sum(real_tokens(r, stop_ids or ()) for r in new), seconds


def gemm_rate(rows: int = 256, seconds: float = 1.0, linear=torch.nn.functional.linear, packed: bool = False) -> float:
    """Measured float32 GEMM FLOP/s of `linear` at the model's widest projection;
    `packed`: the weight in oneDNN's blocked layout, as the engine keeps it."""
    a = torch.randn(rows, BENCH_25M["hidden_size"])
    b = torch.randn(2 * BENCH_25M["intermediate_size"], BENCH_25M["hidden_size"])
    if packed:
        b = torch.ops.mkldnn._reorder_linear_weight(b, None)
    for _ in range(3):
        linear(a, b)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        linear(a, b)
        count += 1
    return count * 2 * a.shape[0] * a.shape[1] * b.shape[0] / (time.perf_counter() - start)


def best_gemm_rate() -> dict[str, float]:
    """The GEMM rates of torch's BLAS (`F.linear`, what transformers runs on) and
    of oneDNN (what the engine may pick) on plain and on packed weights, and the
    best of them, which sets the floor."""
    rates = {"blas": gemm_rate()}
    try:
        rates["onednn"] = gemm_rate(linear=onednn_linear)
        rates["onednn_packed"] = gemm_rate(linear=onednn_linear, packed=True)
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        pass
    return {**rates, "best": max(rates.values())}


def dense_params(config: dict) -> int:
    """Parameters every token multiplies with: projections, MLP and the LM head."""
    h, inter, layers, v = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    return layers * (h * (h + 2 * kv) + h * h + 3 * h * inter) + v * h


def flops_per_token(context: int, config: dict = BENCH_25M) -> float:
    attention = config["num_hidden_layers"] * 2 * 2 * context * config["hidden_size"]  # scores, weighted sum
    return 2 * dense_params(config) + attention


def sampler_ms(rows: int = 64, vocab: int = 151936, rounds: int = 5, top_p: float = 1.0) -> dict[str, float]:
    """Median ms per call of the sampler over random float32 logits `[rows, vocab]`
    (temperature 1, `top_p`) on the torch path and through the compiled
    `sample_rows`, alternating; the default vocabulary is Qwen2.5's."""
    from rollout.engine.sampler import SamplingBatch, sample
    from rollout.kernels.build import cpu_ops

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    zeros = torch.zeros(rows, dtype=torch.int64)
    ones = torch.ones(rows)
    batch = SamplingBatch.of(ones, zeros, ones * top_p, torch.zeros(rows), zeros, seed=torch.arange(rows))
    tokens, logprobs = torch.empty(rows, dtype=torch.int64), torch.empty(rows)
    paths = {"torch": None, "compiled": cpu_ops().sample_rows}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds + 1):  # the first round warms up
        for name, kernel in paths.items():
            start = time.perf_counter()
            sample(logits, batch, tokens, logprobs, kernel)
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t[1:]) for name, t in times.items()}


def run(args) -> dict:
    """The rollout rows over `args.repeats` alternating rounds with their floors, then the single-run rows."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    tmp = Path(tempfile.mkdtemp(prefix="bench25m_"))
    model = make_checkpoint(tmp)
    hf = None if args.skip_hf else model
    engine = Engine(tmp, **ENGINE_SIZES)
    runs, round_rates = timed_rounds(rollout_sides(tmp, engine, hf), args.repeats)
    results = {"threads": torch.get_num_threads(), "repeats": args.repeats, **summarize(runs, round_rates)}
    results["engine"].update(kernels=engine.config.kernels, gemm=engine.model.gemm)
    prompts, params = workload_prompts(PROMPTS, PROMPT_LEN), rollout_params()
    results["own_steps_floor"] = bench_real.own_steps_floor(
        engine, lambda: bench_real.time_engine(engine, prompts, params), BENCH_25M, PROMPTS * N
    )
    if hf is not None:
        narrow = {
            "kv_cache_dtype='bfloat16'": Engine(tmp, **ENGINE_SIZES, kv_cache_dtype="bfloat16"),
            "matmul_dtype='bfloat16'": Engine(tmp, **ENGINE_SIZES, matmul_dtype="bfloat16"),
        }
        results["logprob_mismatch"] = {
            label: bench_real.logprob_mismatch(e, hf, prompts, params)
            for label, e in {"engine": engine, **narrow}.items()
        }
        for e in narrow.values():
            e.close()
    results.update(single_runs(engine, hf))
    if args.profile:
        results["profile"] = bench_real.profile(engine, prompts, params, BENCH_25M)
    return results


def rollout_sides(path: Path, engine: Engine, hf) -> dict:
    """The timed sides of the rollout rows, each a call returning (tokens, seconds):
    the engine, the engine with a bfloat16 KV pool, with bfloat16 projections,
    on torch ops only (when it runs compiled kernels), and transformers (unless
    `hf` is None)."""
    prompts, params = workload_prompts(PROMPTS, PROMPT_LEN), rollout_params()
    bf16_kv = Engine(path, **ENGINE_SIZES, kv_cache_dtype="bfloat16")
    bf16_mm = Engine(path, **ENGINE_SIZES, matmul_dtype="bfloat16")
    sides = {
        "engine": lambda: time_engine(engine, prompts, params),
        "engine_kv_bf16": lambda: time_engine(bf16_kv, prompts, params),
        "engine_matmul_bf16": lambda: time_engine(bf16_mm, prompts, params),
    }
    if engine.config.kernels != "torch":
        plain = Engine(path, **ENGINE_SIZES, kernels="torch")
        sides["engine_torch_ops"] = lambda: time_engine(plain, prompts, params)
    if hf is not None:
        sides["transformers"] = lambda: time_hf(hf, prompts, N, MAX_TOKENS)
    return sides


def rollout_params() -> SamplingParams:
    """The rollout rows' sampling: n=8, up to 128 tokens at temperature 1, ending at the stop ids."""
    return SamplingParams(n=N, max_tokens=MAX_TOKENS, temperature=1.0, stop_token_ids=STOP_IDS, ignore_eos=True)


def timed_rounds(sides: dict, repeats: int) -> tuple[dict[str, list[tuple[int, float]]], list[dict[str, float]]]:
    """Every side once untimed (first-touch allocations), then `repeats` rounds
    timing the sides in turn, each round followed by the GEMM rates of its floor,
    so a drifting machine hits every side and its floor alike."""
    for timed in sides.values():
        timed()
    runs: dict[str, list[tuple[int, float]]] = {name: [] for name in sides}
    round_rates = []
    for _ in range(repeats):
        for name, timed in sides.items():
            runs[name].append(timed())
        shapes = bench_real.gemm_floor(BENCH_25M, PROMPTS * N)
        round_rates.append(
            {**best_gemm_rate(), "shapes": shapes, "bf16": bench_real.bf16_floor(BENCH_25M, PROMPTS * N)}
        )
    return runs, round_rates


def summarize(runs: dict[str, list[tuple[int, float]]], round_rates: list[dict[str, float]]) -> dict:
    """Medians and per-round figures of each side, each round against its own floor."""
    tokens = statistics.mean(t for t, _ in runs["engine"])
    flops = flops_per_token(int(PROMPT_LEN + tokens / (PROMPTS * N) / 2))
    floors = [rates["shapes"]["flops_per_s"] / flops for rates in round_rates]
    rates = {
        key: statistics.median(r[key] for r in round_rates) for key in round_rates[0] if key not in ("shapes", "bf16")
    }
    shapes = sorted((r["shapes"] for r in round_rates), key=lambda f: f["flops_per_s"])[len(round_rates) // 2]
    results: dict = {
        "floor": {
            "gemm_flops_per_s": statistics.median(r["shapes"]["flops_per_s"] for r in round_rates),
            "shapes": shapes,
            "widest_projection_rates": rates,
            "tokens_per_s": statistics.median(floors),
            "runs_tokens_per_s": floors,
        }
    }
    for name, measured in runs.items():
        per_s = [t / sec for t, sec in measured]
        fractions = [rate / floor for rate, floor in zip(per_s, floors, strict=True)]
        results[name] = {
            "tokens_per_s": statistics.median(per_s),
            "runs_tokens_per_s": per_s,
            "fraction_of_floor": statistics.median(fractions),
            "runs_fraction_of_floor": fractions,
        }
    bf16_floors = [r["bf16"] for r in round_rates]
    results["bf16_floor"] = bench_real.summarize_bf16_floor(bf16_floors, flops, results["engine_matmul_bf16"])
    if "transformers" in runs:
        engine, hf = results["engine"], results["transformers"]
        results["speedup_vs_transformers"] = engine["tokens_per_s"] / hf["tokens_per_s"]
        results["speedup_per_round"] = [
            e / h for e, h in zip(engine["runs_tokens_per_s"], hf["runs_tokens_per_s"], strict=True)
        ]
    return results


def single_runs(engine: Engine, hf) -> dict:
    """One run each: batch-1 latency, the sampler alone (compiled kernels only)
    and a 1024-token prefill, for the engine and (unless `hf` is None) transformers."""
    prompts = workload_prompts(PROMPTS, PROMPT_LEN)
    one = SamplingParams(n=1, max_tokens=64, temperature=0.0, ignore_eos=True)
    tokens, seconds = time_engine(engine, prompts[:1], one)
    results: dict = {"engine_batch1_ms_per_token": 1000 * seconds / tokens}
    if engine.config.kernels == "compiled":
        results["sampler_ms_64x151936"] = {"none": sampler_ms(), "top_p_0.95": sampler_ms(top_p=0.95)}
    long_prompt = workload_prompts(1, 1024, seed=1)
    _, prefill_s = time_engine(engine, long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
    results["engine_prefill_1024_tokens_per_s"] = 1024 / prefill_s
    if hf is not None:
        tokens, seconds = time_hf(hf, prompts[:1], 1, 64, greedy=True)
        results["transformers_batch1_ms_per_token"] = 1000 * seconds / tokens
        start = time.perf_counter()
        with torch.no_grad():
            hf(torch.tensor(long_prompt))
        results["transformers_prefill_1024_tokens_per_s"] = 1024 / (time.perf_counter() - start)
    return results


def startup_run(path: Path) -> dict:
    """One start-up of the engine on `path` in a fresh interpreter: the child's
    phases, its resident memory after the first tokens, and the process's wall time."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", STARTUP_CHILD, str(path)], capture_output=True, text=True, check=True)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - start}


def startup(models=STARTUP_MODELS, runs: int = STARTUP_RUNS) -> dict:
    """Per preset in `models`: a random checkpoint, one untimed start-up (builds
    the kernels if needed, reads the file into the page cache), then `runs`
    start-ups; the medians and every run's figures."""
    results = {}
    for name in models:
        path = Path(tempfile.mkdtemp(prefix=f"startup_{name}_"))
        make_checkpoint(path, preset(name))
        startup_run(path)
        measured = [startup_run(path) for _ in range(runs)]
        medians = {k: statistics.median(m[k] for m in measured) for k, v in measured[0].items() if k.endswith("_s")}
        largest = {k: max(m[k] for m in measured) for k in ("rss_bytes", "peak_rss_bytes")}
        results[name] = {**measured[0], **medians, **largest, "runs": measured}
    return results


def print_startup(startups: dict) -> None:
    GiB = 1 << 30
    for name, r in startups.items():
        print(
            f"start-up {name}: {r['total_s']:.2f} s (import {r['import_s']:.2f}, Engine() {r['engine_s']:.2f}, "
            f"first 4 tokens {r['generate_s']:.2f}; process {r['process_s']:.2f}); resident {r['rss_bytes'] / GiB:.2f} "
            f"GiB after start (peak {r['peak_rss_bytes'] / GiB:.2f}); KV pool {r['kv_cache_tokens']} tokens, "
            f"{r['kv_pool_bytes'] / GiB:.2f} GiB reserved; kernels={r['kernels']}, GEMM {r['gemm']}; "
            f"medians of {len(r['runs'])} fresh processes, memory the largest"
        )


def print_table(r: dict) -> None:
    print(
        f"bench-25m on CPU, {r['threads']} threads; floor {r['floor']['tokens_per_s']:.0f} tok/s "
        f"(GEMM {r['floor']['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s over the model's shapes at {PROMPTS * N} rows: "
        + ", ".join(f"{k} {v['gflops']:.0f} ({v['backend']})" for k, v in r["floor"]["shapes"]["shapes"].items())
        + "; the widest projection at 256 rows: "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in r["floor"]["widest_projection_rates"].items() if k != "best")
        + f"); engine kernels={r['engine']['kernels']}, GEMM {r['engine']['gemm']}"
    )
    print(f"{'':34}{'engine':>12}{'transformers':>14}{'ratio':>8}")
    hf = r.get("transformers")
    rows = [
        ("rollout tokens/s", r["engine"]["tokens_per_s"], hf and hf["tokens_per_s"]),
        ("fraction of floor", r["engine"]["fraction_of_floor"], hf and hf["fraction_of_floor"]),
        ("batch-1 ms/token", r["engine_batch1_ms_per_token"], r.get("transformers_batch1_ms_per_token")),
        (
            "prefill 1024 tokens/s",
            r["engine_prefill_1024_tokens_per_s"],
            r.get("transformers_prefill_1024_tokens_per_s"),
        ),
    ]
    if "engine_torch_ops" in r:
        torch_ops = r["engine_torch_ops"]["tokens_per_s"]
        rows.insert(1, ("  with kernels='torch'", torch_ops, hf and hf["tokens_per_s"]))
    narrow = (
        ("  with kv_cache_dtype='bfloat16'", "engine_kv_bf16"),
        ("  with matmul_dtype='bfloat16'", "engine_matmul_bf16"),
    )
    for label, side in reversed(narrow):
        rows.insert(1, (label, r[side]["tokens_per_s"], hf and hf["tokens_per_s"]))
    for label, side in narrow:
        rows.insert(-2, (label, r[side]["fraction_of_floor"], hf and hf["fraction_of_floor"]))
    for name, ours, theirs in rows:
        ratio = f"{ours / theirs:8.2f}" if theirs else ""
        print(f"{name:34}{ours:12.2f}{(theirs or float('nan')):14.2f}{ratio}")
    bench_real.print_bf16_floor(r)
    bench_real.print_mismatch(r.get("logprob_mismatch", {}))
    for filters, ms in r.get("sampler_ms_64x151936", {}).items():
        print(
            f"sampling 64 rows x 151936 vocab, filters {filters}: compiled {ms['compiled']:.1f} ms, "
            f"torch path {ms['torch']:.1f} ms ({ms['torch'] / ms['compiled']:.1f}x; medians of 5 alternating calls)"
        )
    if "own_steps_floor" in r:
        bench_real.print_own_steps_floor(r["own_steps_floor"])
    fractions = ", ".join(f"{x:.2f}" for x in r["engine"]["runs_fraction_of_floor"])
    speedups = ", ".join(f"{x:.2f}" for x in r.get("speedup_per_round", []))
    print(
        f"rollout rows: medians of {r['repeats']} alternating rounds, each followed by its floor's GEMM timing; "
        f"engine fraction of floor per round: {fractions}"
        + (f"; engine/transformers per round: {speedups}" if speedups else "")
        + "; batch-1 and prefill rows: one run each"
    )


def write_json(path: Path, results: dict) -> None:
    """The results as indented JSON at `path` (its folder made if missing); the bench scripts share it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, help="default runs/bench.json (runs/bench_startup.json with --startup-only)"
    )
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="engine rows only")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; medians are reported")
    parser.add_argument("--startup-only", action="store_true", help="only the start-up rows")
    parser.add_argument("--workload", choices=("all", "bench-25m", "smollm2"), default="all")
    parser.add_argument("--profile", action="store_true", help="a per-op profile of the bench-25m workload too")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    print(describe())
    results = {}
    if not args.startup_only and args.workload in ("all", "bench-25m"):
        results = run(args)
        print_table(results)
        if "profile" in results:
            bench_real.print_profile("bench-25m", results["profile"])
    if not args.startup_only and args.workload in ("all", "smollm2"):
        results["smollm2"] = bench_real.run(args.repeats, args.skip_hf)
        bench_real.print_table(results["smollm2"])
    if args.startup_only or args.workload != "smollm2":
        results["startup"] = startup()
        print_startup(results["startup"])
    write_json(args.out or Path("runs/bench_startup.json" if args.startup_only else "runs/bench.json"), results)


if __name__ == "__main__":
    main()
