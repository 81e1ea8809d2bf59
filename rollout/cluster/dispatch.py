"""Generation on the cluster: prompt groups dispatched to actors, balanced by
outstanding work; outputs collected as they finish; the groups of an actor
that dies, or that the watchdog finds hung or stalled and replaces, are
re-dispatched to live ones, each delivered exactly once. A generation sets no
time limit of its own on an actor's silence: a long sample may take minutes
to finish, and whether a silent actor still works is the watchdog's call.

The dispatch never touches Ray: it works through the small `Pool` interface
(`ActorPool` in the cluster), so its bookkeeping is testable with a fake."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from ..engine.requests import PromptLimits, validate_prompts
from ..engine.score_requests import ScoreCall, check_score_args, score_token_lists
from ..outputs import RolloutOutput, ScoredSequence, unstarted_sample
from ..sampling_params import SamplingParams
from ..tokenizer import TextCodec
from .actor_slots import ActorGone, ActorSlot, unwrap
from .handles import GenerationHandle


class OutputStream(Protocol):
    """One actor's outputs for one share of prompts, as they finish."""

    def next(self, timeout: float) -> RolloutOutput | None:
        """The next output, None if none came within `timeout` s; raises
        `ActorGone` when the actor died, or the actor's own error."""

    def abort(self) -> None:
        """Ask the actor to end the share's unfinished samples now (they still come back)."""


class Pool(Protocol):
    """What the dispatch needs of the actors (see `ActorPool`)."""

    cond: threading.Condition  # guards every slot's state and load

    def check_open(self) -> None:
        """Raise `ClosedError` once the cluster is shut down."""

    def wait_for_live(self, stop: Callable[[], bool] | None = None) -> list[ActorSlot]:
        """The alive actors, waiting a bounded time for one; called holding
        `cond`. Returns [] once `stop()` is true."""

    def wake(self) -> None:
        """Make `wait_for_live`'s waiters check their `stop` again."""

    def actor_died(self, slot: ActorSlot, generation: int, why: str) -> None:
        """Report that `slot`'s actor of `generation` died (the pool replaces it)."""

    def serving(self, slot: ActorSlot, generation: int) -> bool:
        """Whether `slot`'s actor of `generation` still serves (not dead, hung, stalled or replaced)."""

    def open_stream(
        self, actor: Any, label: str, indices: list[int], prompts: list, params: SamplingParams
    ) -> OutputStream:
        """Start generating `prompts` (numbered `indices`) on `actor`."""


class _Share(NamedTuple):
    """The prompts one actor generates for one dispatch."""

    slot: ActorSlot
    generation: int  # the slot's generation when dispatched: a later death report names this actor
    actor: Any  # the actor handle, fixed at dispatch time
    indices: list[int]  # prompt indices, ascending


def balance(indices: Sequence[int], prompts: Sequence[list[int]], loads: dict[int, int], cost: int) -> dict[int, list]:
    """Which actor generates which prompts: `loads` maps each live actor's
    slot index to its outstanding work, in slot order. A prompt's group of
    samples never splits (they share KV pages); groups go, longest prompt
    first, each to the actor with the least work, ties to the first in slot
    order, and each adds `cost` to it. Returns slot index -> ascending
    prompt indices."""
    loads = dict(loads)
    shares: dict[int, list[int]] = {k: [] for k in loads}
    for i in sorted(indices, key=lambda i: -len(prompts[i])):
        target = min(loads, key=loads.__getitem__)
        shares[target].append(i)
        loads[target] += cost
    return {k: sorted(v) for k, v in shares.items()}


