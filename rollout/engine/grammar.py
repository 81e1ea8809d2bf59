"""Structured outputs: a sample's tokens constrained to a JSON schema, any
JSON object, a regular expression, a list of choices or a structural tag
(the tool-call shapes `rollout.tool_calls` reads), with xgrammar.

`StructuredOutputs` (`rollout.structured`, vLLM's `structured_outputs`
fields) is what a `SamplingParams` carries; `Grammars` compiles it once per request for the
engine's tokenizer (cached by the library), and each sample gets its own
matcher, kept on its `Sequence` (`Sequence.grammar`) and advanced by
`Sequence.append` with every token it samples, reset with its outputs.

Each step the stepper masks the constrained rows' logits (`GrammarMasks`):
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
from .inflight_io import to_device

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
    """One sample's matcher: which tokens may come next (`GrammarMasks` reads it), advanced token by token."""

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


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool `[R, vocab]` from packed int32 `bitmask` `[R, ceil(vocab / 32)]`: bit `v % 32` of word `v // 32`."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    unpacked = (bitmask[:, :, None] >> bits) & 1
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def _bit(b: int) -> int:
    """Bit `b` of an int32 word as the Python int a tensor element takes (bit 31 is its sign)."""
    return (1 << b) - (1 << 32 if b == 31 else 0)


class GrammarMasks:
    """One stepper's grammar masks. A step with constrained rows fills their rows of one
    packed int32 bitmask `[rows, ceil(vocab / 32)]` (allocated once, grown with the
    batch; pinned for a CUDA engine) in one call of xgrammar's batch matcher, then sets
    those rows' disallowed tokens to -inf in the logits, in place (`mask_rows`): no copy
    of the step's logits, unless a constrained row reports "raw" logprobs. Unconstrained
    rows are neither filled nor touched."""

    def __init__(self) -> None:
        self._bitmask: torch.Tensor | None = None  # host, int32 [rows, words]
        self._device_bitmask: torch.Tensor | None = None  # its copy on a non-CPU device
        self._batch = None  # xgrammar's BatchGrammarMatcher, made on first use

    def apply(
        self, samplers: list, logits: torch.Tensor, reported: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mask the constrained rows of the step's float32 logits `[N, V]` (of the
        sampler rows `samplers`) in place; return them, and the logits each row's
        logprobs are reported in: `reported` (the penalties', when not None) with
        the constrained rows masked but those reporting "raw" logprobs, which keep
        their unmasked row; None where that is `logits` itself (no penalties, no
        constrained "raw" row). A grammar that no token of the vocabulary continues
        allows the request's stop tokens, which end the sample (its text is then
        not complete)."""
        rows = [i for i, s in enumerate(samplers) if s.grammar is not None]
        bitmask = self._fill(samplers, rows, logits.shape[-1], logits.device)
        raw = {i for i in rows if samplers[i].request.params.logprobs_mode == "raw"}
        if raw and reported is None:  # those rows are reported unmasked
            reported = logits.clone()
        mask_rows(logits, bitmask, rows)
        if reported is not None:
            mask_rows(reported, bitmask, [i for i in rows if i not in raw])
        return logits, reported

    def _fill(self, samplers: list, rows: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        """The bitmask with each constrained sampler `i`'s row `i` filled, on `device`."""
        import xgrammar as xgr

        words, cuda = (vocab + 31) // 32, device.type == "cuda"
        host = self._bitmask
        if host is None or host.shape[0] < len(samplers) or host.shape[1] != words or host.is_pinned() != cuda:
            host = self._bitmask = torch.empty((max(len(samplers), 8), words), dtype=torch.int32, pin_memory=cuda)
            self._device_bitmask = None
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask([samplers[i].grammar.matcher for i in rows], host, rows)
        dead = (host.index_select(0, torch.tensor(rows)) == 0).all(dim=1)
        for j in dead.nonzero().flatten().tolist():  # the vocabulary cannot go on: stop
            for t in samplers[rows[j]].request.stop_token_ids:
                host[rows[j], t // 32] |= _bit(t % 32)
        if device.type == "cpu":
            return host
        if self._device_bitmask is None or self._device_bitmask.device != device:
            self._device_bitmask = torch.empty_like(host, device=device)
        # Without waiting: the host rewrites `host` only at a later constrained step, which is
        # planned after this one's tokens were read back (its matchers advance with them).
        return self._device_bitmask.copy_(host, non_blocking=cuda)


def mask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], torch_ops: bool = False) -> None:
    """-inf in place at the tokens that packed int32 `bitmask` (on `logits`' device; bit
    `v % 32` of word `v // 32` set: token `v` allowed) disallows, in rows `rows` of float32
    `logits` `[N, V]`; the other rows untouched. Off the CPU (or with `torch_ops`) by torch
    ops on those rows."""
    if not rows:
        return
    vocab, index = logits.shape[-1], to_device(rows, logits.device)
    words = bitmask.index_select(0, index)
    if torch_ops or logits.device.type != "cpu":
        allowed = allowed_tokens(words, vocab)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
        return
    # xgrammar's CPU kernel skips a word that allows all its 32 tokens but tests every bit of
    # the others: fast where the grammar forbids a few tokens (inside a string), slow where
    # it allows a few (between a JSON object's keys and values). Those rows add each byte's
    # 8 logits' 0 or -inf, looked up by the byte's value: one pass whatever the mask.
    few = ((words != -1).sum(dim=1) <= words.shape[1] // 16).tolist()
    sparse = [r for r, f in zip(rows, few, strict=True) if f]
    if sparse:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=sparse, backend="cpu")
    if len(sparse) < len(rows):
        dense = [j for j, f in enumerate(few) if not f]
        masked_bytes = words[dense].view(torch.uint8).to(torch.int64)  # little-endian: byte k, bits 8k..8k+7
        add = torch.nn.functional.embedding(masked_bytes, _BYTE_MASKS).view(len(dense), -1)[:, :vocab]
        logits.index_add_(0, index[dense], add)


# Row `b`: the 8 tokens of a mask byte of value `b`, 0.0 where its bit is set (allowed), else -inf.
_BYTE_MASKS = torch.where(
    (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 1, torch.tensor(0.0), torch.tensor(float("-inf"))
)
