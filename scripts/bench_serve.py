"""Serving benchmark (docs/serving.md), on the `bench-25m` model (random
weights, float32, CPU): tokens/s and time to first token (p50/p99) at 1, 8
and 32 concurrent streaming clients through `rollout serve` (a subprocess
on loopback; token-id prompts to /v1/completions, as the checkpoint has no
tokenizer), against the same requests in process in the same run:
`Engine.stream` from one event loop (the server's own pattern, without
HTTP) and `Engine.generate` from one thread per client.

Each client sends its requests one after another (a closed loop), each a
random prompt of `--prompt-tokens` and `--max-tokens` sampled tokens with
`ignore_eos`, so every mode generates the same tokens (seeded per request).

    python -m scripts.bench_serve [--concurrency 1 8 32] [--requests 64] [--out runs/bench_serve.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

import rollout
from rollout import SamplingParams
from scripts.bench import write_json
from scripts.host import describe
from scripts.synthetic import qwen2_config, write_checkpoint

SIZES = {"max_batch_size": 32, "max_seq_len": 1024, "kv_cache_tokens": 16384}
SERVER = "server (HTTP SSE)"


def workload(n: int, prompt_tokens: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(n)]


def params(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i)


def summary(mode: str, clients: int, seconds: float, tokens: int, ttfts: list[float]) -> dict:
    row = {"mode": mode, "clients": clients, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    row["ttfts"] = ttfts
    if ttfts:
        ordered = sorted(ttfts)
        row["ttft_p50_ms"] = 1000 * ordered[len(ordered) // 2]
        row["ttft_p99_ms"] = 1000 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return row


def closed_loop(prompts: list, clients: int) -> list[list[int]]:
    """Request indices per client: client k sends k, k + clients, ..."""
    return [list(range(k, len(prompts), clients)) for k in range(clients)]


# -- in process ------------------------------------------------------------------------
def run_stream(engine: rollout.Engine, prompts: list, clients: int, max_tokens: int) -> dict:
    async def client(indices: list[int], ttfts: list[float]) -> int:
        tokens = 0
        for i in indices:
            start, first = time.perf_counter(), True
            async for item in engine.stream(prompts[i], params(i, max_tokens)):
                if first and getattr(item, "token_ids", None):
                    ttfts.append(time.perf_counter() - start)
                    first = False
            tokens += len(item.samples[0].token_ids)
        return tokens

    async def main() -> dict:
        ttfts: list[float] = []
        start = time.perf_counter()
        counts = await asyncio.gather(*(client(ix, ttfts) for ix in closed_loop(prompts, clients)))
        return summary("Engine.stream", clients, time.perf_counter() - start, sum(counts), ttfts)

    return asyncio.run(main())


def run_generate(engine: rollout.Engine, prompts: list, clients: int, max_tokens: int) -> dict:
    counts = [0] * clients

    def client(k: int, indices: list[int]) -> None:
        for i in indices:
            (out,) = engine.generate([prompts[i]], params(i, max_tokens))
            counts[k] += len(out.samples[0].token_ids)

    threads = [threading.Thread(target=client, args=(k, ix)) for k, ix in enumerate(closed_loop(prompts, clients))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summary("Engine.generate", clients, time.perf_counter() - start, sum(counts), [])


# -- through the server ----------------------------------------------------------------
async def stream_request(host: str, port: int, body: dict) -> tuple[int, float]:
    """One streaming POST /v1/completions on its own connection, read with
    asyncio streams; (tokens, seconds to the first chunk with a token). A lean
    client, so that on a small host the client's own CPU time takes as little
    as it can from the server it measures (httpx costs ~100 us per chunk)."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    start, tokens, first = time.perf_counter(), 0, 0.0
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head.encode() + payload)
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"server answered {status!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers: the body is chunked
        while size := int((await reader.readline()).strip() or b"0", 16):
            event = await reader.readexactly(size + 2)
            if event.startswith(b"data: {"):
                n = len(json.loads(event[6:])["choices"][0].get("token_ids", ()))
                if n and not tokens:
                    first = time.perf_counter() - start
                tokens += n
    finally:
        writer.close()
    return tokens, first


