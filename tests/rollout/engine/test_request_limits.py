"""The work one request may ask for is bounded: stop strings (count and
length), the stop matcher's work per token, and a call's total tokens
(`max_request_tokens`). Each limit is checked at its edge."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from rollout import SamplingParams
from rollout.engine.requests import PromptLimits, validate_prompts
from rollout.engine.sequence import Request, Sequence
from rollout.engine.stop_strings import StopStrings
from rollout.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from rollout.tokenizer import TextCodec, find_stop
from tests.conftest import make_engine

LIMITS = PromptLimits(vocab_size=100, max_seq_len=256, max_batch_size=16, page_size=16, num_pages=64)


def test_stop_strings_are_bounded_in_count_and_length():
    assert len(SamplingParams(stop=["x"] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS
    with pytest.raises(ValueError, match=rf"^stop may hold at most {MAX_STOP_STRINGS} strings, got 65$"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    assert SamplingParams(stop=["a", "b" * MAX_STOP_LENGTH]).stop[1] == "b" * MAX_STOP_LENGTH
    with pytest.raises(ValueError, match=rf"^stop strings must have 1 to {MAX_STOP_LENGTH} characters, stop\[1\] has"):
        SamplingParams(stop=["a", "b" * (MAX_STOP_LENGTH + 1)])


def test_request_tokens_are_bounded_at_the_edge():
    # Hand-computed: n=2 x ((3 + 4) + (2 + 4)) = 26 tokens.
    params = SamplingParams(n=2, max_tokens=4)
    at = dataclasses.replace(LIMITS, max_request_tokens=26)
    assert validate_prompts([[5, 6, 7], [5, 6]], params, at, None)[0] == [[5, 6, 7], [5, 6]]
    with pytest.raises(ValueError, match=r"^max_tokens: .* come to 28 tokens, over max_request_tokens \(26\)"):
        validate_prompts([[5, 6, 7], [5, 6, 7]], params, at, None)
    # max_tokens counts as the engine runs it, capped by the context: 3 + (256 - 3).
    capped = dataclasses.replace(LIMITS, max_request_tokens=256)
    validate_prompts([[5, 6, 7]], SamplingParams(max_tokens=10_000), capped, None)
    with pytest.raises(ValueError, match="come to 512 tokens"):
        validate_prompts([[5, 6, 7]], SamplingParams(n=2, max_tokens=10_000), capped, None)


def test_engine_refuses_a_call_over_max_request_tokens_before_anything_starts(qwen2):
    engine = make_engine(qwen2.path, max_request_tokens=13)
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True, seed=0)
        (a, b) = engine.generate([[5, 6, 7], [5, 6]], params)  # 7 + 6 = 13: at the limit
        assert len(a.samples[0].token_ids) == len(b.samples[0].token_ids) == 4
        with pytest.raises(ValueError, match=r"come to 14 tokens, over max_request_tokens \(13\)"):
            engine.generate([[5, 6, 7], [5, 6, 7]], params)
        with pytest.raises(ValueError, match=r"come to 14 tokens"):
            engine.stream([5, 6, 7], SamplingParams(n=2, max_tokens=4))
        assert engine.stats()["kv_pages_used"] == 0 and not engine.scheduler.requests
    finally:
        engine.close()
    with pytest.raises(ValueError, match=r"^max_request_tokens must be an int >= 1 or None"):
        make_engine(qwen2.path, max_request_tokens=0)


class CountingCodec(TextCodec):
    """A codec that counts the characters it decodes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer, ())
        self.chars = 0

    def decode(self, ids: list[int]) -> str:
        text = super().decode(ids)
        self.chars += len(text)
        return text


def _codec(vocab: list[str], decoder) -> CountingCodec:
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token=vocab[0]))
    tok.decoder = decoder
    return CountingCodec(tok)


