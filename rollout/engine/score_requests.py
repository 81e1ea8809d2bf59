"""The requests of `Engine.score`: the sequences to score as token ids, the
scoring distribution and where each sequence's wanted logprobs start,
validated before any request exists (see `scoring`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from ..chat import is_chat
from ..checks import check_int, is_int
from ..outputs import ScoredSequence
from ..sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from .requests import PromptLimits, _tokenize
from .scoring import PromptScores
from .sequence import Request, Sequence
from .shared_scores import ShareMerge, plan_shares
from .streams import Generation


def score_token_lists(sequences, codec, vocab_size: int) -> tuple[list[list[int]], list[str | None]]:
    """Token ids (and texts) of the sequences to score: token-id lists as they are,
    strings encoded as prompts are, chat messages rendered whole (no generation prompt:
    the conversation's last message is scored, not a reply to it)."""
    if isinstance(sequences, (list, tuple)) and sequences and all(is_chat(s) for s in sequences):
        if codec is None or codec.chat is None:
            raise ValueError("sequences are chat messages but the checkpoint has no chat template and tokenizer.json")
        texts: list[str | None] = []
        for i, messages in enumerate(sequences):
            try:
                texts.append(codec.chat.render(list(messages), add_generation_prompt=False))
            except (TypeError, ValueError) as e:
                raise type(e)(f"sequences[{i}]: {e}") from None
        return [codec.encode(t, add_special_tokens=False) for t in texts], texts
    try:
        return _tokenize(sequences, codec, vocab_size)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("prompts", "sequences").replace("a prompt", "a sequence")) from None