def run_server(url: str, prompts: list, clients: int, max_tokens: int) -> dict:
    host, port = url.removeprefix("http://").split(":")

    async def client(indices: list[int], ttfts: list[float]) -> int:
        tokens = 0
        for i in indices:
            body = {"prompt": prompts[i], "max_tokens": max_tokens, "ignore_eos": True, "seed": i, "stream": True}
            got, first = await stream_request(host, int(port), {**body, "return_token_ids": True})
            tokens += got
            ttfts.append(first)
        return tokens

    async def main() -> dict:
        ttfts: list[float] = []
        start = time.perf_counter()
        counts = await asyncio.gather(*(client(ix, ttfts) for ix in closed_loop(prompts, clients)))
        return summary(SERVER, clients, time.perf_counter() - start, sum(counts), ttfts)

    return asyncio.run(main())


def start_server(path: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items()]
    cmd = [sys.executable, "-m", "rollout.cli", "serve", "--model", str(path), "--port", str(port), *sizes]
    process = subprocess.Popen([*cmd, "--log-level", "warning"])
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start")


def measure(modes: dict, prompts: list, clients: int, max_tokens: int, rounds: int) -> list[dict]:
    """Per mode, the median round's tokens/s and the TTFT percentiles over all
    rounds; the modes take turns round by round, so a noisy neighbour on a
    shared host hits them alike. One round of each first warms it up."""
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for r in range(rounds + 1):
        for name, run in modes.items():
            row = run(prompts, clients, max_tokens)
            if r:
                runs[name].append(row)
    rows = []
    for name, rs in runs.items():
        median = statistics.median(x["tokens_per_s"] for x in rs)
        ttfts = [t for x in rs for t in x.get("ttfts", [])]
        row = summary(name, clients, sum(x["seconds"] for x in rs), sum(x["tokens"] for x in rs), ttfts)
        row |= {"tokens_per_s": median, "rounds": [x["tokens_per_s"] for x in rs], "requests": len(prompts)}
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'mode':<18} {'clients':>7} {'requests':>8} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'server/x':>8}"
    )
    for r in rows:
        p50, p99 = (f"{r[k]:7.0f}ms" if k in r else f"{'-':>9}" for k in ("ttft_p50_ms", "ttft_p99_ms"))
        ratio = f"{r['server_ratio']:8.2f}" if "server_ratio" in r else f"{'':>8}"
        print(f"{r['mode']:<18} {r['clients']:7d} {r['requests']:8d} {r['tokens_per_s']:9.1f} {p50} {p99} {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests at the highest concurrency")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per mode (after one warm-up)")
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_serve.json"))
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    cfg = qwen2_config("bench-25m")
    write_checkpoint(path, cfg)
    prompts = workload(args.requests, args.prompt_tokens, cfg["vocab_size"])
    engine = rollout.Engine(path, device="cpu", **SIZES)
    process, url = start_server(path)
    modes = {
        "Engine.generate": lambda *a: run_generate(engine, *a),
        "Engine.stream": lambda *a: run_stream(engine, *a),
        SERVER: lambda *a: run_server(url, *a),
    }
    rows = []
    try:
        for c in args.concurrency:
            # Fewer requests at low concurrency: each client sends several, one after another.
            count = max(c, args.requests * c // max(args.concurrency), min(6, args.requests))
            rows += measure(modes, prompts[:count], c, args.max_tokens, args.rounds)
    finally:
        process.terminate()
        process.wait(30)
        engine.close()
    for c in args.concurrency:
        mine = {r["mode"]: r for r in rows if r["clients"] == c}
        for name in ("Engine.generate", "Engine.stream"):
            mine[name]["server_ratio"] = mine[SERVER]["tokens_per_s"] / mine[name]["tokens_per_s"]
    print(f"host: {describe()}; bench-25m (float32); prompts of {args.prompt_tokens} tokens, {args.max_tokens} sampled")
    print(
        f"tokens/s: median of {args.rounds} rounds per mode, taken in turns; server/x: the server's tokens/s over x's"
    )
    print_table(rows)
    write_json(args.out, {"host": describe(), "args": {**vars(args), "out": str(args.out)}, "rows": rows})


if __name__ == "__main__":
    main()
