"""Incremental detokenisation against decoding the whole sequence: the
character tokenizer, and SmolLM2's byte-level BPE on random tokens (split
multi-byte characters included); a streamed completion's text and
`text_offset`s starting over when a `restart` commit restarts its choice."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch

from rollout.server import EngineBackend, ServerConfig, start_server
from rollout.server.streaming import SampleText
from rollout.tokenizer import TextCodec, find_stop
from tests.conftest import make_engine
from tests.rollout.server.conftest import SIZES


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


class RestartAfter:
    """A step callback: after the engine's `step`-th step (tokens so far pushed to the
    stream), commit other weights with inflight="restart", between two steps."""

    def __init__(self, step: int) -> None:
        self.step, self.count, self.engine = step, 0, None

    def __call__(self, info) -> None:
        self.count += 1
        if self.count == self.step:
            norm = torch.full((self.engine.model_config.hidden_size,), 2.0)
            self.engine.update_weights({"model.norm.weight": norm}, inflight="restart")


def test_text_offsets_start_over_with_a_restarted_choice(tiny_path):
    """A `restart` commit after a choice's fourth token: its next chunk is marked
    `restarted`, and the completion's text and `text_offset`s both start over."""
    hook = RestartAfter(4)
    engine = hook.engine = make_engine(tiny_path, **SIZES, step_callback=hook)
    server = start_server(EngineBackend(engine), ServerConfig("tiny", max_n=1, max_tokens=16), port=0)
    body = {"prompt": "versions", "max_tokens": 10, "ignore_eos": True, "seed": 3, "logprobs": 1, "stream": True}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    finally:
        server.stop()
        engine.close()
    choices = [c["choices"][0] for c in chunks]
    (at,) = [i for i, c in enumerate(choices) if c.get("restarted")]
    before, after = _tokens_and_offsets(choices[:at]), _tokens_and_offsets(choices[at:])
    for (tokens, offsets), count in ((before, 4), (after, 10)):
        assert len(tokens) == count and offsets == [sum(map(len, tokens[:i])) for i in range(count)]
    text = "".join(c["text"] for c in choices[at:])  # the whole text after the restart: each token at its offset
    assert all(text[o : o + len(t)] == t for t, o in zip(*after, strict=True))
    assert choices[at]["policy_versions"] == [1] and choices[-1]["finish_reason"] == "length"


def _tokens_and_offsets(choices: list[dict]) -> tuple[list[str], list[int]]:
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    return tokens, [o for c in choices for o in c["logprobs"]["text_offset"]]