def check_score_args(
    token_lists: list[list[int]], top_logprobs: int, params: SamplingParams | None, start, limits: PromptLimits
) -> tuple[SamplingParams, list[int]]:
    """The scoring distribution's params and each sequence's start; raises naming the field."""
    k = check_int("top_logprobs", top_logprobs, 0, f"and <= {MAX_TOP_LOGPROBS} (0 = off)")
    if k > MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams or None, got {type(params).__name__}")
    starts = [start] * len(token_lists) if is_int(start) else start
    if not isinstance(starts, (list, tuple)) or len(starts) != len(token_lists):
        raise TypeError(f"start must be an int or a list of one int per sequence ({len(token_lists)}), got {start!r}")
    starts = [check_int(f"start[{i}]", s, 1, "(position 0 has no logprob)") for i, s in enumerate(starts)]
    ps = limits.page_size
    for i, (ids, s) in enumerate(zip(token_lists, starts, strict=True)):
        if len(ids) > limits.max_seq_len:
            raise ValueError(f"sequences[{i}] has {len(ids)} tokens, over max_seq_len ({limits.max_seq_len})")
        if -(-len(ids) // ps) > limits.num_pages:
            raise ValueError(
                f"sequences[{i}] ({len(ids)} tokens) needs more KV pages than kv_cache_tokens "
                f"({limits.kv_cache_tokens}) holds; raise kv_cache_tokens"
            )
        if s > len(ids):
            raise ValueError(f"start[{i}] must be <= the sequence's length ({len(ids)}), got {s}")
    total = sum(map(len, token_lists))
    if limits.max_request_tokens is not None and total > limits.max_request_tokens:
        raise ValueError(
            f"sequences: {total} tokens in all, over max_request_tokens ({limits.max_request_tokens}); split the call"
        )
    return replace(params, n=1, top_k=min(params.top_k, limits.vocab_size), prompt_logprobs=k), starts


@dataclass(slots=True)
class ScoreBatch:
    """A score call's requests: `indices[i]` is request i's sequence in the call; the
    sequences a `Share` covers whole run none (see `shared_scores`)."""

    requests: list[Request]
    indices: list[int]
    merge: ShareMerge
    params: SamplingParams
    aborted: bool = False


def _request(engine, ids: list[int], text: str | None, params: SamplingParams, first: int) -> Request:
    request = Request(next(engine._request_ids), ids, params, 0, 0, frozenset(), text, score_only=True)
    request.samples = [Sequence(next(engine._seq_ids), request, 0, list(ids))]
    request.prompt_scores = PromptScores.new(len(ids), first, params.prompt_logprobs)
    return request


def score_requests(sequences, top_logprobs: int, params, start, engine) -> ScoreBatch:
    """Validated score-only requests of one `score` call, each asking for the positions no
    earlier sequence of the call shares with it; raises before creating any."""
    limits = PromptLimits.of(engine.config, engine.model_config)
    token_lists, texts = score_token_lists(sequences, engine.codec, limits.vocab_size)
    params, starts = check_score_args(token_lists, top_logprobs, params, start, limits)
    merge = ShareMerge(token_lists, texts, starts, plan_shares(token_lists, starts), params.prompt_logprobs)
    batch = ScoreBatch([], [], merge, params)
    for i, (ids, text, first, share) in enumerate(zip(token_lists, texts, starts, merge.shares, strict=True)):
        if merge.runs_request(i):
            batch.requests.append(_request(engine, ids, text, params, first if share is None else share.end))
            batch.indices.append(i)
    return batch


def _outputs(engine, batch: ScoreBatch) -> Iterator[tuple[int, ScoredSequence]]:
    """(index, result) as sequences complete: a sharing one once its donor has too."""
    merge, drive = batch.merge, engine._drive(list(batch.requests))
    try:
        for position, result in drive:
            index = batch.indices[position]
            merge.add(index, replace(result, index=index))
            if merge.shares[index] is None:
                yield index, merge.done[index]
            while ready := merge.resolve():
                yield from ((j, merged) for j, merged in ready if merged is not None)
                yield from _again(engine, batch, [j for j, merged in ready if merged is None])
    finally:
        drive.close()


def _again(engine, batch: ScoreBatch, indices: list[int]) -> Iterator[tuple[int, ScoredSequence]]:
    """Sequences `indices` scored again, together, by requests of their own (each one's own
    positions and its donor's were computed under different weights); after an abort, their
    own positions only."""
    merge = batch.merge
    if batch.aborted:
        results = [(j, merge.own[j]) for j in indices]
    else:
        requests = [
            _request(engine, merge.token_lists[j], merge.texts[j], batch.params, merge.starts[j]) for j in indices
        ]
        batch.requests.extend(requests)  # an abort ends them too
        results = ((indices[i], replace(r, index=indices[i])) for i, r in engine._drive(requests))
    for j, result in results:
        merge.add(j, result)
        yield j, result


def _abort(engine, batch: ScoreBatch) -> None:
    batch.aborted = True
    engine._abort(list(batch.requests))


@dataclass(frozen=True, slots=True)
class ScoreCall:
    """A score call's settings as a cluster sends them to its actors with the
    sequences' token ids (`score_iter`); `starts` is indexed by sequence index."""

    top_logprobs: int
    params: SamplingParams  # resolved by `check_score_args`
    starts: tuple[int, ...]

    n = 1  # what a dispatch balances: one row of work per sequence
    max_tokens = 1


def score_iter(engine, sequences, top_logprobs: int = 0, params=None, start=1) -> Generation:
    """`run_score` as a `Generation`: `(index, ScoredSequence)` pairs as sequences
    finish; `abort()` ends the unfinished ones (their logprobs None where not computed)."""
    engine._check_open()
    engine._check_awake()
    batch = score_requests(sequences, top_logprobs, params, start, engine)
    return Generation(_outputs(engine, batch), lambda: _abort(engine, batch))


def run_score(engine, sequences, top_logprobs: int = 0, params=None, start=1) -> list[ScoredSequence]:
    """`Engine.score`: one `ScoredSequence` per sequence, in order. Sequences are all
    token-id lists, all strings (encoded as prompts are) or all chat conversations
    (rendered whole, without a generation prompt). `params` (a `SamplingParams`; None:
    the raw log-softmax) gives the distribution, as sampling with it reports logprobs:
    temperature, top-k/top-p/min-p and `logprobs_mode`; its other fields are unused.
    `top_logprobs` (0 to 20) adds per position the k most likely tokens and the
    position's own. Logprobs before `start` (an int >= 1, or one per sequence) are not
    wanted: they are None, and the pages before it may come from the prefix cache.
    Bad arguments raise `ValueError`/`TypeError` naming the field, before anything runs."""
    outputs = dict(score_iter(engine, sequences, top_logprobs, params, start))
    return [outputs[i] for i in range(len(outputs))]
