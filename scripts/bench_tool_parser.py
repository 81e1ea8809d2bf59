"""The tool-call parser's cost per streamed token (docs/serving.md#tool-calls),
against its peer in the same run: the incremental detokeniser every streamed
token already goes through (`SampleText.add`). SmolLM2's tokenizer; a
reply of prose then two Hermes calls, `--tokens` long, streamed a token at
a time; the median of `--repeats` runs of each.

    python -m scripts.bench_tool_parser [--tokens 2000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rollout.server.streaming import SampleText
from rollout.tokenizer import TextCodec
from rollout.tool_calls import HermesParser, ToolCallStream
from scripts.host import describe
from scripts.smollm2 import smollm2_checkpoint


def reply(codec: TextCodec, tokens: int) -> list[int]:
    call = {"name": "search", "arguments": {"query": "weather in Paris and Zürich", "limit": 5}}
    calls = "".join(f"\n<tool_call>\n{json.dumps(call)}\n</tool_call>" for _ in range(2))
    prose, words = [], 0
    while len(codec.encode(" ".join(prose) + calls, add_special_tokens=False)) < tokens:
        prose.append(f"step {words} of the plan reads the forecast, compares the cities and")
        words += 1
    return codec.encode(" ".join(prose) + calls, add_special_tokens=False)[-tokens:]


def per_token_us(ids: list[int], codec: TextCodec, parse: bool) -> float:
    start = time.perf_counter()
    text = SampleText(codec.decode, None)
    calls = ToolCallStream(HermesParser()) if parse else None
    for t in ids:
        piece = text.add((t,))
        if calls is not None:
            calls.feed(piece)
    if calls is not None:
        calls.finish(text.finish(codec.decode(ids)))
    return (time.perf_counter() - start) / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    codec = TextCodec.from_dir(smollm2_checkpoint(), ())
    ids = reply(codec, args.tokens)
    plain, parsed = [], []
    for _ in range(args.repeats):  # alternating, so both see the same machine
        plain.append(per_token_us(ids, codec, False))
        parsed.append(per_token_us(ids, codec, True))
    a, b = statistics.median(plain), statistics.median(parsed)
    print(describe())
    print(f"{len(ids)} tokens: detokenising {a:.1f} us/token; with the parser {b:.1f} us/token")
    print(f"parser adds {b - a:.2f} us/token ({(b - a) / a:.1%} of the detokeniser's cost)")


if __name__ == "__main__":
    main()
