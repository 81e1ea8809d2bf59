"""Every GPU check in one call: bf16 parity against transformers on the GPU,
CUDA graphs against the eager path, a float32 model's bf16 KV pool against
transformers float32, `bench-25m` against transformers `generate()`, and a
Qwen2.5-0.5B-shaped bf16 model at batch 64 and 256 against transformers,
against the floor of a decode step and against itself without decode graphs;
then the kernels (`scripts/gpu_kernels.py`): paged decode attention's
bandwidth, per decode step GPU and host time and launches with the Triton
kernels and with torch's ops, and the nano-vllm workload on Qwen2.5-0.5B,
Qwen2.5-1.5B and (time allowing) Llama-3-8B shapes; sleep/wake of a bf16
engine (device memory handed back to the driver, times, samples after each
wake against samples before); overlapped scheduling on and off
(`scripts/gpu_overlap.py`); and (time allowing) a bf16 Qwen3-MoE
(`bench-moe`) against transformers, with its experts as grouped GEMMs and as
a loop over experts. Prints a table and writes JSON. Each section runs under
a time limit; one that fails or runs out records why, and the next runs.

    python -m scripts.gpu_check [--out runs/gpu_check.json]
    python -m scripts.gpu_check --smoke   # tiny sizes on the CPU: checks the script, not a GPU

Drives `rollout.Engine` directly (no Ray). Floors of a decode step: memory
= (weight bytes + KV bytes read) / measured copy bandwidth (bytes read and
written per second of a device-to-device copy); compute = FLOPs / measured
GEMM rate in the model's dtype; the floor is the larger of the two.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from rollout import Engine, SamplingParams
from scripts import bench_real, gpu_kernels, gpu_overlap
from scripts.bench import (  # the bench-25m workload and its timers
    BENCH_25M,
    STOP_IDS,
    make_checkpoint,
    time_engine,
    time_hf,
    workload_prompts,
    write_json,
)
from scripts.gpu_kernels import copy_bandwidth, decode_floor, square_gemm_rate
from scripts.presets import preset

QWEN25_05B = preset("qwen2.5-0.5b")
PARITY = preset("gpu-parity")
SMOKE = preset("smoke")


def graph_report(engine: Engine) -> dict:
    """The engine's decode-graph counters, and why each failed capture failed
    (a failed capture serves its steps eagerly, at eager speed)."""
    stats = engine.stats()
    graphs = engine.stepper.graphs
    failures = graphs.capture_failures if graphs is not None else {}
    return {
        "graphs_captured": stats["decode_graphs_captured"],
        "graph_replays": stats["decode_graph_replays"],
        "graph_capture_failures": {str(key): why[:500] for key, why in failures.items()},
    }


def parity(root: Path, device: torch.device, config: dict) -> dict:
    """Teacher-forced bf16 logprobs of the engine's samples against transformers
    in bf16 on the same device, and CUDA graph replays against the same padded
    steps run eagerly."""
    path = root / "parity"
    hf = make_checkpoint(path, config, torch.bfloat16)
    hf = hf.to(device)
    prompts = workload_prompts(6, 40, seed=3, vocab=config["vocab_size"])
    params = SamplingParams(n=4, max_tokens=48, ignore_eos=True, seed=11, logprobs_mode="raw")
    kw = dict(device=device, dtype="bfloat16", max_batch_size=32, max_seq_len=256, kv_cache_tokens=8192)
    graphed = Engine(path, decode_graphs="cuda" if device.type == "cuda" else "eager", **kw)
    outs = graphed.generate(prompts, params)
    errors = bench_real.sampled_logprob_diffs(hf, outs)
    # Replays against the same padded steps without capture (on a GPU: must be
    # identical), and against plain unpadded steps (equal up to rounding, so
    # bf16 samples may part ways after a near tie).
    reference = {"padded": "eager", "plain": "off"} if device.type == "cuda" else {"plain": "off"}
    compared = {}
    for name, mode in reference.items():
        other = Engine(path, decode_graphs=mode, **kw).generate(prompts, params)
        same = [
            a.token_ids == b.token_ids
            for o1, o2 in zip(outs, other, strict=True)
            for a, b in zip(o1.samples, o2.samples, strict=True)
        ]
        compared[f"graph_vs_{name}_identical_samples"] = f"{sum(same)}/{len(same)}"
    return {
        "bf16_mean_abs_dlogprob": errors.mean().item(),
        "bf16_max_abs_dlogprob": errors.max().item(),
        **compared,
        **graph_report(graphed),
    }


def kv_bf16(root: Path, device: torch.device, config: dict) -> dict:
    """A float32 model's logprobs against transformers float32 on the same
    device, with its own float32 KV pool, with `kv_cache_dtype="bfloat16"` and
    with `matmul_dtype="bfloat16"`."""
    path = root / "kv_bf16"
    hf = make_checkpoint(path, config, torch.float32).to(device)
    prompts = workload_prompts(4, 40, seed=5, vocab=config["vocab_size"])
    params = SamplingParams(n=2, max_tokens=32, ignore_eos=True, seed=7, logprobs_mode="raw")
    out = {}
    options = {"float32_pool": {}, "bfloat16_pool": {"kv_cache_dtype": "bfloat16"}}
    options["bfloat16_matmul"] = {"matmul_dtype": "bfloat16"}
    for name, option in options.items():
        engine = Engine(path, device=device, max_batch_size=16, max_seq_len=256, **option)
        errors = bench_real.sampled_logprob_diffs(hf, engine.generate(prompts, params))
        out[f"{name}_mean_abs_dlogprob"] = errors.mean().item()
        out[f"{name}_max_abs_dlogprob"] = errors.max().item()
    return out


def bench_25m(root: Path, device: torch.device, config: dict, prompts: int, n: int, max_tokens: int) -> dict:
    path = root / "bench25m"
    hf = make_checkpoint(path, config, torch.float32)
    hf = hf.to(device)
    graphs = "cuda" if device.type == "cuda" else "off"
    kw = dict(max_batch_size=prompts * n, max_seq_len=512, kv_cache_tokens=64 * 1024, decode_graphs=graphs)
    engine = Engine(path, device=device, **kw)
    batch = workload_prompts(prompts, 32, vocab=config["vocab_size"])
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, stop_token_ids=STOP_IDS, ignore_eos=True)
    time_engine(engine, batch, params)  # warm-up: the whole workload once, capturing its graphs
    time_hf(hf, batch[:2], 1, 4)
    tokens, seconds = time_engine(engine, batch, params)
    hf_tokens, hf_seconds = time_hf(hf, batch, n, max_tokens)
    return {
        "engine_tokens_per_s": tokens / seconds,
        "transformers_tokens_per_s": hf_tokens / hf_seconds,
        "speedup": (tokens / seconds) / (hf_tokens / hf_seconds),
        **graph_report(engine),
    }


def moe(root: Path, device: torch.device, config: dict, dtype: torch.dtype, prompts: int, max_tokens: int) -> dict:
    """A Qwen3-MoE (`bench-moe`) in `dtype`: the engine's sampled tokens' logprobs
    against transformers on the same device, and its tokens/s on a GRPO batch
    (8 samples a prompt) against transformers `generate()`, with the experts as
    grouped GEMMs (`torch._grouped_mm`, where `rollout.model.moe` takes it) and
    as the per-expert loop."""
    from rollout.model import moe as moe_module

    path = root / "moe"
    hf = make_checkpoint(path, config, dtype).to(device)
    batch = workload_prompts(prompts, 32, vocab=config["vocab_size"])
    params = SamplingParams(n=8, max_tokens=max_tokens, ignore_eos=True, seed=0, logprobs_mode="raw")
    kw = dict(max_batch_size=prompts * 8, max_seq_len=256, kv_cache_tokens=32 * 1024)
    engine = Engine(path, device=device, dtype=str(dtype).removeprefix("torch."), **kw)
    grouped = moe_module.use_grouped_mm(
        torch.zeros(1, config["hidden_size"], device=device, dtype=dtype), engine.model_config.moe
    )
    errors = bench_real.sampled_logprob_diffs(hf, engine.generate(batch[:2], params))
    out = {"grouped_mm": grouped, "mean_abs_dlogprob": errors.mean().item(), "max_abs_dlogprob": errors.max().item()}
    for name, flag in (("grouped", True), ("loop", False)):
        moe_module.GROUPED_MM = flag
        try:
            time_engine(engine, batch[:2], params)  # warm-up
            tokens, seconds = time_engine(engine, batch, params)
        finally:
            moe_module.GROUPED_MM = True
        out[f"{name}_tokens_per_s"] = tokens / seconds
    time_hf(hf, batch[:2], 1, 4)
    hf_tokens, hf_seconds = time_hf(hf, batch, 8, max_tokens, stop_ids=None)
    out["transformers_tokens_per_s"] = hf_tokens / hf_seconds
    out["speedup"] = out["grouped_tokens_per_s"] / out["transformers_tokens_per_s"]
    return out


def qwen_05b(root: Path, device: torch.device, config: dict, batches: tuple[int, ...], max_tokens: int) -> dict:
    path = root / "qwen05b"
    hf = make_checkpoint(path, config, torch.bfloat16)
    hf = hf.to(device)
    is_cuda = device.type == "cuda"
    bandwidth = copy_bandwidth(device, 2**30 if is_cuda else 2**24)
    rate = square_gemm_rate(device, torch.bfloat16, 8192 if is_cuda else 256)
    out: dict = {"copy_bandwidth_gb_s": bandwidth / 1e9, "bf16_gemm_tflop_s": rate / 1e12}
    kw = dict(dtype="bfloat16", max_batch_size=max(batches), max_seq_len=512)
    engine = Engine(path, device=device, **kw)  # decode graphs as a user gets them: "auto"
    eager = Engine(path, device=device, decode_graphs="off", **kw)
    for batch in batches:
        prompts = workload_prompts(batch // 8, 32, seed=batch, vocab=config["vocab_size"])
        params = SamplingParams(n=8, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        tokens, seconds, step = timed_decode(engine, prompts, params, batch)
        eager_tokens, eager_seconds, eager_step = timed_decode(eager, prompts, params, batch)
        floor = decode_floor(config, batch, 32 + max_tokens / 2, bandwidth, rate)
        hf_tokens, hf_seconds = time_hf(hf, prompts, 8, max_tokens, stop_ids=None)
        out[f"batch_{batch}"] = {
            "engine_tokens_per_s": tokens / seconds,
            "transformers_tokens_per_s": hf_tokens / hf_seconds,
            "speedup": (tokens / seconds) / (hf_tokens / hf_seconds),
            "decode_step_s": step,
            **floor,
            "step_over_floor": step / floor["floor_s"],
            "graphs_off_tokens_per_s": eager_tokens / eager_seconds,
            "graphs_off_decode_step_s": eager_step,
        }
    out.update(graph_report(engine))
    return out


def sleep_wake(root: Path, device: torch.device, config: dict, kv_tokens: int) -> dict:
    """`sleep(1)` then `sleep(2)` of a bf16 engine that has served: the memory
    each hands back (on CUDA the driver's free memory, `mem_get_info`, so
    memory kept in torch's cache does not count; on the CPU the resident
    memory), the time to sleep, to push the weights back after level 2 and to
    wake, and whether the samples after each wake equal those before the
    first sleep (same weights, same seeds)."""
    path = root / "sleep_wake"
    state = make_checkpoint(path, config, torch.bfloat16).state_dict()
    engine = Engine(
        path, device=device, dtype="bfloat16", max_batch_size=32, max_seq_len=256, kv_cache_tokens=kv_tokens
    )
    prompts = workload_prompts(4, 40, seed=9, vocab=config["vocab_size"])
    params = SamplingParams(n=2, max_tokens=24, ignore_eos=True, seed=5, logprobs_mode="raw")
    samples = lambda: [[s.token_ids for s in o.samples] for o in engine.generate(prompts, params)]  # noqa: E731
    before = samples()
    engine.kv_pool.k.fill_(0)  # the pool resident on the CPU too, as after long use
    engine.kv_pool.v.fill_(0)
    out = {"weights_bytes": sum(p.nbytes for p in engine.model.parameters()), "kv_bytes": engine.kv_pool.nbytes}
    for level in (1, 2):
        held = _held_bytes(device)
        start = time.perf_counter()
        engine.sleep(level)
        out[f"sleep{level}_s"] = _synced(device, start)
        out[f"sleep{level}_freed_bytes"] = held - _held_bytes(device)
        if level == 2:
            start = time.perf_counter()
            engine.update_weights(state)
            out["push_after_level2_s"] = _synced(device, start)
        start = time.perf_counter()
        engine.wake_up()
        out[f"wake{level}_s"] = _synced(device, start)
        out[f"level{level}_same_samples"] = samples() == before
    engine.close()
    return out


def _held_bytes(device: torch.device) -> int:
    """Memory this process holds: on CUDA the device's used memory as the driver sees it, else resident."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    from rollout.cluster.host import resident_bytes

    return resident_bytes()


