"""Stop strings: where one starts in a sequence's output text. The scheduler
asks after every sampled token of a request that has stop strings, so the
work per token is bounded by the longest stop string, never the output's
length: only a tail window of tokens is decoded, and only its last
characters are searched."""

from __future__ import annotations

from ..tokenizer import TextCodec, find_stop
from .sequence import Sequence

# A decoded tail window may differ from the whole text in its first few
# characters: the window may start inside a UTF-8 character (up to 3 U+FFFD),
# and decoders treat a first token apart (a Metaspace space dropped, a
# WordPiece "##" kept). Hits starting there are not searched for.
GUARD_CHARS = 4
# Characters the newest token may add beyond its own decoding: a dropped
# leading space, a character it completes.
NEWEST_SLACK = 4
# A token adds at least one byte and a character has at most four, so four
# tokens per character cover any text (tokens the decoder skips aside).
TOKENS_PER_CHAR = 4


class StopStrings:
    """`find(seq)`: where a stop string starts in `seq`'s output text, or None."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec

    def find(self, seq: Sequence) -> int | None:
        """A stop string must end in the newest token's text (earlier ends were
        searched at earlier tokens), so only the last `longest + newest`
        characters are searched, in a tail window of tokens grown until it
        holds them. A hit is placed in the whole text by decoding it once: the
        sample then finishes."""
        stops = seq.request.params.stop
        start = seq.num_prompt_tokens
        ids = seq.token_ids
        newest = len(self.codec.decode(ids[-1:])) + NEWEST_SLACK
        chars = seq.request.longest_stop + newest  # where a stop ending in the newest token may start
        need = chars + GUARD_CHARS
        window = need
        while True:
            whole = len(ids) - start <= window
            tail = self.codec.decode(ids[start:] if whole else ids[-window:])
            if whole or len(tail) >= need or window >= TOKENS_PER_CHAR * need:
                break
            window *= TOKENS_PER_CHAR
        if whole:
            return find_stop(tail, stops, max(0, len(tail) - chars))
        hit = find_stop(tail, stops, max(GUARD_CHARS, len(tail) - chars))
        if hit is None:
            return None
        text = self.codec.decode(ids[start:])
        cut = find_stop(text, stops, max(0, len(text) - (len(tail) - hit)))
        # Past the guard the tail is the text's suffix, so the hit is there; a
        # decoder that rewrote it would still stop here, at the tail's offset.
        return cut if cut is not None else len(text) - (len(tail) - hit)
