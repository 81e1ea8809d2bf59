"""Incremental detokenisation against decoding the whole sequence: the
character tokenizer, and SmolLM2's byte-level BPE on random tokens (split
multi-byte characters included)."""

from __future__ import annotations

import random

import pytest

from rollout.server.streaming import SampleText
from rollout.tokenizer import TextCodec, find_stop


@pytest.fixture(scope="module")
def smol_codec(smollm2_path) -> TextCodec:
    return TextCodec.from_dir(smollm2_path, ())


def sent_in_pieces(codec: TextCodec, ids: list[int], stops: list[str] | None, rng: random.Random) -> tuple[str, str]:
    """(text streamed in random-sized pieces then finished, the engine's final text)."""
    text = SampleText(codec.decode, stops)
    out, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 3)
        out.append(text.add(tuple(ids[i : i + step]), last=i + step >= len(ids)))
        i += step
    whole = codec.decode(ids)
    cut = find_stop(whole, stops) if stops else None
    final = whole if cut is None else whole[:cut]
    out.append(text.finish(final))
    return "".join(out), final


def test_pieces_concatenate_to_the_whole_decode(smol_codec):
    rng = random.Random(0)
    vocab = smol_codec.vocab_size
    sample = smol_codec.encode("naïve café — 你好, мир! 🌍🚀 ok", add_special_tokens=False)
    for trial in range(200):
        ids = sample if trial == 0 else [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        streamed, final = sent_in_pieces(smol_codec, ids, None, rng)
        assert streamed == final


def test_no_text_past_a_stop_string_is_ever_sent(smol_codec):
    rng = random.Random(1)
    ids = smol_codec.encode("one two three STOP four five", add_special_tokens=False)
    for stops in (["STOP"], ["ee ST", "x"], ["four"]):
        # The engine ends a sample at the token that completes a stop string.
        end = next(k for k in range(1, len(ids) + 1) if find_stop(smol_codec.decode(ids[:k]), stops) is not None)
        whole = smol_codec.decode(ids[:end])
        text, sent = SampleText(smol_codec.decode, stops), ""
        for k, t in enumerate(ids[:end]):
            sent += text.add((t,), last=k == end - 1)
            assert whole[: find_stop(whole, stops)].startswith(sent)  # never past where the stop string starts
        streamed, final = sent_in_pieces(smol_codec, ids[:end], stops, rng)
        assert streamed == final == sent + text.finish(final) and stops[0] not in final


def test_a_partial_character_is_held_back(smol_codec):
    ids = smol_codec.encode("🌍", add_special_tokens=False)
    assert len(ids) > 1  # a byte-level split character
    text = SampleText(smol_codec.decode, None)
    assert text.add(tuple(ids[:-1])) == ""
    assert text.add(tuple(ids[-1:])) == "🌍"