def _scan(codec: CountingCodec, stop: list[str], output: list[int]) -> tuple[int | None, list[int]]:
    """Append `output` token by token, asking for a stop after each as the
    scheduler does; the cut (None: no stop) and the characters decoded per token."""
    request = Request(0, [0], SamplingParams(stop=stop), seed=0, max_tokens=len(output), stop_token_ids=frozenset())
    seq = Sequence(0, request, 0, [0])
    matcher, per_token = StopStrings(codec), []
    for t in output:
        seq.token_ids.append(t)
        codec.chars = 0
        cut = matcher.find(seq)
        per_token.append(codec.chars)
        if cut is not None:
            return cut, per_token
    return None, per_token


@pytest.mark.parametrize("longest", [3, MAX_STOP_LENGTH])
def test_stop_matcher_decodes_a_tail_sized_by_the_longest_stop(longest):
    # One character per token: the newest token alone (1 character), then a
    # window of longest + 1 + 4 (slack for the newest) + 4 (guard) tokens.
    codec = _codec(["<unk>", "a", "b"], decoders.Fuse())
    cut, per_token = _scan(codec, ["b" * longest], [1] * 3000)
    assert cut is None
    assert max(per_token) == 1 + longest + 1 + 4 + 4


def test_stop_straddling_tokens_is_found_in_a_long_output():
    # "lo wo" spans "lo" and " wor"; the 400 characters before are "ab" x 200.
    codec = _codec(["<unk>", "ab", "hel", "lo", " wor", "ld"], decoders.Fuse())
    cut, per_token = _scan(codec, ["xyz", "lo wo"], [1] * 200 + [2, 3, 4, 5])
    assert cut == 400 + len("hel")
    assert len(per_token) == 200 + 3  # found at " wor", the token that completed it
    # Each "ab": itself, then a window of 5 + (2 + 4) + 4 tokens of 2 characters.
    assert max(per_token[:200]) == 2 + 2 * 15
    # " wor": itself (4), a window of 5 + (4 + 4) + 4 = 17 tokens (14 "ab", "hel", "lo", " wor": 37
    # characters), then the whole text once to place the stop (409 characters).
    assert per_token[-1] == 4 + 37 + 409


def test_a_window_that_decodes_apart_from_the_text_never_stops_it():
    # WordPiece decodes a window's first "##a" as "##a", the whole text never
    # holds "##": that start is not searched, so every token's work stays bounded.
    codec = _codec(["<unk>", "a", "##a"], decoders.WordPiece())
    cut, per_token = _scan(codec, ["##"], [1] + [2] * 2000)
    assert cut is None
    # Each "##a": itself (3), then a window of 2 + (3 + 4) + 4 = 13 tokens ("##a" and 12 "a").
    assert max(per_token) == 3 + (3 + 12)


# Multi-character tokens, and bytes of "€" (E2 82 AC) that split it across tokens.
BYTES_VOCAB = ["<unk>", "a", "b", "ab", " ", "€", "<0xE2>", "<0x82>", "<0xAC>", "#", "##"]
STOP_CHARS = ["a", "b", " ", "€", "#", "\ufffd"]


@settings(max_examples=300, deadline=None)
@given(
    output=st.lists(st.integers(1, len(BYTES_VOCAB) - 1), min_size=1, max_size=120),
    stops=st.lists(st.lists(st.sampled_from(STOP_CHARS), min_size=1, max_size=6).map("".join), min_size=1, max_size=3),
)
def test_stop_matcher_agrees_with_searching_the_whole_text_every_token(output, stops):
    # The reference decodes the whole output after every token and stops at the first hit.
    codec = _codec(BYTES_VOCAB, decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()]))
    expected = None
    for t in range(1, len(output) + 1):
        hit = find_stop(codec.decode(output[:t]), stops)
        if hit is not None:
            expected = (t, hit)
            break
    cut, per_token = _scan(codec, stops, output)
    assert (None if cut is None else (len(per_token), cut)) == expected
