"""Response bodies and stream chunks of both endpoints, as plain dicts.

`/v1/completions` and `/v1/chat/completions` differ only in names and in
where a choice's text goes (`text`, or `message`/`delta` with `content`), so
one `Shape` per endpoint answers those differences and the rest is shared.

Extensions on every choice: `policy_versions` (the policy version of each
token); with `return_token_ids`, `token_ids` (and for completions
`prompt_token_ids`; for chat the top-level `prompt_token_ids`); with
`return_routed_experts` (mixture-of-experts models), `routed_experts` and,
where the prompt ids go, `prompt_routed_experts`, each an array as
`{"shape", "dtype", "data"}` with `data` its bytes in base64 (C order, the
machine's byte order: little-endian on every supported host), on the
whole response's choices and on a stream's last chunk of each choice. Top
level: `policy_version`, the newest version among the response's tokens."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..outputs import RolloutOutput, encode_array
from ..tokenizer import TextCodec
from .echo import MIN_LOGPROB, echo_body, echo_choice
from .tool_output import with_calls
from .translate import Job


@dataclass(slots=True)
class Reply:
    """What every body and chunk of one response shares."""

    job: Job
    model: str
    codec: TextCodec | None
    version: int  # the newest policy version seen (the backend's when no token came yet)
    chat: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)  # completions' text_offset, per choice

    def __post_init__(self) -> None:
        self.chat = self.job.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    # -- whole responses ---------------------------------------------------------------
    def body(self, outputs: list[RolloutOutput]) -> dict:
        n = self.job.params.n
        choices = []
        for p, out in enumerate(outputs):
            for k, s in enumerate(out.samples):
                self.version = max([self.version, *s.versions])
                c = self._choice(
                    p * n + k, s.text or "", s.token_ids, s.logprobs, s.versions, "message", s.top_logprobs
                )
                c["finish_reason"] = s.finish_reason
                if self.chat and self.job.tool_parser is not None:
                    with_calls(c, s.text or "", s.finish_reason, self.job.tool_parser)
                if self.job.return_token_ids and not self.chat:
                    c["prompt_token_ids"] = out.prompt_token_ids
                if self.job.echo is not None and not self.chat:
                    echo_choice(self, c, p, out, s)
                self._routing(c, out, k)
                choices.append(c)
        body = self._head("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(outputs)
        if self.chat:
            echo_body(self, body, outputs)
        if self.job.return_token_ids and self.chat:
            body["prompt_token_ids"] = outputs[0].prompt_token_ids
        if self.chat and self.job.params.return_routed_experts:
            body["prompt_routed_experts"] = encode_array(outputs[0].prompt_routed_experts)
        return body

    def _routing(self, choice: dict, out: RolloutOutput, k: int) -> None:
        """Sample `k`'s routed experts on `choice`, and for completions the prompt's."""
        if self.job.params.return_routed_experts:
            choice["routed_experts"] = encode_array(out.samples[k].routed_experts)
            if not self.chat:
                choice["prompt_routed_experts"] = encode_array(out.prompt_routed_experts)

    # -- stream chunks -----------------------------------------------------------------
    def chunk(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int] = (),
        logprobs: Sequence[float] = (),
        versions: Sequence[int] = (),
        first: bool = False,
        top: Sequence[Sequence[tuple[int, float]]] = (),
        restarted: bool = False,
    ) -> dict:
        """A chunk of choice `index`: its new text and the tokens since its last chunk.
        `restarted`: the choice started over (a `restart` weight commit), and this
        chunk says so; its text and its tokens' `text_offset`s start over from 0."""
        if versions:
            self.version = max(self.version, max(versions))
        if restarted:
            self.offsets.pop(index, None)
        choice = self._choice(index, text, token_ids, logprobs, versions, "role" if first else "delta", top)
        if restarted:
            choice["restarted"] = True
        return self._head("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def last_chunk(self, index: int, text: str, finish_reason: str, out: RolloutOutput) -> dict:
        """A choice's last chunk: the rest of its text and why it ended."""
        chunk = self.chunk(index, text)
        chunk["choices"][0]["finish_reason"] = finish_reason
        if self.job.return_token_ids:
            (chunk["choices"][0] if not self.chat else chunk)["prompt_token_ids"] = out.prompt_token_ids
        self._routing(chunk["choices"][0], out, index % self.job.params.n)
        if self.chat and self.job.params.return_routed_experts:
            chunk["prompt_routed_experts"] = encode_array(out.prompt_routed_experts)
        return chunk

    def usage_chunk(self, outputs: list[RolloutOutput]) -> dict:
        chunk = self._head("chat.completion.chunk" if self.chat else "text_completion", [])
        chunk["usage"] = usage(outputs)
        return chunk

    # -- parts -------------------------------------------------------------------------
    def _head(self, kind: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "policy_version": self.version,
        }

    def _choice(self, index, text, token_ids, logprobs, versions, part: str, top=None) -> dict:
        """`part`: "message" (a whole chat response), "role" (a chat stream's first chunk) or "delta"."""
        choice: dict = {"index": index}
        if self.chat and part == "delta":
            choice["delta"] = {"content": text}
        elif self.chat:
            choice["delta" if part == "role" else "message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(index, token_ids, logprobs, top) if self.job.logprobs else None
        choice["finish_reason"] = None
        choice["policy_versions"] = list(versions)
        if self.job.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def _logprobs(self, index: int, token_ids: Sequence[int], logprobs: Sequence[float], top) -> dict:
        """Chat: `content`, per token its logprob and `top_logprobs` (the request's
        count, best first). Completions: `tokens`, `token_logprobs`, `text_offset`
        and `top_logprobs`, per token a dict of the top alternatives plus the
        sampled token, as vLLM and OpenAI's legacy API give it."""
        tokens = token_strings(self.codec, token_ids)
        top = top or [()] * len(tokens)
        alternatives = [[(s, _finite(lp)) for s, (_, lp) in zip(self._strings(t), t, strict=True)] for t in top]
        if self.chat:
            content = [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": _entries(alts)}
                for t, lp, alts in zip(tokens, logprobs, alternatives, strict=True)
            ]
            return {"content": content, "refusal": None}
        offset = self.offsets.get(index, 0)
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        self.offsets[index] = offset
        tops = [{**dict(alts), t: lp} for t, lp, alts in zip(tokens, logprobs, alternatives, strict=True)]
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}

    def _strings(self, alternatives: Sequence[tuple[int, float]]) -> list[str]:
        return token_strings(self.codec, [t for t, _ in alternatives])


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _entries(alternatives: list[tuple[str, float]]) -> list[dict]:
    return [{"token": s, "logprob": lp, "bytes": list(s.encode())} for s, lp in alternatives]


def usage(outputs: list[RolloutOutput]) -> dict:
    prompt = sum(len(out.prompt_token_ids) for out in outputs)
    completion = sum(len(s.token_ids) for out in outputs for s in out.samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_strings(codec: TextCodec | None, token_ids: Sequence[int]) -> list[str]:
    """Each token's own text (special tokens decode to ""); `token_id:N` without a tokenizer."""
    if codec is None:
        return [f"token_id:{t}" for t in token_ids]
    return [codec.decode([t]) for t in token_ids]
