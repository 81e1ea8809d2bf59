"""Streamed text: incremental detokenisation and server-sent events.

A sample's text is decoded as its tokens arrive, without re-decoding it
whole each step: a window of tokens from `prefix` on is decoded, and what
its text adds beyond the text of the window's already-read part is new (the
method of vLLM's and TGI's detokenisers; the earlier tokens give decoders
that treat a sequence's start specially, such as SentencePiece's leading
space, the context they need). Text is released with two holds:

- a trailing U+FFFD is held back: the token ended inside a multi-byte
  UTF-8 character whose next bytes are still to come;
- while a sample is unfinished, its last (longest stop string - 1)
  characters are held back, as a stop string may be completing there; the
  engine cuts the text where a stop string starts, and no text past that
  point may have been sent. The token that completes a stop string is a
  sample's last, so the text of a sample's last tokens is never released
  by them: a stop string ending there starts at or after the text released
  before them.

At a sample's end the rest of the engine's own final text is released, so
the concatenated stream equals the non-streamed text exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalText:
    """The decoded text of a growing list of token ids."""

    def __init__(self, decode: Callable[[list[int]], str] | None) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""  # decoded so far (a trailing partial character excluded)
        self._prefix = 0  # the window starts here
        self._read = 0  # tokens up to here are in `text`

    def extend(self, token_ids: tuple[int, ...] | list[int]) -> None:
        self.ids.extend(token_ids)
        if self._decode is None or not token_ids:
            return
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)


class SampleText:
    """What of one sample's text may be sent, and what has been."""

    def __init__(self, decode: Callable[[list[int]], str] | None, stops: list[str] | None) -> None:
        self._decode = decode
        self.hold = max((len(s) for s in stops), default=1) - 1 if stops else 0
        self.decoded = IncrementalText(decode)
        self.sent = 0  # characters of text sent

    def add(self, token_ids: tuple[int, ...], last: bool = False) -> str:
        """New tokens; returns the text they release. A sample's `last` tokens
        release nothing: they may complete a stop string whose start lies in
        the held-back text; `finish` sends the rest, cut where the engine cut it."""
        self.decoded.extend(token_ids)
        if last:
            return ""
        safe = len(self.decoded.text) - self.hold
        if safe <= self.sent:
            return ""
        out = self.decoded.text[self.sent : safe]
        self.sent = safe
        return out

    def restart(self, token_ids: tuple[int, ...], last: bool = False) -> str:
        """The sample started over (a `restart` weight commit): decode anew from `token_ids`."""
        self.decoded = IncrementalText(self._decode)
        self.sent = 0
        return self.add(token_ids, last)

    def finish(self, final_text: str | None) -> str:
        """The engine's final text; returns what of it is still unsent."""
        if final_text is None:
            return ""
        out = final_text[self.sent :]
        self.sent = len(final_text)
        return out


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # one encoder: a chunk per token


def sse(payload: dict) -> bytes:
    """One server-sent event holding `payload` as JSON."""
    return b"data: " + _JSON.encode(payload).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
