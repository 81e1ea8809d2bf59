"""Result types of `generate`: one `RolloutOutput` per prompt, `n` `Sample`s each."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

# Why a sample ended; the scheduler finishes a sequence with no other reason.
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(slots=True)
class Sample:
    """One sampled response."""

    token_ids: list[int]  # generated tokens (a stop token that ended the sample included)
    logprobs: list[float]  # log-probability of each token, per the request's logprobs_mode
    versions: list[int]  # policy version whose weights produced each token
    finish_reason: str  # FINISH_REASONS: "stop" (stop token or string), "length" (max_tokens or context), "abort"
    text: str | None = None  # decoded response when a tokenizer is present (stop string cut off)
    # With params.top_logprobs = k: per token, the k most likely (token id, logprob) pairs of the
    # distribution `logprobs` is reported in, best first; None when not asked for.
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    # With params.return_routed_experts (mixture-of-experts models): the experts each of the first
    # len(token_ids) - 1 tokens went to, `[len(token_ids) - 1, sparse layers, top_k]`, uint8 up to
    # 256 experts else int16, best gate first; the last token was sampled, never computed.
    routed_experts: np.ndarray | None = None


def unstarted_sample(top_logprobs: int, decodes: bool) -> Sample:
    """The sample of work aborted before anything ran, as the engine ends one:
    no tokens, empty text where it decodes, empty top logprobs where asked."""
    return Sample([], [], [], "abort", "" if decodes else None, [] if top_logprobs else None)


@dataclass(slots=True)
class RolloutOutput:
    """All samples of one prompt, in sample order."""

    prompt_token_ids: list[int]
    samples: list[Sample]
    prompt: str | None = None  # the prompt text, when it was given as text
    index: int | None = None  # position of the prompt in the call that submitted it
    # With params.return_routed_experts: the prompt's routed experts `[len(prompt), sparse layers, top_k]`
    # (None when no sample computed the whole prompt, e.g. aborted before it ran).
    prompt_routed_experts: np.ndarray | None = None
    # With params.prompt_logprobs = k: per prompt position, the logprob of its token given the tokens
    # before it, in the request's logprobs mode; the first entry is None (nothing precedes it).
    prompt_logprobs: list[float | None] | None = None
    # With k > 0: per prompt position, the k most likely tokens and the prompt's own token, token id ->
    # logprob, in that distribution; the first entry None. None when not asked for.
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


@dataclass(slots=True)
class ScoredSequence:
    """Teacher-forced logprobs of one given token sequence (`Engine.score`)."""

    token_ids: list[int]
    # Per position, the logprob of its token given the tokens before it (the scoring distribution's);
    # None at position 0 and before the call's `start`.
    logprobs: list[float | None]
    # With top_logprobs = k > 0: per position, the k most likely tokens and the position's own token,
    # token id -> logprob; None where `logprobs` is. None when not asked for.
    top_logprobs: list[dict[int, float] | None] | None
    version: int  # policy version whose weights computed every logprob
    text: str | None = None  # the sequence's text, when it was given as text or chat messages
    index: int | None = None  # position of the sequence in the call


def encode_array(array: np.ndarray | None) -> dict | None:
    """An array for JSON (routed experts in `rollout serve` and `rollout generate`):
    `{"shape", "dtype", "data"}`, `data` its bytes in C order and base64; None stays None."""
    if array is None:
        return None
    data = base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")
    return {"shape": list(array.shape), "dtype": str(array.dtype), "data": data}
