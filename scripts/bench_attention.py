"""The compiled decode-attention kernel against the host's DRAM read bandwidth.

At decode batch sizes every row reads its whole context's keys and values
once per layer, which no cache holds at 100+ rows: the kernel's floor is
those bytes at the rate the host reads memory. This times
`torch.ops.rollout.paged_decode` over the layers of a model's shapes
(`bench-25m` by default) at `--rows` rows of `--context` tokens, pages
scattered across a pool as a busy engine leaves them (or in order with
`--pages sequential`), for a float32 and a bfloat16 pool, and the read floor
as the best of 5 sums over a 1 GiB tensor.

    python -m scripts.bench_attention [--rows 128] [--context 100 200] [--pages scattered|sequential]
                                      [--model bench-25m] [--out runs/bench_attention.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from rollout.kernels.build import cpu_ops
from scripts.host import describe
from scripts.presets import preset

PAGE_SIZE = 16


def read_bandwidth(nbytes: int = 1 << 30, runs: int = 5) -> float:
    """Bytes per second of the best of `runs` sums over an `nbytes` float32 tensor."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = min(_seconds(lambda: x.sum()) for _ in range(runs))
    return x.nbytes / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_attention(config: dict, rows: int, context: int, dtype: torch.dtype, sequential: bool, runs: int = 10):
    """(best seconds of `runs` passes over all layers, bytes of K and V each pass reads)."""
    ops = cpu_ops()
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    pages_per_row = -(-context // PAGE_SIZE)
    num_pages = 2 * rows * pages_per_row
    g = torch.Generator().manual_seed(0)
    k = torch.randn(layers, num_pages, PAGE_SIZE, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(k.shape, generator=g).to(dtype)
    order = torch.arange(num_pages) if sequential else torch.randperm(num_pages, generator=g)
    tables = order[: rows * pages_per_row].view(rows, pages_per_row).contiguous()
    lens = torch.full((rows,), context, dtype=torch.int64)
    q = torch.randn(rows, heads, head_dim, generator=g)
    out = torch.empty_like(q)

    def step():
        for layer in range(layers):
            ops.paged_decode(q, k[layer], v[layer], tables, lens, out, head_dim**-0.5, 0)

    step()
    best = min(_seconds(step) for _ in range(runs))
    return best, layers * rows * context * kv_heads * head_dim * 2 * k.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--context", type=int, nargs="+", default=[100, 200])
    parser.add_argument("--pages", choices=("scattered", "sequential"), default="scattered")
    parser.add_argument("--model", default="bench-25m")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_attention.json"))
    args = parser.parse_args()
    config = preset(args.model)
    floor = read_bandwidth()
    print(describe())
    print(f"DRAM read floor {floor / 1e9:.1f} GB/s; {args.model}, {args.rows} rows, pages {args.pages}")
    results = {"host": describe(), "read_bytes_per_s": floor, "rows": args.rows, "pages": args.pages, "runs": []}
    for context in args.context:
        for dtype in (torch.float32, torch.bfloat16):
            seconds, nbytes = time_attention(config, args.rows, context, dtype, args.pages == "sequential")
            rate = nbytes / seconds
            print(
                f"context {context:5d}, {str(dtype).removeprefix('torch.'):8s} pool: {seconds * 1e3:7.2f} ms "
                f"for {nbytes / 1e6:.0f} MB, {rate / 1e9:.1f} GB/s, {rate / floor:.2f} of the read floor"
            )
            results["runs"].append(dict(context=context, dtype=str(dtype), seconds=seconds, bytes=nbytes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
