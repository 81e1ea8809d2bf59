"""Text in and text out: a thin wrapper over a `tokenizer.json` (the
`tokenizers` library), with the checkpoint's eos ids, its chat template
(`rollout/chat.py`) and stop-string search."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class TextCodec:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.chat = None  # the checkpoint's ChatTemplate (rollout/chat.py), when it has one

    @classmethod
    def from_dir(cls, path: str | Path, config_eos: tuple[int, ...]) -> TextCodec | None:
        """The checkpoint's tokenizer, or None when it ships no `tokenizer.json`.

        eos ids come from config.json / generation_config.json; when those
        name none, from the `eos_token` of tokenizer_config.json.
        """
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises its own exception type
            raise ValueError(f"tokenizer.json in {str(path)!r} cannot be loaded: {e}") from None
        eos = config_eos or _eos_from_tokenizer_config(path, tok)
        codec = cls(tok, eos)
        from .chat import ChatTemplate  # chat.py encodes with this module's TextCodec

        codec.chat = ChatTemplate.from_dir(path, codec)
        return codec

    @classmethod
    def from_json(cls, text: str, eos_token_ids: tuple[int, ...], chat: tuple[dict, dict] | None = None) -> TextCodec:
        """A codec from the text of a tokenizer.json and the chat templates and
        special-token strings `chat_parts` gave (as an actor sends them to the driver)."""
        codec = cls(Tokenizer.from_str(text), eos_token_ids)
        if chat is not None:
            from .chat import ChatTemplate

            codec.chat = ChatTemplate(chat[0], chat[1], codec)
        return codec

    def to_json(self) -> str:
        return self._tok.to_str()

    def chat_parts(self) -> tuple[dict, dict] | None:
        """The chat templates and their special-token strings, for `from_json`; None without a template."""
        return None if self.chat is None else (dict(self.chat.templates), dict(self.chat.special_tokens))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, special tokens (e.g. BOS) added as the tokenizer specifies
        unless `add_special_tokens` is False (a rendered chat template already holds them).
        Special-token text inside `text` (e.g. `<|im_end|>`) maps to its token either way."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, letting other Python threads run meanwhile: the tokenizers
        library releases the GIL for batches only, and a server tokenizing a
        long prompt on a worker thread must not stop its event loop. (A batch
        marks the process as having used the library's thread pool: a later
        fork warns, so `encode` stays the plain call.)"""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary entry of one token (special tokens included), or None outside it."""
        return self._tok.id_to_token(token_id)


def find_stop(text: str, stops: list[str], search_from: int = 0) -> int | None:
    """Index of the earliest stop string in `text` at or after `search_from`, or None."""
    found = [i for s in stops if (i := text.find(s, search_from)) >= 0]
    return min(found) if found else None


def _eos_from_tokenizer_config(path: Path, tok: Tokenizer) -> tuple[int, ...]:
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return ()
    try:
        eos = json.loads(file.read_text()).get("eos_token")
    except (json.JSONDecodeError, AttributeError):
        return ()
    if isinstance(eos, dict):
        eos = eos.get("content")
    token_id = tok.token_to_id(eos) if isinstance(eos, str) else None
    return () if token_id is None else (token_id,)
