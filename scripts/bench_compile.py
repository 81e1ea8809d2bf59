"""Does `torch.compile` pay on the CPU? `bench-25m` rollouts on three engines
in one run, alternating rounds:

- the engine as it runs by default (compiled kernels, oneDNN GEMMs on packed
  weights);
- the engine on torch ops only (`kernels="torch"`);
- the same torch-ops engine with Inductor compiling what it can fuse: each
  residual add with the next RMSNorm, and the MLP (both GEMMs, SiLU, the
  product). Attention and the KV writes stay eager: they update inference
  tensors in place, which a compiled graph refuses.

Inductor is run without freezing: freezing would pack the weights into the
compiled code as constants, and a weight push would then go unseen. Without
it the GEMMs stay on torch's BLAS.

    python -m scripts.bench_compile [--repeats 3] [--out runs/bench_compile.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from rollout import Engine, SamplingParams
from rollout.model.decoder import Model, rms_norm
from scripts.bench import (
    ENGINE_SIZES,
    MAX_TOKENS,
    PROMPT_LEN,
    PROMPTS,
    STOP_IDS,
    N,
    make_checkpoint,
    time_engine,
    workload_prompts,
    write_json,
)


def _add_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    h = h + delta
    return h, rms_norm(h, weight, eps)


def _mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def use_fused_forward(model: Model, compile: bool = True) -> None:
    """Replace `model.forward` (a torch-ops model) by the same layers with each
    residual add fused into the next RMSNorm and the MLP as one function, both
    compiled by Inductor for dynamic row counts when `compile`."""
    if model._ops is not None or model.packed is not None:
        raise ValueError("use_fused_forward needs a model on torch ops (an engine with kernels='torch')")
    add_norm = torch.compile(_add_norm, dynamic=True) if compile else _add_norm
    mlp = torch.compile(_mlp, dynamic=True) if compile else _mlp

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta, kv, sample_rows):
        eps, layers = self.cfg.rms_norm_eps, self.layers
        h = F.embedding(input_ids, self.embed)
        x = rms_norm(h, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            h, x = add_norm(h, self._attention(i, layer, x, positions, meta, kv), layer.post_norm, eps)
            following = layers[i + 1].input_norm if i + 1 < len(layers) else self.norm
            h, x = add_norm(h, mlp(x, layer.gate_up, layer.down), following, eps)
        return self._project(x.index_select(0, sample_rows), *self._head).float()

    model.forward = types.MethodType(forward, model)


def run(repeats: int) -> dict:
    path = Path(tempfile.mkdtemp(prefix="bench_compile_"))
    make_checkpoint(path)
    engines = {
        "engine": Engine(path, **ENGINE_SIZES),
        "torch_ops": Engine(path, **ENGINE_SIZES, kernels="torch"),
        "torch_ops_compiled": Engine(path, **ENGINE_SIZES, kernels="torch"),
    }
    use_fused_forward(engines["torch_ops_compiled"].model)
    prompts = workload_prompts(PROMPTS, PROMPT_LEN)
    params = SamplingParams(n=N, max_tokens=MAX_TOKENS, temperature=1.0, stop_token_ids=STOP_IDS, ignore_eos=True)
    start = time.perf_counter()
    time_engine(engines["torch_ops_compiled"], prompts, params)  # compiles for dynamic shapes
    results: dict = {"first_run_with_compile_s": time.perf_counter() - start}
    for engine in engines.values():
        time_engine(engine, prompts, params)  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            tokens, seconds = time_engine(engine, prompts, params)
            runs[name].append(tokens / seconds)
    for name, per_s in runs.items():
        results[name] = {"tokens_per_s": statistics.median(per_s), "runs_tokens_per_s": per_s}
    return results


def print_table(results: dict, repeats: int) -> None:
    base = results["torch_ops"]["tokens_per_s"]
    print(f"bench-25m on CPU, {torch.get_num_threads()} threads; medians of {repeats} alternating rounds")
    for name in ("engine", "torch_ops", "torch_ops_compiled"):
        rate = results[name]["tokens_per_s"]
        print(f"  {name:20s} {rate:8.0f} tokens/s  {rate / base:5.2f}x torch ops")
    print(f"  first run of the compiled engine (compiling): {results['first_run_with_compile_s']:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_compile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_compile.json"))
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; medians are reported")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    results = run(args.repeats)
    print_table(results, args.repeats)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
