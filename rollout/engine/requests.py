"""Turning user prompts and sampling parameters into validated `Request`s.

Everything is checked before any request exists, so a bad prompt changes
nothing in the engine.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from ..chat import is_chat
from ..checks import array_shape, as_token_ids
from ..model.config import ModelConfig
from ..sampling_params import MAX_SEED, SamplingParams
from ..tokenizer import TextCodec
from .config import EngineConfig
from .grammar import GrammarState, grammars_for
from .penalties import PenaltyCounts, has_penalties
from .scoring import PromptScores
from .sequence import Request, Sequence


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What prompt validation needs to know about an engine (sent by actors to the driver)."""

    vocab_size: int
    max_seq_len: int
    max_batch_size: int
    page_size: int
    num_pages: int
    max_request_tokens: int | None = None  # one call's `request_tokens` at most; None: no bound
    num_moe_layers: int = 0  # sparse layers whose routing a request may ask for; 0: a dense model

    @classmethod
    def of(cls, cfg: EngineConfig, mc: ModelConfig) -> PromptLimits:
        sizes = (cfg.max_seq_len, cfg.max_batch_size, cfg.page_size, cfg.num_pages)
        return cls(mc.vocab_size, *sizes, cfg.max_request_tokens, mc.moe.num_moe_layers if mc.moe else 0)

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_pages * self.page_size


def validate_prompts(
    prompts, params: SamplingParams, limits: PromptLimits, codec: TextCodec | None
) -> tuple[list[list[int]], list[str | None]]:
    """Token ids and texts of valid prompts; raises `TypeError`/`ValueError` naming the problem."""
    token_lists, texts = _tokenize(prompts, codec, limits.vocab_size)
    _check_params(params, limits, codec)
    for i, ids in enumerate(token_lists):
        _check_fits(i, ids, params, limits)
    check_request_tokens([len(ids) for ids in token_lists], params, limits.max_seq_len, limits.max_request_tokens)
    return token_lists, texts


def request_tokens(prompt_lengths: list[int], params: SamplingParams, max_seq_len: int) -> int:
    """The work one call asks for, in tokens: each prompt's tokens plus the
    outputs it may sample (`max_tokens`, capped by the context), times `n`.
    It bounds the compute, the KV written and the results held for the call."""
    return sum(params.n * (k + min(params.max_tokens, max_seq_len - k)) for k in prompt_lengths)


def check_request_tokens(prompt_lengths: list[int], params: SamplingParams, max_seq_len: int, limit: int | None) -> int:
    """The call's `request_tokens`; `ValueError` (naming `max_tokens`, the usual
    thing to lower, and `max_request_tokens`) past `limit` (None: no bound)."""
    work = request_tokens(prompt_lengths, params, max_seq_len)
    if limit is not None and work > limit:
        raise ValueError(
            f"max_tokens: {len(prompt_lengths)} prompts x n={params.n} x (prompt tokens + max_tokens="
            f"{params.max_tokens}) come to {work} tokens, over max_request_tokens ({limit}); "
            "lower n, max_tokens or the prompts, or split the call"
        )
    return work


def prompt_token_ids(prompt, limits: PromptLimits, codec: TextCodec | None, tools: list | None = None) -> list[int]:
    """One prompt's token ids (a session's start), checked as `generate` checks
    prompts; `tools` reach the chat template of a chat-message prompt."""
    if tools is not None and not is_chat(prompt):
        raise ValueError("tools are passed to the chat template: give the prompt as chat messages")
    (ids,), _ = _tokenize([prompt], codec, limits.vocab_size, tools)
    if len(ids) >= limits.max_seq_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens; max_seq_len is {limits.max_seq_len}, so a prompt may have "
            f"at most {limits.max_seq_len - 1} tokens (one must be generated)"
        )
    return ids


