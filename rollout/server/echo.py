"""Prompt logprobs in responses.

- Completions' `echo`: each choice's text starts with the prompt's (as given,
  or decoded from token ids), and with `logprobs` its `logprobs` cover the
  prompt's tokens before the completion's, the first `None` (nothing precedes
  it), as OpenAI's legacy API and vLLM give them. `max_tokens=0` with echo
  answers the prompt alone: the engine samples one token from the prompt's last
  row, as any prefill does, and it is dropped (no extra step is computed).
- vLLM's `prompt_logprobs` extension (both endpoints): per prompt position
  `None` first, then `{token id: {"logprob", "rank", "decoded_token"}}` with
  the k most likely tokens (ranks 1..k) and the prompt's own token (its rank
  when it is among them, else null: the engine keeps no full ranking); on each
  completion choice, and at the top level of a chat response, where vLLM puts it.
- Streamed completions (`echo_chunk`), as vLLM streams echo: each choice's
  first chunk carries the prompt's text before its first tokens' and, with
  `logprobs`, the prompt tokens' logprobs before theirs (text offsets from the
  prompt's start), so the chunks put together equal the whole response; with
  `max_tokens=0` that chunk holds the prompt alone. `prompt_logprobs` (which
  vLLM refuses when streaming) rides on the same chunk. A chunk that restarts
  its choice (a `restart` weight commit) echoes the prompt again, as recomputed.

The logprobs are the engine's prompt logprobs (`SamplingParams.prompt_logprobs`),
in the request's distribution (temperature, filters, `logprobs_mode`), as its
sampled tokens' are."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..engine.streams import SampleDelta
from ..outputs import RolloutOutput, Sample

if TYPE_CHECKING:
    from .responses import Reply

# JSON has no infinities: a token the filters dropped scores this, as vLLM reports it.
MIN_LOGPROB = -9999.0


@dataclass(frozen=True, slots=True)
class Echo:
    """What a request asks of its prompts' logprobs."""

    echo: bool  # completions: the prompt's text (and tokens' logprobs) start each choice
    drop_samples: bool  # max_tokens=0: nothing generated is answered
    texts: tuple[str | None, ...]  # per prompt, its text as given; None: token ids (decoded)
    top: int | None  # echo's alternatives per prompt position (the request's logprobs); None: no logprobs
    extension: int | None  # vLLM's prompt_logprobs; None: not asked for

    @classmethod
    def of(cls, req, prompts: list) -> Echo | None:
        echo = bool(getattr(req, "echo", False))  # chat requests refuse it (schemas.py)
        if not echo and req.prompt_logprobs is None:
            return None
        top = req.logprobs if echo and req.logprobs is not None else None
        texts = tuple(p if isinstance(p, str) else None for p in prompts)
        return cls(echo, echo and req.max_tokens == 0, texts, top, req.prompt_logprobs)

    @property
    def prompt_logprobs(self) -> int | None:
        """The engine's `prompt_logprobs`: the larger count asked; None when none is."""
        counts = [k for k in (self.top, self.extension) if k is not None]
        return max(counts) if counts else None


def drop_samples(echo: Echo | None, outputs: list[RolloutOutput]) -> list[RolloutOutput]:
    """`outputs` without their samples' tokens when the request asked for none (`max_tokens=0`)."""
    if echo is None or not echo.drop_samples:
        return outputs
    return [
        replace(
            out,
            samples=[
                Sample([], [], [], "length", "", [] if s.top_logprobs is not None else None, _no_rows(s.routed_experts))
                for s in out.samples
            ],
        )
        for out in outputs
    ]


def drop_delta(echo: Echo | None, delta: SampleDelta) -> SampleDelta:
    """A streamed `delta` without its tokens when the request asked for none (`max_tokens=0`)."""
    if echo is None or not echo.drop_samples:
        return delta
    return replace(delta, token_ids=(), logprobs=(), versions=(), top_logprobs=())


def _no_rows(array):
    """`array` with none of its rows (None stays None): a sample that kept no token."""
    return None if array is None else array[:0].copy()