class GenerationDispatch:
    """Generation over a pool of actors: validates prompts, balances groups,
    collects outputs, re-dispatches the groups of an actor that dies.

    `limits` and `codec` validate prompts as an actor's engine would. A
    share's reader looks every `poll_s` seconds, while no output comes,
    whether its actor still serves (`Pool.serving`).
    """

    def __init__(self, pool: Pool, limits: PromptLimits, codec: TextCodec | None, poll_s: float = 1.0) -> None:
        self._pool = pool
        self._limits = limits
        self._codec = codec
        self._poll_s = poll_s

    def submit(self, prompts, params: SamplingParams | None = None) -> GenerationHandle:
        """Start generating and return at once; the handle gives `result()` and
        `as_completed()`. Prompts are validated here, before any is dispatched."""
        self._pool.check_open()
        params = SamplingParams() if params is None else params
        token_lists, texts = validate_prompts(prompts, params, self._limits, self._codec)
        return self._start(token_lists, texts, params)

    def submit_score(self, sequences, top_logprobs: int = 0, params=None, start=1) -> GenerationHandle:
        """Start scoring (`Engine.score` on the actors, sequences balanced and
        re-dispatched as prompts are); the handle's outputs are `ScoredSequence`s.
        Arguments are validated here, before any sequence is dispatched."""
        self._pool.check_open()
        token_lists, texts = score_token_lists(sequences, self._codec, self._limits.vocab_size)
        params, starts = check_score_args(token_lists, top_logprobs, params, start, self._limits)
        return self._start(token_lists, texts, ScoreCall(params.prompt_logprobs, params, tuple(starts)))

    def _start(self, token_lists: list[list[int]], texts: list, params) -> GenerationHandle:
        handle = GenerationHandle(texts)
        handle._on_abort(self._pool.wake)  # an abort ends any wait for a live actor
        if token_lists:
            try:
                self._dispatch(handle, token_lists, params, list(range(len(token_lists))))
            except BaseException:  # a KeyboardInterrupt half-way: the caller never gets the handle
                handle.abort()
                raise
        return handle

    def _dispatch(self, handle: GenerationHandle, prompts, params: SamplingParams, indices: list[int]) -> None:
        """Send the prompts `indices` to the live actors and consume each stream on its own thread."""
        cost = params.n * params.max_tokens
        with self._pool.cond:
            live = self._pool.wait_for_live(lambda: handle.aborted)
            chosen = balance(indices, prompts, {s.index: s.load for s in live}, cost) if live else {}
            for slot in live:
                slot.load += cost * len(chosen[slot.index])
            shares = [_Share(s, s.generation, s.handle, chosen[s.index]) for s in live if chosen[s.index]]
        if not live:  # aborted while no actor was alive: nothing starts
            _deliver_aborted(handle, prompts, params, indices, self._codec is not None)
        for started, share in enumerate(shares):
            handle._assign(share.indices, share.slot.label)
            try:
                stream = self._pool.open_stream(
                    share.actor, share.slot.label, share.indices, [prompts[i] for i in share.indices], params
                )
            except BaseException:  # the shares from here on never start: their load goes
                for unstarted in shares[started:]:
                    self._unload(unstarted, cost * len(unstarted.indices))
                raise
            handle._on_abort(stream.abort)
            threading.Thread(
                target=self._consume,
                args=(handle, prompts, params, share, stream),
                name=f"rollout-stream-{share.slot.index}",
                daemon=True,
            ).start()

    def _consume(self, handle: GenerationHandle, prompts, params, share: _Share, stream: OutputStream) -> None:
        """Deliver one share's outputs; when its actor dies or is replaced
        (hung, stalled), re-dispatch what it had not delivered."""
        remaining, cost = set(share.indices), params.n * params.max_tokens
        try:
            while remaining:
                out = stream.next(self._poll_s)
                if out is None:
                    if not self._pool.serving(share.slot, share.generation):
                        raise ActorGone(f"{share.slot.label} was replaced while generating prompts")
                    continue
                remaining.discard(out.index)
                handle._deliver(out)
                self._unload(share, cost)
        except ActorGone:
            self._unload(share, cost * len(remaining))
            self._pool.actor_died(share.slot, share.generation, "died while generating")
            lost = handle._missing(sorted(remaining))  # an output already delivered is never generated again
            if handle.aborted:  # nothing is regenerated after an abort: the lost samples end empty
                _deliver_aborted(handle, prompts, params, lost, self._codec is not None)
            elif lost:
                try:
                    self._dispatch(handle, prompts, params, lost)
                except BaseException as e:
                    handle._fail(e)
        except BaseException as e:
            self._unload(share, cost * len(remaining))
            handle._fail(unwrap(e))

    def _unload(self, share: _Share, amount: int) -> None:
        with self._pool.cond:
            if share.slot.generation == share.generation:  # a replacement starts with no load
                share.slot.load = max(0, share.slot.load - amount)


def _deliver_aborted(
    handle: GenerationHandle, prompts, params: SamplingParams, indices: list[int], decodes: bool
) -> None:
    """Deliver the prompts `indices`, aborted before anything was sampled: every sample empty."""
    for i in indices:
        if isinstance(params, ScoreCall):
            none = [None] * len(prompts[i])
            handle._deliver(
                ScoredSequence(list(prompts[i]), none, list(none) if params.top_logprobs else None, -1, index=i)
            )
            continue
        empty = [unstarted_sample(params.top_logprobs, decodes) for _ in range(params.n)]
        handle._deliver(RolloutOutput(list(prompts[i]), empty, index=i))
