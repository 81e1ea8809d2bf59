"""`rollout generate`: offline sampling from a checkpoint to JSON lines;
`rollout serve`: an OpenAI-compatible HTTP server (docs/serving.md).

    rollout generate --model DIR --prompts FILE.jsonl --n 8 --out OUT.jsonl [--overwrite]
    rollout serve --model DIR [--actors N] [--host 127.0.0.1] [--port 8000] [--api-key-file PATH]

Each input line of `generate` is a JSON string (a text prompt), a list of
token ids, or an object with "prompt" (text) or "prompt_token_ids". Each
output line holds one prompt's samples with token ids, logprobs, versions,
finish reasons and texts, in input order. The lines go to a temporary file
beside `--out` as prompts finish, renamed to `--out` when all are done: an
interrupted run leaves no half-written `--out`. An existing `--out` is
refused without `--overwrite`, and `--out` may never be the prompts file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from tqdm import tqdm

from .engine.engine import Engine
from .outputs import encode_array
from .sampling_params import LOGPROBS_MODES, SamplingParams


def read_prompts(path: Path) -> list:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON: {e}") from None
        if isinstance(item, dict):
            item = item.get("prompt", item.get("prompt_token_ids"))
        if not isinstance(item, (str, list)):
            raise ValueError(
                f"{path}:{number}: expected a string, a list of token ids, or an object with "
                "'prompt' or 'prompt_token_ids'"
            )
        prompts.append(item)
    return prompts


def output_record(out) -> dict:
    record = {
        "index": out.index,
        "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "samples": [
            {
                "token_ids": s.token_ids,
                "logprobs": s.logprobs,
                "versions": s.versions,
                "finish_reason": s.finish_reason,
                "text": s.text,
            }
            for s in out.samples
        ],
    }
    if out.prompt_routed_experts is not None or any(s.routed_experts is not None for s in out.samples):
        record["prompt_routed_experts"] = encode_array(out.prompt_routed_experts)
        for r, s in zip(record["samples"], out.samples, strict=True):
            r["routed_experts"] = encode_array(s.routed_experts)
    return record


# Prompts done of all, and generated tokens per second (the bar counts prompts).
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} prompts [{elapsed}<{remaining}{postfix}]"


def check_out(out: Path, prompts: Path, overwrite: bool) -> None:
    """Refuse an `--out` whose writing would destroy data: the prompts file
    itself (however it is named: links resolve), or an existing file unless
    `overwrite`. Raises `ValueError` naming the flag."""
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give a file path")
    if not out.exists():
        return
    if prompts.exists() and os.path.samefile(out, prompts):
        raise ValueError(f"--out {out} is the --prompts file; write the samples to another file")
    if not overwrite:
        raise ValueError(f"--out {out} exists; pass --overwrite to replace it")


@contextmanager
def replacing(out: Path) -> Iterator[IO[str]]:
    """A new file beside `out` that replaces `out` when the block ends, or is
    removed if the block fails (so `out` is never half-written). Beside it so
    the rename stays on one filesystem and is atomic."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{uuid.uuid4().hex}.partial")  # a name no other run (same pid) has
    try:
        with partial.open("x") as f:  # the umask's permissions, as `out` would get them
            yield f
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class InOrder:
    """Writes records in input order, each as soon as it and every record
    before it are done (a late prompt holds back only those after it)."""

    def __init__(self, f: IO[str]) -> None:
        self.f, self.next, self.held = f, 0, {}

    def add(self, index: int, record: dict) -> None:
        self.held[index] = record
        while self.next in self.held:
            self.f.write(json.dumps(self.held.pop(self.next)) + "\n")
            self.next += 1
        self.f.flush()


