"""Overlapped scheduling on the GPU: the same engine with `async_scheduling`
on and off, side by side in one run.

- steady decode at each batch: tokens/s, and how busy the GPU was (CUDA
  events around every step's model and sampler, summed, over the run's wall
  time: the host's part of a step shows as the rest);
- the GRPO-shaped workload (prompts x 8 samples, stop tokens, temperature 1)
  and the nano-vllm workload: tokens/s.

Run from `scripts/gpu_check.py` (section "overlap"); its `--smoke` runs it
tiny on the CPU, where both sides compute the same steps synchronously.
"""

from __future__ import annotations

import time

import torch

from rollout import Engine, SamplingParams
from scripts.bench import STOP_IDS, make_checkpoint, time_engine, workload_prompts
from scripts.gpu_kernels import nano_vllm, sync

MODES = {"async": True, "sync": False}


def overlap(root, device: torch.device, config: dict, batches, max_tokens: int, dtype: str, nano: dict) -> dict:
    path = root / "overlap"
    make_checkpoint(path, config, getattr(torch, dtype))
    out: dict = {}
    kw = dict(device=device, dtype=dtype, max_batch_size=max(batches), max_seq_len=512)
    engines = {name: Engine(path, async_scheduling=flag, **kw) for name, flag in MODES.items()}
    for batch in batches:
        prompts = workload_prompts(batch // 8, 32, seed=batch, vocab=config["vocab_size"])
        params = SamplingParams(n=8, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        runs = {name: busy_run(engine, prompts, params) for name, engine in engines.items()}
        row = {name: run for name, (run, _) in runs.items()}
        row["speedup"] = row["async"]["tokens_per_s"] / row["sync"]["tokens_per_s"]
        samples = [runs[name][1] for name in MODES]  # seeded alike: the same tokens, unless rounding differs
        row["identical_samples"] = f"{sum(a == b for a, b in zip(*samples, strict=True))}/{len(samples[0])}"
        out[f"decode_batch_{batch}"] = row
    grpo = workload_prompts(max(batches) // 8, 48, seed=7, vocab=config["vocab_size"])
    grpo_params = SamplingParams(n=8, max_tokens=max_tokens, temperature=1.0, stop_token_ids=STOP_IDS, ignore_eos=True)
    row = {}
    for name, engine in engines.items():
        time_engine(engine, grpo, grpo_params)  # warm-up
        tokens, seconds = time_engine(engine, grpo, grpo_params)
        row[name] = {"tokens_per_s": tokens / seconds}
    row["speedup"] = row["async"]["tokens_per_s"] / row["sync"]["tokens_per_s"]
    out["grpo"] = row
    for engine in engines.values():
        engine.close()
    row = {}
    for name, flag in MODES.items():
        (row[name],) = nano_vllm(
            path, device, config["vocab_size"], dtype=dtype, kernels=("auto",), async_scheduling=flag, **nano
        ).values()
    row["speedup"] = row["async"]["tokens_per_s"] / row["sync"]["tokens_per_s"]
    out["nano_vllm"] = row
    return out


def busy_run(engine: Engine, prompts, params) -> tuple[dict, list[list[int]]]:
    """Tokens/s of one run after a warm-up, the share of its wall time the GPU spent
    in the steps' model and sampler (None off CUDA), and the run's samples."""
    time_engine(engine, prompts, params)  # warm-up: graphs captured
    cuda = engine.config.device.type == "cuda"
    stepper, run, events = engine.stepper, engine.stepper._run, []

    def timed_run(plan, prepared):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        extras = run(plan, prepared)
        end.record()
        events.append((start, end))
        return extras

    if cuda:
        stepper._run = timed_run
    try:
        sync(engine.config.device)
        started = time.perf_counter()
        samples = [s.token_ids for o in engine.generate(prompts, params) for s in o.samples]
        sync(engine.config.device)
        wall = time.perf_counter() - started
    finally:
        if cuda:
            del stepper._run
    busy = sum(s.elapsed_time(e) for s, e in events) / 1e3 / wall if cuda else None
    tokens = sum(map(len, samples))
    return {"tokens_per_s": tokens / wall, "gpu_busy": busy, "steps": len(events)}, samples