def _synced(device: torch.device, start: float) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def timed_decode(engine: Engine, prompts, params, batch: int) -> tuple[int, float, float]:
    """Tokens and seconds of the workload after a warm-up run (which captures
    its graphs), and the median full-batch decode step's seconds."""
    time_engine(engine, prompts, params)
    since = time.time()
    tokens, seconds = time_engine(engine, prompts, params)
    steps = [s.seconds for s in engine.step_log(since) if s.num_tokens == batch]
    return tokens, seconds, statistics.median(steps)


RUN_LIMIT_S = 520  # the whole run, so that it ends within 9 minutes with start-up and teardown


class SectionTimeout(Exception):
    """A section ran past its time limit."""


def guarded(section, limit_s: int):
    """`section()`, interrupted by `SectionTimeout` after `limit_s` seconds (SIGALRM, main thread)."""

    def expire(signum, frame):
        raise SectionTimeout(f"ran past its limit of {limit_s} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit_s)
    try:
        return section()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def sections(root: Path, device: torch.device, smoke: bool) -> dict:
    """name -> (section, time limit in seconds, start only before this many seconds of the run)."""
    # The smoke run takes the tiny model everywhere, fewer prompts, smaller batches and shorter samples;
    # the kernels' sections run float32 there (Triton's interpreter does not compute bfloat16 faithfully).
    parity_model, bench_model, qwen_model = (SMOKE, SMOKE, SMOKE) if smoke else (PARITY, BENCH_25M, QWEN25_05B)
    prompts, batches, max_tokens = (2, (16, 32), 16) if smoke else (16, (64, 256), 128)
    step_batches, step_tokens, dtype = ((8, 16), 3, "float32") if smoke else ((64, 128, 256), 128, "bfloat16")
    contexts, attention_batch = ((16, 40), 2) if smoke else ((128, 1024, 4096), 64)
    nano = dict(seqs=3, max_len=12) if smoke else dict(seqs=256, max_len=1024)
    moe_model, moe_batch = (preset("bench-moe"), (8, 64))
    if smoke:  # bench-moe's family at the smoke model's size
        moe_model = {**moe_model, **SMOKE, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
        moe_model["head_dim"] = 16
        moe_model["model_type"], moe_batch = "qwen3_moe", (2, 4)
    ceilings: dict = {}
    bf16 = getattr(torch, dtype)

    def measure_ceilings() -> dict:
        cuda = device.type == "cuda"
        ceilings["bandwidth"] = copy_bandwidth(device, 2**30 if cuda else 2**24)
        ceilings["rate"] = square_gemm_rate(device, torch.bfloat16, 8192 if cuda else 256)
        return {"copy_bandwidth_gb_s": ceilings["bandwidth"] / 1e9, "bf16_gemm_tflop_s": ceilings["rate"] / 1e12}

    def steps() -> dict:
        path = root / "steps"
        make_checkpoint(path, qwen_model, bf16)
        return gpu_kernels.decode_steps(path, device, qwen_model, step_batches, step_tokens, ceilings, dtype)

    def nano_run(name: str, kernels=gpu_kernels.KERNELS):
        config = SMOKE if smoke else preset(name)
        return lambda: gpu_kernels.nano_vllm_model(root, device, config, name, dtype=dtype, kernels=kernels, **nano)

    attention = lambda: gpu_kernels.attention_bandwidth(  # noqa: E731
        device, qwen_model, ceilings["bandwidth"], attention_batch, contexts, bf16
    )
    return {
        "parity": (lambda: parity(root, device, parity_model), 120, None),
        "overlap": (
            lambda: gpu_overlap.overlap(root, device, qwen_model, step_batches[::2], step_tokens, dtype, nano),
            150,
            None,
        ),
        "kv_bf16": (lambda: kv_bf16(root, device, parity_model), 90, None),
        "bench_25m": (
            lambda: bench_25m(root, device, bench_model, prompts=prompts, n=8, max_tokens=max_tokens),
            90,
            None,
        ),
        "qwen2.5_0.5b": (lambda: qwen_05b(root, device, qwen_model, batches=batches, max_tokens=max_tokens), 150, None),
        "sleep_wake": (lambda: sleep_wake(root, device, qwen_model, 4096 if smoke else 262144), 60, None),
        "ceilings": (measure_ceilings, 30, None),
        "attention": (attention, 60, None),
        "decode_steps": (steps, 120, None),
        "nano_vllm_qwen2.5-0.5b": (nano_run("qwen2.5-0.5b"), 120, None),
        "moe": (lambda: moe(root, device, moe_model, bf16, *moe_batch), 90, 360),
        "nano_vllm_qwen2.5-1.5b": (nano_run("qwen2.5-1.5b", ("triton",)), 120, 420),
        "nano_vllm_llama-3-8b": (nano_run("llama-3-8b", ("triton",)), 150, 330),
    }


def run(args) -> dict:
    """Every section in turn, each under its time limit; a section that raises
    or runs out records why and the others still run; a late section is skipped
    rather than started when too little of the run's time is left. The JSON is
    rewritten after each section, so a run cut short keeps what it measured."""
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke to check the script on the CPU")
    if smoke:  # the Triton kernels' sections run under the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    root = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    start = time.perf_counter()
    for name, (section, limit_s, start_before_s) in sections(root, device, smoke).items():
        elapsed = time.perf_counter() - start
        left = RUN_LIMIT_S - elapsed  # every section ends inside the run's limit
        if not smoke and (left < 20 or (start_before_s is not None and elapsed > start_before_s)):
            results[name] = {"skipped": f"{elapsed:.0f} s into the run, too late to start"}
            continue
        try:
            results[name] = guarded(section, limit_s if smoke else min(limit_s, int(left)))
        except Exception:  # recorded, and the next section runs
            traceback.print_exc()
            results[name] = {"error": traceback.format_exc()}
        results["seconds"] = time.perf_counter() - start
        write_json(args.out, results)
    return results


def print_table(r: dict) -> None:
    print(f"device: {r['device']}   ({r['seconds']:.0f} s)")
    ok = {}
    for name in ("parity", "kv_bf16", "bench_25m", "qwen2.5_0.5b"):
        section = r[name]
        if "error" in section:
            print(f"{name} FAILED: {section['error'].strip().splitlines()[-1]}")
            continue
        ok[name] = section
        if section.get("graph_capture_failures"):
            print(f"{name}: graph captures failed, served eagerly: {section['graph_capture_failures']}")
    if p := ok.get("parity"):
        print(
            f"bf16 parity vs transformers: mean |dlogprob| {p['bf16_mean_abs_dlogprob']:.4f}, "
            f"max {p['bf16_max_abs_dlogprob']:.4f}; identical samples, graphs vs padded eager "
            f"{p.get('graph_vs_padded_identical_samples', '-')}, vs plain eager "
            f"{p['graph_vs_plain_identical_samples']}; {p['graphs_captured']} graphs, {p['graph_replays']} replays"
        )
    if k := ok.get("kv_bf16"):
        print(
            f"float32 model vs transformers float32: mean |dlogprob| {k['float32_pool_mean_abs_dlogprob']:.1e} "
            f"(max {k['float32_pool_max_abs_dlogprob']:.1e}) as it is, {k['bfloat16_pool_mean_abs_dlogprob']:.1e} "
            f"(max {k['bfloat16_pool_max_abs_dlogprob']:.1e}) with a bfloat16 KV pool, "
            f"{k['bfloat16_matmul_mean_abs_dlogprob']:.1e} (max {k['bfloat16_matmul_max_abs_dlogprob']:.1e}) "
            "with bfloat16 projections"
        )
    header = ("engine tok/s", 14), ("HF tok/s", 12), ("speedup", 9), ("step ms", 9), ("floor ms", 10), ("x floor", 9)
    print(f"{'workload':26}" + "".join(f"{name:>{width}}" for name, width in header))
    if b := ok.get("bench_25m"):
        print(
            f"{'bench-25m (fp32)':26}{b['engine_tokens_per_s']:14.0f}{b['transformers_tokens_per_s']:12.0f}"
            f"{b['speedup']:9.2f}"
        )
    if q := ok.get("qwen2.5_0.5b"):
        for name, row in q.items():
            if name.startswith("batch_"):
                print(
                    f"{'qwen2.5-0.5b bf16 ' + name:26}{row['engine_tokens_per_s']:14.0f}"
                    f"{row['transformers_tokens_per_s']:12.0f}{row['speedup']:9.2f}"
                    f"{row['decode_step_s'] * 1e3:9.2f}{row['floor_s'] * 1e3:10.2f}{row['step_over_floor']:9.2f}"
                )
                print(
                    f"{'  decode_graphs=off':26}{row['graphs_off_tokens_per_s']:14.0f}{'':21}"
                    f"{row['graphs_off_decode_step_s'] * 1e3:9.2f}"
                )
        print(f"copy bandwidth {q['copy_bandwidth_gb_s']:.0f} GB/s, bf16 GEMM {q['bf16_gemm_tflop_s']:.1f} TFLOP/s")
    print_overlap(r.get("overlap", {}))


def print_overlap(o: dict) -> None:
    """async_scheduling on against off: tokens/s, and the GPU's busy share in steady decode."""
    if "error" in o or "skipped" in o:
        print(f"overlap: {o.get('error', o.get('skipped', '')).strip().splitlines()[-1]}")
        return
    for name, row in o.items():
        busy = " ".join(
            f"{mode} busy {row[mode]['gpu_busy']:.0%}" for mode in ("async", "sync") if row[mode].get("gpu_busy")
        )
        print(
            f"overlap {name:18} async {row['async']['tokens_per_s']:9.0f} tok/s, sync "
            f"{row['sync']['tokens_per_s']:9.0f} ({row['speedup']:.2f}x) {busy} "
            f"{'identical ' + row['identical_samples'] if 'identical_samples' in row else ''}"
        )


def print_sleep_wake(r: dict) -> None:
    s = r.get("sleep_wake", {})
    if "error" in s or "skipped" in s:
        print(f"sleep_wake: {s.get('skipped') or s['error'].strip().splitlines()[-1]}")
        return
    if not s:
        return
    mib = 2**20
    print(f"sleep/wake: weights {s['weights_bytes'] / mib:.0f} MiB, KV pool {s['kv_bytes'] / mib:.0f} MiB")
    for level in (1, 2):
        freed, slept, woke = s[f"sleep{level}_freed_bytes"] / mib, s[f"sleep{level}_s"] * 1e3, s[f"wake{level}_s"] * 1e3
        same = s[f"level{level}_same_samples"]
        print(f"  level {level}: freed {freed:.0f} MiB in {slept:.1f} ms, wake_up {woke:.1f} ms, same samples: {same}")
    print(f"  whole push after level 2: {s['push_after_level2_s'] * 1e3:.0f} ms")


def print_kernels(r: dict) -> None:
    """The kernels' sections: attention bandwidth, decode steps, the MoE model, the nano-vllm workload."""
    for name in ("ceilings", "attention", "decode_steps"):
        if "error" in r.get(name, {}):
            print(f"{name} FAILED: {r[name]['error'].strip().splitlines()[-1]}")
    if a := r.get("attention"):
        if "error" not in a:
            for context, row in a.items():
                print(
                    f"paged decode attention, {context}: triton {row['triton_gb_s']:.0f} GB/s "
                    f"({row['triton_over_copy_bandwidth']:.2f} of copy), torch gather+SDPA {row['torch_gb_s']:.0f} GB/s"
                )
    if (d := r.get("decode_steps")) and "error" not in d:
        print(f"{'decode step':24}{'tok/s':>10}{'step ms':>9}{'GPU ms':>9}{'x floor':>9}{'GPU x fl':>9}{'launches':>9}")
        for name, row in d.items():
            gpu = row["gpu_step_s"]
            print(
                f"{name:24}{row['tokens_per_s']:10.0f}{row['step_s'] * 1e3:9.2f}"
                f"{(gpu or 0) * 1e3:9.2f}{row['step_over_floor']:9.2f}{(row['gpu_over_floor'] or 0):9.2f}"
                f"{row['launches_per_step']:9d}"
            )
    if m := r.get("moe"):
        if "error" in m or "skipped" in m:
            print(f"moe: {m.get('skipped') or m['error'].strip().splitlines()[-1]}")
        else:
            print(
                f"moe (bench-moe): grouped GEMMs {m['grouped_tokens_per_s']:.0f} tok/s (taken: {m['grouped_mm']}), "
                f"expert loop {m['loop_tokens_per_s']:.0f}, transformers {m['transformers_tokens_per_s']:.0f} "
                f"({m['speedup']:.2f}x); |dlogprob| mean {m['mean_abs_dlogprob']:.4f}, max {m['max_abs_dlogprob']:.4f}"
            )
    for name, section in r.items():
        if name.startswith("nano_vllm"):
            if "error" in section or "skipped" in section:
                print(f"{name}: {section.get('skipped') or section['error'].strip().splitlines()[-1]}")
                continue
            rates = ", ".join(f"{k} {v['tokens_per_s']:.0f} tok/s ({v['seconds']:.1f} s)" for k, v in section.items())
            print(f"{name}: {rates}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script only")
    args = parser.parse_args(argv)
    results = run(args)
    print_table(results)
    print_sleep_wake(results)
    print_kernels(results)
    return results


if __name__ == "__main__":
    main()