def generate(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompts)
    check_out(args.out, args.prompts, args.overwrite)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        logprobs_mode=args.logprobs_mode,
        return_routed_experts=args.return_routed_experts,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=logit_bias(args.logit_bias),
    )
    engine = Engine(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        matmul_dtype=args.matmul_dtype,
    )
    texts = [p if isinstance(p, str) else None for p in prompts]
    if any(texts) and engine.tokenizer is None:
        raise ValueError(f"{args.prompts} has text prompts but {args.model} has no tokenizer.json")
    # Text lines are tokenized here so one file may mix text and token-id prompts.
    token_lists = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    bar = tqdm(total=len(prompts), disable=args.quiet, bar_format=BAR_FORMAT, postfix="0 tokens/s")
    tokens, start = 0, time.perf_counter()
    with bar, replacing(args.out) as f:
        records = InOrder(f)
        for index, out in engine.generate_iter(token_lists, params):
            out.prompt = texts[index]
            records.add(index, output_record(out))
            tokens += sum(len(s.token_ids) for s in out.samples)
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.0f} tokens/s", refresh=False)
            bar.update()
    return 0


def logit_bias(items: list[str] | None) -> dict[int, float] | None:
    """`--logit-bias TOKEN=BIAS` options as a dict; `ValueError` naming a malformed one."""
    out = {}
    for item in items or ():
        token, _, bias = item.partition("=")
        try:
            out[int(token)] = float(bias)
        except ValueError:
            raise ValueError(f"--logit-bias takes TOKEN=BIAS (an int and a number), got {item!r}") from None
    return out or None


def serve(args: argparse.Namespace) -> int:
    try:
        from .server.run import serve as run_server  # FastAPI and uvicorn load for `serve` only
    except ImportError as e:
        raise ValueError(f"{e}; `rollout serve` needs `pip install 'rollout-engine[serve]'`") from None
    return run_server(args)


COMMANDS = {"generate": generate, "serve": serve}


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default=None, help="the KV pool's dtype (default: --dtype; bfloat16 halves it)")
    p.add_argument("--matmul-dtype", default=None, help="the projections' GEMM dtype (default: --dtype; or bfloat16)")


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/serving.md)")
    s.add_argument("--model", required=True, type=Path, help="Hugging Face checkpoint directory")
    s.add_argument("--actors", type=int, default=0, help="serve from a Ray cluster of N rollout actors")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (`ps` shows it: prefer below)")
    s.add_argument("--api-key-file", type=Path, default=None, help="the key from a file (or set ROLLOUT_API_KEY)")
    s.add_argument("--allow-no-key", action="store_true", help="serve a non-loopback --host without a key")
    s.add_argument("--served-model-name", default=None, help="the model name clients use (default: DIR's name)")
    s.add_argument("--max-n", type=int, default=None, help="samples per prompt (default: max batch size)")
    s.add_argument("--max-tokens-limit", type=int, default=None, help="max_tokens bound (default: max seq len)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body bound (default: 1 MiB)")
    s.add_argument("--max-request-tokens", type=int, default=None, help="prompts x n x (prompt + max_tokens) bound")
    s.add_argument("--max-inflight-tokens", type=int, default=None, help="the same over requests not yet answered")
    s.add_argument(
        "--max-inflight-requests", type=int, default=None, help="requests not yet answered (default: 1024 or more)"
    )
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--access-log", action="store_true", help="log every request")
    s.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "hermes", "llama3_json", "mistral", "none"],
        help="how tool calls are read from chat output (default: auto, from the chat template)",
    )
    _engine_flags(s)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout", description="RL rollout engine tools")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="sample responses for a JSONL file of prompts")
    g.add_argument("--model", required=True, type=Path, help="Hugging Face checkpoint directory")
    g.add_argument("--prompts", required=True, type=Path, help="JSONL: one prompt per line")
    g.add_argument("--out", required=True, type=Path, help="JSONL output, one line per prompt (a new file)")
    g.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="processed")
    g.add_argument(
        "--return-routed-experts", action="store_true", help="each position's experts (mixture-of-experts models)"
    )
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], per earlier occurrence")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], once a token occurred")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="in (0, 2], on prompt and output tokens")
    g.add_argument("--logit-bias", action="append", metavar="TOKEN=BIAS", help="add BIAS to a token id's logit")
    _engine_flags(g)
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    _serve_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, TypeError, OSError) as e:
        print(f"rollout {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
