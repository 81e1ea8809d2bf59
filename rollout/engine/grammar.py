"""Structured outputs: a sample's tokens constrained to a JSON schema, any
JSON object, a regular expression, a list of choices or a structural tag
(the tool-call shapes `rollout.tool_calls` reads), with xgrammar.

`StructuredOutputs` (`rollout.structured`, vLLM's `structured_outputs`
fields) is what a `SamplingParams` carries; `Grammars` compiles it once per request for the
engine's tokenizer (cached by the library), and each sample gets its own
matcher, kept on its `Sequence` (`Sequence.grammar`) and advanced by
`Sequence.append` with every token it samples, reset with its outputs.

Each step the stepper masks the constrained rows' logits (`constrain`):
tokens the grammar does not allow next get -inf, after penalties and before
temperature and filters, on every sampler path (a constrained row never runs
from a decode graph, as its mask changes every step). So the "processed" and
"scaled" logprobs are of the masked, renormalised distribution, the one
sampled; "raw" stays the model's own. The grammar ends only on one of the
request's stop tokens, which it allows once the text is complete.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import torch

from ..structured import StructuredOutputs

_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammars_for(codec, vocab_size: int) -> Grammars:
    """The `Grammars` of an engine's tokenizer (one per codec, made on first use)."""
    if codec is None:
        raise ValueError("structured_outputs need a tokenizer, and the checkpoint has no tokenizer.json")
    grammars = _COMPILERS.get(codec)
    if grammars is None or grammars.vocab_size != vocab_size:
        grammars = _COMPILERS[codec] = Grammars(codec, vocab_size)
    return grammars


class Grammars:
    """The grammar compiler of one tokenizer and vocabulary (built on first use)."""

    def __init__(self, codec, vocab_size: int) -> None:
        self.codec, self.vocab_size = codec, vocab_size
        self._compiler = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs, stop_token_ids: frozenset[int]) -> Any:
        """The compiled grammar of `spec`; `ValueError` naming the field and the library's reason."""
        import xgrammar as xgr

        if not stop_token_ids:
            raise ValueError(
                "structured_outputs: the grammar ends on a stop token, and the request has none "
                "(ignore_eos=True with no stop_token_ids); give stop_token_ids or leave ignore_eos off"
            )
        compiler = self._get_compiler(sorted(stop_token_ids))
        kind = spec.kind
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
            if kind == "json_object":  # any object (the builtin JSON grammar allows any value)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in spec.choice)  # EBNF string literals
                return compiler.compile_grammar(f"root ::= {alternatives}")
            tag = spec.structural_tag if isinstance(spec.structural_tag, str) else json.dumps(spec.structural_tag)
            return compiler.compile_structural_tag(tag)
        except (RuntimeError, ValueError, TypeError, xgr.exception.InvalidJSONError) as e:
            raise ValueError(f"structured_outputs.{kind} is not a valid {_WHAT[kind]}: {_first_line(e)}") from None

    def _get_compiler(self, stop: list[int]):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None or self._compiler[0] != stop:
                self._compiler = (stop, xgr.GrammarCompiler(tokenizer_info(self.codec, self.vocab_size, stop)))
            return self._compiler[1]


def tokenizer_info(codec, vocab_size: int, stop: list[int]):
    """xgrammar's view of `codec`'s vocabulary: each id's token string as the tokenizer
    stores it, special tokens (which decode to nothing) empty, so no grammar takes one
    for text; ids past the tokenizer's (padding rows of the model's embedding) empty too."""
    import xgrammar as xgr

    tok = codec._tok
    vocab = [""] * vocab_size
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = token
    for i, added in tok.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            vocab[i] = ""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgr.TokenizerInfo(
        vocab,
        vocab_type=meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop,
        add_prefix_space=meta["add_prefix_space"],
    )


_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "list of choices",
    "structural_tag": "structural tag",
}


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class GrammarState:
    """One sample's matcher: which tokens may come next, advanced token by token."""

    __slots__ = ("matcher", "vocab_size")

    def __init__(self, compiled, vocab_size: int) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size

    def accept(self, token: int) -> None:
        """Advance past a sampled token (the mask allowed it; a stop token ends the grammar)."""
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)

    def reset(self) -> None:
        self.matcher.reset()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of packed int32 `bitmask`: the tokens allowed next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool `[R, vocab]` from packed int32 `bitmask` `[R, ceil(vocab / 32)]`: bit `v % 32` of word `v // 32`."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    unpacked = (bitmask[:, :, None] >> bits) & 1
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def _bit(b: int) -> int:
    """Bit `b` of an int32 word as the Python int a tensor element takes (bit 31 is its sign)."""
    return (1 << b) - (1 << 32 if b == 31 else 0)


def constrain(samplers: list, logits: torch.Tensor, reported: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's logits `[N, V]` with each constrained row's disallowed tokens at -inf
    (to sample from), and the logits its logprobs are reported in: the same, but for
    rows reporting "raw" logprobs, which keep `reported`'s (or the unmasked) row. A
    grammar that no token of the vocabulary continues allows the request's stop tokens,
    which end the sample (its text is then not complete)."""
    rows = [i for i, s in enumerate(samplers) if s.grammar is not None]
    vocab = logits.shape[-1]
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
    for j, i in enumerate(rows):
        samplers[i].grammar.fill(bitmask, j)
    for j in (bitmask == 0).all(dim=1).nonzero().flatten().tolist():  # the vocabulary cannot go on: stop
        for t in samplers[rows[j]].request.stop_token_ids:
            bitmask[j, t // 32] |= _bit(t % 32)
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    allowed = allowed_tokens(bitmask.to(logits.device), vocab)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    base = logits if reported is None else reported
    raw = torch.tensor([samplers[i].request.params.logprobs_mode == "raw" for i in rows], device=logits.device)
    shown = torch.where(raw[:, None], base.index_select(0, index), masked)
    return logits.index_copy(0, index, masked), base.index_copy(0, index, shown)
