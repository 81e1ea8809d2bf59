"""The grammar masks of a step (`rollout.engine.grammar`): packed bitmasks applied to
a batch's logits in place, on the CPU kernel's two paths (a few words to mask, or
most of the row) and the torch ops of other devices, against allowed sets written
by hand; and a step's constrained, unconstrained and "raw" rows side by side, with
real matchers of the tests' character tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollout import StructuredOutputs
from rollout.engine.grammar import GrammarMasks, GrammarState, grammars_for, mask_rows
from rollout.tokenizer import TextCodec

EOS = 2  # "</s>" of the character tokenizer
OFFSET = 4  # token id of chr(32)
VOCAB = 100
CHOICES = ["yes", "no", "maybe", "nope"]


def pack(allowed: set[int], vocab: int) -> list[int]:
    """The packed int32 words of the set `allowed`, by hand: bit `v % 32` of word `v // 32`."""
    words = [0] * ((vocab + 31) // 32)
    for v in allowed:
        words[v // 32] |= 1 << (v % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def expected(logits: torch.Tensor, allowed: dict[int, set[int]]) -> torch.Tensor:
    """`logits` with the tokens outside each row's `allowed` set at -inf (rows not in it kept)."""
    out = logits.clone()
    for row, tokens in allowed.items():
        out[row, [v for v in range(logits.shape[1]) if v not in tokens]] = float("-inf")
    return out


@pytest.mark.parametrize("torch_ops", [False, True])
def test_mask_rows_keeps_exactly_the_allowed_tokens_of_the_masked_rows(torch_ops):
    vocab = 1000  # 32 words, the last one partly past the vocabulary
    g = torch.Generator().manual_seed(0)
    everything = set(range(vocab))
    allowed = {
        0: {0, 31, 32, 500, 999},  # a few allowed: most words 0 (the byte lookup)
        2: everything - {5, 31, 999},  # a few forbidden: two words not all ones (xgrammar's kernel)
        3: {v for v in range(vocab) if torch.rand(1, generator=g).item() < 0.5},  # every word mixed
        4: everything,
        5: set(),
    }
    bitmask = torch.full((7, 32), 12345, dtype=torch.int32)  # rows 1 and 6 hold garbage: not masked
    for row, tokens in allowed.items():
        bitmask[row] = torch.tensor(pack(tokens, vocab), dtype=torch.int32)
    logits = torch.randn(7, vocab, generator=g)
    want = expected(logits, allowed)
    mask_rows(logits, bitmask, sorted(allowed), torch_ops=torch_ops)
    assert torch.equal(logits, want)


@pytest.fixture(scope="module")
def choice_grammar(ascii_checkpoint):
    codec = TextCodec.from_dir(ascii_checkpoint.path, (EOS,))
    grammars = grammars_for(codec, VOCAB)
    stop = frozenset({EOS})
    return {
        "choice": grammars.compile(StructuredOutputs(choice=CHOICES), stop),
        "untypable": grammars.compile(StructuredOutputs(regex="\t"), stop),  # no token spells a tab
    }


def sampler(grammar=None, prefix: str = "", mode: str = "processed"):
    state = None
    if grammar is not None:
        state = GrammarState(grammar, VOCAB)
        for ch in prefix:
            state.accept(ord(ch) - 32 + OFFSET)
    request = SimpleNamespace(params=SimpleNamespace(logprobs_mode=mode), stop_token_ids=frozenset({EOS}))
    return SimpleNamespace(grammar=state, request=request)


def allowed_next(prefix: str) -> set[int]:
    """The tokens `CHOICES` allow after `prefix`, by hand (the stop token once `prefix` is one)."""
    chars = {c[len(prefix)] for c in CHOICES if c.startswith(prefix) and len(c) > len(prefix)}
    return {ord(ch) - 32 + OFFSET for ch in chars} | ({EOS} if prefix in CHOICES else set())


@pytest.mark.parametrize("penalised", [False, True])
def test_a_step_masks_its_constrained_rows_and_reports_raw_rows_unmasked(choice_grammar, penalised):
    grammar = choice_grammar["choice"]
    samplers = [
        sampler(grammar, ""),
        sampler(),  # unconstrained
        sampler(grammar, "ma", mode="raw"),
        sampler(grammar, "no"),
        sampler(choice_grammar["untypable"]),  # nothing continues it: the stop token does
        sampler(mode="raw"),
    ]
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(samplers), VOCAB, generator=g)
    reported = logits + 0.5 if penalised else None  # as penalties leave them: the logits logprobs are reported in
    model = logits.clone()
    base = model if reported is None else reported.clone()
    masks = GrammarMasks()
    for _ in range(2):  # the bitmask is kept between steps
        sampled, shown = masks.apply(samplers, logits, reported)
        allowed = {0: allowed_next(""), 2: allowed_next("ma"), 3: allowed_next("no"), 4: {EOS}}
        assert sampled is logits  # in place
        assert torch.equal(sampled, expected(model, allowed))
        assert torch.equal(shown, expected(base, {r: allowed[r] for r in (0, 3, 4)}))
        logits, reported = model.clone(), None if reported is None else base.clone()
    samplers[2].request.params.logprobs_mode = "processed"  # no raw constrained row: nothing to copy
    assert masks.apply(samplers, model.clone(), None)[1] is None
