"""Stop strings: where one starts in a sequence's output text. The scheduler
asks after every sampled token of a request that has stop strings."""

from __future__ import annotations

from ..tokenizer import TextCodec, find_stop
from .sequence import Sequence


class StopStrings:
    """`find(seq)`: where a stop string starts in `seq`'s output text, or None."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec

    def find(self, seq: Sequence) -> int | None:
        """A stop string must end in the newest token's text, so only a tail
        window is decoded each step (4 tokens per character covers byte-level
        tokenizers, plus slack for the window's first token); a hit is
        confirmed, and its position found, on the whole text once."""
        stops = seq.request.params.stop
        out = seq.output_token_ids
        window = 4 * max(len(s) for s in stops) + 8
        if len(out) > window and find_stop(self.codec.decode(out[-window:]), stops) is None:
            return None
        return find_stop(self.codec.decode(out), stops)
