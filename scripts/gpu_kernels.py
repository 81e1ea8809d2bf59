"""The GPU checks of the kernels, for `scripts/gpu_check.py`: the device's
ceilings (copy bandwidth, GEMM rate) and a decode step's floor; paged decode
attention's bandwidth at several contexts; per decode step, GPU time against
host time, launches and the step over its floor, for the Triton kernels and
torch's ops; and the nano-vllm benchmark workload.

On the CPU (`--smoke`) every section runs at tiny sizes with the Triton
kernels under Triton's interpreter: that checks the script, not a GPU.
"""

from __future__ import annotations

import random
import statistics
import time
import timeit
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rollout import Engine, SamplingParams
from rollout.kernels.launch_count import counted_launches
from rollout.model.attention import AttentionMetadata, paged_attention
from scripts.bench import dense_params, flops_per_token, make_checkpoint, sync, time_engine, workload_prompts
from workspace import KVPool

KERNELS = ("triton", "torch")  # "triton" is what "auto" picks on CUDA


def best_seconds(fn, device: torch.device, repeats: int = 5) -> float:
    """Seconds of the fastest of `repeats` calls of `fn`, the device synchronized
    before and after each (timeit: garbage collection off while timing)."""
    return min(timeit.repeat(lambda: (fn(), sync(device)), setup=lambda: sync(device), repeat=repeats, number=1))


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read plus written per second by a device-to-device copy (best of 5)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), device)