def make_requests(
    prompts,
    params: SamplingParams,
    cfg: EngineConfig,
    mc: ModelConfig,
    codec: TextCodec | None,
    *,
    rng: random.Random,
    request_ids: Iterator[int],
    seq_ids: Iterator[int],
    make_seq: Callable[..., Sequence] = Sequence,
) -> list[Request]:
    """Validate and build the requests of one generate call; raises before creating any."""
    token_lists, texts = validate_prompts(prompts, params, PromptLimits.of(cfg, mc), codec)
    params = _validated_copy(params, mc.vocab_size)
    stop_ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stop_ids.update(codec.eos_token_ids if codec is not None else mc.eos_token_ids)
    grammar = None
    if params.structured_outputs is not None:  # compiled once for the call, before any request exists
        grammar = grammars_for(codec, mc.vocab_size).compile(params.structured_outputs, frozenset(stop_ids))
    requests = []
    for ids, text in zip(token_lists, texts, strict=True):
        seed = params.seed if params.seed is not None else rng.randint(0, MAX_SEED)
        request = Request(
            request_id=next(request_ids),
            prompt_token_ids=ids,
            params=params,
            seed=seed,
            max_tokens=min(params.max_tokens, cfg.max_seq_len - len(ids)),
            stop_token_ids=frozenset(stop_ids),
            prompt=text,
        )
        request.samples = [make_seq(next(seq_ids), request, k, list(ids)) for k in range(params.n)]
        for s in request.samples:
            s.grammar = GrammarState(grammar, mc.vocab_size) if grammar is not None else None
            s.penalty = PenaltyCounts(ids, mc.vocab_size) if has_penalties(params) else None
        if params.prompt_logprobs is not None:
            request.prompt_scores = PromptScores.new(len(ids), 1, params.prompt_logprobs)
        requests.append(request)
    return requests