def echo_choice(reply: Reply, choice: dict, prompt: int, out: RolloutOutput, sample: Sample) -> None:
    """Complete a completion `choice` (of prompt number `prompt`) with what `reply.job.echo` asks."""
    ids, lps, tops = out.prompt_token_ids, out.prompt_logprobs, out.prompt_top_logprobs
    sample_top = sample.top_logprobs or [()] * len(sample.token_ids)
    _echo(reply, choice, prompt, (ids, lps, tops), (sample.token_ids, sample.logprobs, sample_top))


def echo_chunk(reply: Reply, chunk: dict, prompt: int, delta: SampleDelta) -> None:
    """Complete a streamed completion `chunk` of `delta` (of prompt number `prompt`) with
    what `reply.job.echo` asks, when the delta carries its prompt (a choice's first, or a
    restarted one); the chunk's text and logprobs then start at the prompt's."""
    if reply.job.echo is None or delta.prompt is None:
        return
    p = delta.prompt
    own = (delta.token_ids, delta.logprobs, delta.top_logprobs or [()] * len(delta.token_ids))
    _echo(reply, chunk["choices"][0], prompt, (p.token_ids, p.logprobs, p.top_logprobs), own)


def _echo(reply: Reply, choice: dict, prompt: int, prompt_part: tuple, own: tuple) -> None:
    """The echo of a choice (or a chunk's), from the prompt's (ids, logprobs, tops) and its own."""
    echo, (ids, lps, tops) = reply.job.echo, prompt_part
    if echo.echo:
        text = echo.texts[prompt]
        if text is None:
            text = reply.codec.decode(list(ids)) if reply.codec is not None else ""
        choice["text"] = text + choice["text"]
        if reply.job.logprobs:
            choice["logprobs"] = _echo_logprobs(reply, choice["index"], prompt_part, own, echo.top)
    if echo.extension is not None:
        choice["prompt_logprobs"] = prompt_logprobs(reply, ids, lps, tops, echo.extension)


def echo_body(reply: Reply, body: dict, outputs: list[RolloutOutput]) -> None:
    """A chat response's top-level `prompt_logprobs` (its one prompt's)."""
    if reply.job.echo is not None and reply.job.echo.extension is not None:
        out = outputs[0]
        k = reply.job.echo.extension
        body["prompt_logprobs"] = prompt_logprobs(
            reply, out.prompt_token_ids, out.prompt_logprobs, out.prompt_top_logprobs, k
        )


def _echo_logprobs(reply: Reply, index: int, prompt_part: tuple, own: tuple, k: int) -> dict:
    """The legacy `logprobs` object over the prompt's tokens, then the choice's own."""
    (ids, lps, tops), (own_ids, own_lps, own_tops) = prompt_part, own
    prompt_top = [() if d is None else _best(d, k) for d in (tops or [None] * len(ids))]
    reply.offsets.pop(index, None)  # offsets count from the prompt's first character
    logprobs = reply._logprobs(index, [*ids, *own_ids], [*lps, *own_lps], [*prompt_top, *own_tops])
    logprobs["top_logprobs"][0] = None  # the first token has no distribution to rank it in
    return logprobs


def prompt_logprobs(
    reply: Reply, ids: Sequence[int], lps: Sequence[float | None], tops: Sequence | None, k: int
) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of one prompt (its token ids, logprobs and alternatives),
    keyed by token id strings."""
    tops = tops or [None] * len(ids)
    entries: list[dict | None] = [None]
    for i in range(1, len(ids)):
        token, logprob = ids[i], lps[i]
        best = _best(tops[i], k) if tops[i] is not None else ()
        ranked = {t: (lp, r + 1) for r, (t, lp) in enumerate(best)}
        ranked.setdefault(token, (logprob, None))
        entries.append(
            {
                str(t): {"logprob": max(lp, MIN_LOGPROB), "rank": r, "decoded_token": _text(reply, t)}
                for t, (lp, r) in ranked.items()
            }
        )
    return entries


def _best(top: dict[int, float], k: int) -> tuple[tuple[int, float], ...]:
    """The `k` most likely of a position's alternatives, best first (ties by lower id)."""
    return tuple(sorted(top.items(), key=lambda item: (-item[1], item[0]))[:k])


def _text(reply: Reply, token: int) -> str:
    return reply.codec.decode([token]) if reply.codec is not None else f"token_id:{token}"