def square_gemm_rate(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """FLOP/s of a size x size matrix product in `dtype` on `device` (best of 5, after 3 untimed)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    for _ in range(3):
        a @ b
    return 2 * size**3 / best_seconds(lambda: a @ b, device)


def decode_floor(config: dict, batch: int, context: float, bandwidth: float, flops_rate: float) -> dict:
    """Seconds of one bf16 decode step of `batch` rows at mean `context` tokens:
    memory floor (every multiplied weight and the rows' KV read once) and
    compute floor. Embedding rows are looked up, not read whole, so they are left out."""
    kv = config["num_key_value_heads"] * (config["hidden_size"] // config["num_attention_heads"])
    weight_bytes = 2 * dense_params(config)
    kv_bytes = batch * context * config["num_hidden_layers"] * 2 * kv * 2
    memory = (weight_bytes + kv_bytes) / bandwidth
    compute = batch * flops_per_token(context, config) / flops_rate
    return {"memory_s": memory, "compute_s": compute, "floor_s": max(memory, compute)}


def attention_bandwidth(device: torch.device, config: dict, bandwidth: float, batch: int, contexts, dtype) -> dict:
    """GB/s of K and V read by one layer's paged decode attention over `batch`
    rows at each context (pages scattered over the pool): the Triton kernel
    against torch's gather and SDPA, and the kernel's share of the copy bandwidth."""
    out = {}
    for context in contexts:
        row = {f"{name}_gb_s": _attention_gb_s(name, device, config, batch, context, dtype) for name in KERNELS}
        row["triton_over_copy_bandwidth"] = row["triton_gb_s"] * 1e9 / bandwidth
        out[f"context_{context}"] = row
    return out


def _attention_gb_s(kernels: str, device: torch.device, config: dict, batch: int, context: int, dtype) -> float:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim, page = config["hidden_size"] // heads, 16
    pages = -(-context // page)
    pool = _random_pool(batch * pages, page, kv_heads, dim, dtype, device)
    tables = torch.randperm(batch * pages, device=device).view(batch, pages)
    lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    q = torch.randn(batch, heads, dim, device=device).to(dtype)
    kv_bytes = 2 * batch * context * kv_heads * dim * pool.k.element_size()
    if kernels == "triton":
        from rollout.kernels.triton.paged_decode import paged_decode

        o = torch.empty_like(q)
        return (
            kv_bytes
            / best_seconds(lambda: paged_decode(q, pool.k[0], pool.v[0], tables, lens, o, 0.125, 0), device)
            / 1e9
        )
    meta = AttentionMetadata(
        slot_mapping=lens, prefills=[], num_prefill_tokens=0, num_decodes=batch,
        decode_block_tables=tables, decode_context_lens=lens,
    )  # fmt: skip
    return kv_bytes / best_seconds(lambda: paged_attention(q, 0, pool, meta, 0.125, None), device) / 1e9


def _random_pool(num_pages: int, page: int, kv_heads: int, dim: int, dtype, device) -> KVPool:
    pool = KVPool(
        num_layers=1, num_pages=num_pages, page_size=page, num_kv_heads=kv_heads, head_dim=dim,
        dtype=dtype, device=device,
    )  # fmt: skip
    pool.k.normal_()
    pool.v.normal_()
    return pool


def decode_steps(
    path: Path, device: torch.device, config: dict, batches, max_tokens: int, ceilings: dict, dtype: str
) -> dict:
    """Per full-batch decode step, for each kernel choice: GPU time (CUDA
    events around the step's model and sampler), host time (the step's wall
    time), kernel launches (counted on the same step run eagerly) and the
    step over its floor."""
    out: dict = {}
    for kernels in KERNELS:
        graphs = "auto" if device.type == "cuda" else "eager"  # eager: the padded steps, counted the same
        engine = Engine(path, device=device, dtype=dtype, max_batch_size=max(batches), max_seq_len=512,
                        kernels=kernels, decode_graphs=graphs)  # fmt: skip
        for batch in batches:
            prompts = workload_prompts(batch // 8, 32, seed=batch, vocab=config["vocab_size"])
            params = SamplingParams(n=8, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
            time_engine(engine, prompts, params)  # warm-up: captures the graphs
            gpu = _gpu_step_seconds(engine, prompts, params, batch)
            since = time.time()
            tokens, seconds = time_engine(engine, prompts, params)
            host = statistics.median(s.seconds for s in engine.step_log(since) if s.num_tokens == batch)
            floor = decode_floor(config, batch, 32 + max_tokens / 2, ceilings["bandwidth"], ceilings["rate"])
            launches = count_step_launches(engine, batch)
            out[f"{kernels}_batch_{batch}"] = {
                "tokens_per_s": tokens / seconds,
                "step_s": host,
                "gpu_step_s": gpu,
                "floor_s": floor["floor_s"],
                "step_over_floor": host / floor["floor_s"],
                "gpu_over_floor": gpu / floor["floor_s"] if gpu else None,
                "launches_per_step": launches,  # -1: the engine has no decode graphs to count
            }
        engine.close()
    return out


def _gpu_step_seconds(engine: Engine, prompts, params, batch: int) -> float | None:
    """Median GPU time of the full-batch pure-decode steps of one run (None off CUDA)."""
    if engine.config.device.type != "cuda":
        return None
    stepper, run, events = engine.stepper, engine.stepper._run, []

    def timed_run(plan, prepared):
        if prepared.signature is None or prepared.num_rows != batch:
            return run(plan, prepared)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        top = run(plan, prepared)
        end.record()
        events.append((start, end))
        return top

    stepper._run = timed_run
    try:
        time_engine(engine, prompts, params)
    finally:
        del stepper._run
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) / 1e3 for s, e in events) if events else None


def count_step_launches(engine: Engine, batch: int) -> int:
    """Kernels one padded decode step of `batch` rows launches, run eagerly over
    the workspace as a graph would capture it (the engine has finished its
    work; the step writes only its workspace rows' slots)."""
    stepper = engine.stepper
    key = stepper.graphs.key(batch, 1, stepper._flags) if stepper.graphs is not None else None
    if key is None:
        return -1
    with counted_launches() as count:
        stepper._padded_decode(key)
    sync(engine.config.device)
    return count.total


def nano_vllm_workload(
    seqs: int, max_input: int, max_output: int, vocab: int = 10001
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's benchmark: seed 0, `seqs` prompts of 100..max_input random ids
    up to 10000, each with 100..max_output output tokens (below 100: max_input
    and max_output exactly, and ids below a smaller `vocab`, for smoke runs)."""
    rng = random.Random(0)
    low_in, low_out, top = min(100, max_input), min(100, max_output), min(10000, vocab - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(low_in, max_input))] for _ in range(seqs)]
    return prompts, [rng.randint(low_out, max_output) for _ in range(seqs)]


def nano_vllm(
    path: Path, device: torch.device, vocab: int, seqs: int, max_len: int, dtype: str, kernels=KERNELS,
    async_scheduling="auto",
) -> dict:  # fmt: skip
    """Output tokens per second of the nano-vllm workload (temperature 0.6,
    `ignore_eos`, wall time including prefill), default engine settings with a
    2048-token context; one caller thread per prompt, as each has its own length."""
    prompts, lengths = nano_vllm_workload(seqs, max_len, max_len, vocab)
    out = {}
    for name in kernels:
        engine = Engine(path, device=device, dtype=dtype, max_seq_len=2 * max_len, kernels=name,
                        async_scheduling=async_scheduling)  # fmt: skip
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # warm-up, as nano-vllm's script does
        tokens, seconds = _nano_run(engine, prompts, lengths)
        assert tokens == sum(lengths), (tokens, sum(lengths))
        out[name] = {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        engine.close()
    return out


def _nano_run(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> tuple[int, float]:
    def one(prompt: list[int], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
        return len(engine.generate([prompt], params)[0].samples[0].token_ids)

    device = engine.config.device
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        sync(device)
        start = time.perf_counter()
        tokens = sum(pool.map(one, prompts, lengths))
        sync(device)
        return tokens, time.perf_counter() - start


def nano_vllm_model(root: Path, device: torch.device, config: dict, name: str, seqs: int, max_len: int,
                    dtype: str, kernels=KERNELS) -> dict:  # fmt: skip
    path = root / name
    make_checkpoint(path, config, getattr(torch, dtype))
    return nano_vllm(path, device, config["vocab_size"], seqs, max_len, dtype, kernels)