def _validated_copy(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """The requests' own copy of `params`, validated again on construction: a field
    set after `params` was made (which skips its checks), or after this call,
    never reaches the step's buffers (`validate_prompts` checked its type). Its
    top_k is capped at the vocabulary, which keeps every token as any larger k
    (or 0) does, so the step's int64 buffer holds it."""
    return replace(params, top_k=min(params.top_k, vocab_size))


def render_chat(name: str, messages, codec: TextCodec | None, tools: list | None = None) -> str:
    """The prompt text of chat `messages` (with the generation prompt) by the
    checkpoint's template; errors name `name` and what is wrong (a template's
    own failures are `ChatTemplateError`s, `ValueError`s too)."""
    if codec is None or codec.chat is None:
        raise ValueError(
            f"{name} is chat messages but the checkpoint has no chat template "
            "(chat_template.jinja, or chat_template in tokenizer_config.json) and tokenizer.json"
        )
    try:
        return codec.chat.render(list(messages), add_generation_prompt=True, tools=tools)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None


def _tokenize(
    prompts, codec: TextCodec | None, vocab: int, tools: list | None = None
) -> tuple[list[list[int]], list[str | None]]:
    prompts = _prompt_list(prompts)
    if not prompts:
        return [], []
    if all(isinstance(p, str) for p in prompts):
        if codec is None:
            raise ValueError("prompts are strings but the checkpoint has no tokenizer.json; pass token-id lists")
        texts: list[str | None] = [str(p) for p in prompts]
        token_lists = [codec.encode(t) for t in texts]
    elif all(is_chat(p) for p in prompts):
        texts = [render_chat(f"prompts[{i}]", p, codec, tools) for i, p in enumerate(prompts)]
        token_lists = [codec.encode(t, add_special_tokens=False) for t in texts]  # the rendering holds them
    elif all(isinstance(p, (list, tuple)) or array_shape(p) is not None for p in prompts):
        token_lists = [as_token_ids(f"prompts[{i}]", p) for i, p in enumerate(prompts)]
        texts = [None] * len(prompts)
    elif all(isinstance(p, dict) for p in prompts):
        raise TypeError("prompts is one list of chat messages; pass a list of conversations, [messages]")
    else:
        kinds = sorted({type(p).__name__ for p in prompts})
        raise TypeError(
            f"prompts must be all strings, all token-id lists or all chat-message lists, got a mix of {kinds}"
        )
    for i, ids in enumerate(token_lists):
        if not ids:
            raise ValueError(f"prompts[{i}] is empty: a prompt needs at least one token")
        for t in ids:
            if not 0 <= t < vocab:
                raise ValueError(f"prompts[{i}] has token id {t}, outside the vocabulary [0, {vocab})")
    return token_lists, texts


def _prompt_list(prompts) -> list | tuple:
    """The batch: a list or tuple of prompts, each a string or token ids (a
    list, a tuple, or a 1-D integer numpy array or torch tensor). An array as
    the batch is refused: a 1-D one is a single prompt, and a 2-D one's rows
    are often padded to a common length, so the caller says which rows are
    prompts with `list(array)` (or a list of trimmed rows)."""
    shape = array_shape(prompts)
    if shape is not None:
        ndim = shape[0]
        hint = "[array] for one prompt" if ndim == 1 else "list(array) for one prompt per row (without padding)"
        raise TypeError(f"prompts must be a list of prompts, got a {ndim}-D array; pass {hint}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of strings or a list of token-id lists, got {type(prompts).__name__}")
    return prompts


def _check_params(params: SamplingParams, limits: PromptLimits, codec: TextCodec | None) -> None:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.n > limits.max_batch_size:
        raise ValueError(f"n must be <= the engine's max_batch_size ({limits.max_batch_size}), got {params.n}")
    for t in params.stop_token_ids or ():
        if t >= limits.vocab_size:
            raise ValueError(f"stop_token_ids has {t}, outside the vocabulary [0, {limits.vocab_size})")
    for t in params.logit_bias or ():
        if t >= limits.vocab_size:
            raise ValueError(f"logit_bias has token {t}, outside the vocabulary [0, {limits.vocab_size})")
    if params.stop and codec is None:
        raise ValueError("stop strings need a tokenizer, and the checkpoint has no tokenizer.json")
    if params.return_routed_experts and not limits.num_moe_layers:
        raise ValueError(
            "return_routed_experts=True needs a mixture-of-experts model (qwen3_moe, mixtral); this one is dense"
        )


def pages_to_complete(num_prompt_tokens: int, params: SamplingParams, limits: PromptLimits) -> int:
    """KV pages one request needs to run to completion alone in an empty pool,
    whatever the prefix cache holds.

    Admission: the scheduler admits a group's leader only when the pages of
    its first chunk plus one spare page per pending fork are free (each fork
    later writes one page of its own: a copy of the shared, partly filled last
    page, or its first fresh one). Prefix-cache hits attach the prompt's cached
    full pages first and the chunk follows them, so when every full page is
    cached the leader holds all of the prompt's pages at that count, whatever
    `max_step_tokens` is.

    Completion: a sample's KV covers its prompt and every output token but the
    last, which is sampled and never computed. Preemption lets the samples of a
    group finish one after another, so only one of them at its longest has to
    fit; several requests that each fit take turns the same way.
    """
    ps = limits.page_size
    outputs = min(params.max_tokens, limits.max_seq_len - num_prompt_tokens)
    admit = -(-num_prompt_tokens // ps) + params.n - 1
    longest = -(-(num_prompt_tokens + outputs - 1) // ps)
    return max(admit, longest)


def _check_fits(i: int, ids: list[int], params: SamplingParams, cfg: PromptLimits) -> None:
    if len(ids) >= cfg.max_seq_len:
        raise ValueError(
            f"prompts[{i}] has {len(ids)} tokens; max_seq_len is {cfg.max_seq_len}, so a prompt may have "
            f"at most {cfg.max_seq_len - 1} tokens (one must be generated)"
        )
    pages = pages_to_complete(len(ids), params, cfg)
    if pages > cfg.num_pages:
        raise ValueError(
            f"prompts[{i}] ({len(ids)} tokens) with n={params.n} and max_tokens={params.max_tokens} needs "
            f"{pages} KV pages of {cfg.page_size} tokens to complete (the prompt's pages plus one per further "
            f"sample to admit the group, and the longest sample's pages), but kv_cache_tokens is "
            f"{cfg.kv_cache_tokens} ({cfg.num_pages} pages); raise kv_cache_tokens or lower n or max_tokens"
        )
