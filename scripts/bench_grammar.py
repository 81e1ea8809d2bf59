"""The two grammar libraries on one tokenizer (docs/serving.md, structured
outputs): xgrammar and llguidance, each compiling the same JSON schema for
SmolLM2's 49,152-token vocabulary (cold: a fresh compiler, no cache), then
per token the library's work: the bitmask of the tokens allowed next and the
matcher's advance, along a valid document's tokens (applying a mask to the
logits is one torch op, the same for both: `rollout.engine.grammar`). Medians of
`--repeats` runs.

    python -m scripts.bench_grammar [--repeats 5]

With `--engine`, the engine's constrained decoding against the same batch
unconstrained, alternating, in the same run: SmolLM2-135M-Instruct
(`Engine(path, device="cpu")`), `--prompts` chat prompts x `--n` samples of
`--tokens` tokens (eos ignored unconstrained; constrained, a sample ends when
its JSON object does, so tokens/s is what is compared: every sampled token counts,
the stop token included), the JSON schema above. Each round runs both, their order
alternating between rounds; the ratio of the medians and each round's ratio are printed
(on a shared host the load moves less within a round than across the run), in
tokens per second and per CPU second of the process: with `--threads 1` the latter
is the stepping thread's work, which other processes on a loaded host slow far
less than they stretch its wall-clock time.

    python -m scripts.bench_grammar --engine [--prompts 8] [--n 4] [--tokens 64] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from scripts.host import describe
from scripts.smollm2 import smollm2_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "kind": {"enum": ["person", "robot"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
    "additionalProperties": False,
}


def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(smollm2_checkpoint())


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int, stop: list[int]) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=stop)

    def compile(self, schema: str):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def bitmask(self):
        return self.xgr.allocate_token_bitmask(1, self.vocab)

    def accept(self, matcher, token: int) -> bool:
        matcher.accept_token(token)
        return matcher.is_terminated()


# The separators json.dumps writes, as xgrammar's any_whitespace=False has them.
LLG_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int, stop: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.vocab = llguidance, vocab
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=stop[0])

    def compile(self, schema: str):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=LLG_DEFAULTS)
        matcher = self.llg.LLMatcher(self.tok, grammar)  # compiles lazily: the first mask does the rest
        matcher.compute_bitmask()
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def bitmask(self):
        return self.llg.torch.allocate_token_bitmask(1, self.vocab)

    def accept(self, matcher, token: int) -> bool:
        matcher.consume_token(token)
        return matcher.is_stopped()


DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "tags": ["math", "poetry", "engines"],
    "address": {"city": "London", "zip": "10115"},
    "kind": "person",
}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The allowed tokens of packed int32 `bitmask` (bit `v % 32` of word `v // 32`) kept, the rest -inf:
    rollout.engine.grammar's torch op, the same for both libraries."""
    from rollout.engine.grammar import allowed_tokens

    logits.masked_fill_(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))


def decode(lib, compiled, tokens: list[int]) -> float:
    """Seconds per token of the library's work (the next tokens' bitmask and the matcher's
    advance) while it follows `tokens` (a valid document and the stop token); each mask is
    also applied to a row of logits, untimed (the same torch op for both), to check that the
    document's own token stays allowed."""
    matcher, bitmask = lib.matcher(compiled), lib.bitmask()
    logits = torch.zeros(1, lib.vocab)
    spent = 0.0
    for i, token in enumerate(tokens):
        start = time.perf_counter()
        lib.fill(matcher, bitmask)
        spent += time.perf_counter() - start
        logits.zero_()
        apply_bitmask(logits, bitmask)
        if logits[0, token] == float("-inf"):
            raise AssertionError(f"{lib.name} masked token {i} ({token}) of a valid document")
        start = time.perf_counter()
        done = lib.accept(matcher, token)
        spent += time.perf_counter() - start
    if not done:
        raise AssertionError(f"{lib.name} did not end after the document's stop token")
    return spent / len(tokens)


def engine_overhead(args) -> None:
    """Tokens/s of the batch constrained to `SCHEMA` against unconstrained, alternating runs."""
    from rollout import Engine, SamplingParams, StructuredOutputs

    engine = Engine(smollm2_checkpoint(), device="cpu")
    prompts = [
        [{"role": "user", "content": f"Describe person number {i} as JSON with name, age, tags, address and kind."}]
        for i in range(args.prompts)
    ]
    base = dict(n=args.n, max_tokens=args.tokens, temperature=1.0, seed=0)
    runs = {
        "free": SamplingParams(**base, ignore_eos=True),
        "json_schema": SamplingParams(**base, structured_outputs=StructuredOutputs(json=SCHEMA)),
    }
    engine.generate(prompts[:1], runs["json_schema"])  # warm-up: kernels, the tokenizer's grammar info
    rates: dict[str, list[float]] = {name: [] for name in runs}
    cpu_rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.repeats):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:  # free first, then constrained first: no side always second
            start, cpu = time.perf_counter(), time.process_time()
            outputs = engine.generate(prompts, runs[name])
            tokens = sum(len(s.token_ids) for o in outputs for s in o.samples)
            rates[name].append(tokens / (time.perf_counter() - start))
            cpu_rates[name].append(tokens / (time.process_time() - cpu))
            print(
                f"  {name:11s} {tokens} tokens, {rates[name][-1]:.1f} tok/s, {cpu_rates[name][-1]:.1f} tok/cpu-s",
                flush=True,
            )
    engine.close()
    for unit, measured in (("tok/s", rates), ("tok/cpu-s", cpu_rates)):
        free, constrained = statistics.median(measured["free"]), statistics.median(measured["json_schema"])
        rounds = [c / f for f, c in zip(measured["free"], measured["json_schema"], strict=True)]
        print(
            f"engine: free {free:.1f} {unit}, json_schema {constrained:.1f} {unit}: {constrained / free:.3f}x "
            f"(per round {' '.join(f'{x:.3f}' for x in rounds)}; median {statistics.median(rounds):.3f}x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.engine:
        print(f"# {describe()}")
        engine_overhead(args)
        return
    tok = hf_tokenizer()
    vocab = len(tok)
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    schema = json.dumps(SCHEMA)
    document = tok(json.dumps(DOCUMENT), add_special_tokens=False)["input_ids"] + stop
    print(f"# {describe()}; vocabulary {vocab}")
    for lib in (XGrammar(tok, vocab, stop), LLGuidance(tok, vocab, stop)):
        compile_s, per_token = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            compiled = lib.compile(schema)
            compile_s.append(time.perf_counter() - start)
            per_token.append(decode(lib, compiled, document))
        print(
            f"{lib.name:11s} compile {statistics.median(compile_s) * 1e3:8.1f} ms   "
            f"bitmask+advance {statistics.median(per_token) * 1e6:7.1f} us/token   ({len(document)} tokens)"
        )


if __name__ == "__main__":
    main()
