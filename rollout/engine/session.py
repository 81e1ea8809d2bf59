"""`Session`: a multi-turn episode, token-exact across turns.

The session holds the trajectory as token ids and never re-encodes text it
already holds: each turn continues from `token_ids` exactly, and what the
model sampled enters the trajectory as the sampled ids, so a trainer trains
on exactly the tokens the policy produced (`loss_mask` 1 there, with their
logprobs and versions) and on nothing it did not (observations, prompt: mask
0, logprob 0.0, version -1).

Where turns run is a `SessionBackend`: on an `Engine` (`EngineTurns` here:
the session keeps its KV between turns in a lease, `rollout.engine.leases`,
so the next turn computes only what was added since, as long as no weight
commit released it), or pinned to one actor of a cluster
(`rollout.cluster.sessions`). Sessions from many threads, or asyncio tasks
through `generate_async`, batch together in the engine's steps.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..chat import is_chat
from ..checks import array_shape, as_token_ids
from ..outputs import RolloutOutput, Sample
from ..sampling_params import SamplingParams
from ..tokenizer import TextCodec
from .leases import LeaseSlot
from .requests import PromptLimits, prompt_token_ids

if TYPE_CHECKING:
    from .engine import Engine


class SessionBackend(Protocol):
    """Where a session's turns run."""

    codec: TextCodec | None  # encodes text observations; its `chat` renders chat messages
    vocab_size: int
    max_seq_len: int
    prompt_routing: np.ndarray | None  # the last turn's prompt routing, when it asked for routed experts

    def turn(self, token_ids: list[int], params: SamplingParams) -> Future:
        """Start sampling one continuation of `token_ids` (`params.n == 1`);
        the future gives its `Sample`."""

    def release(self) -> None:
        """Free what the session holds between turns (idempotent)."""

    def abort(self) -> None:
        """End the turn under way, if any, keeping what it sampled (thread-safe)."""


class EngineTurns:
    """A session's turns on one in-process `Engine`, its KV leased between
    them, stepped by the engine's background driver (`engine/background.py`):
    a waiting turn costs a future, not a thread."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._slot = LeaseSlot()
        self.codec = engine.codec
        self.vocab_size = engine.model_config.vocab_size
        self.max_seq_len = engine.config.max_seq_len
        self.prompt_routing: np.ndarray | None = None  # the last turn's prompt routing, when it asked

    def turn(self, token_ids: list[int], params: SamplingParams) -> Future:
        return self._engine._session_turn(token_ids, params, self._slot, self._pick)

    def _pick(self, output: RolloutOutput) -> Sample:
        self.prompt_routing = output.prompt_routed_experts
        return output.samples[0]

    def release(self) -> None:
        self._engine._release_lease(self._slot)

    def abort(self) -> None:
        if self._slot.request is not None:
            self._engine._abort([self._slot.request])


class Session:
    """Use `Engine.session(prompt)` or `RolloutCluster.session(prompt)` to make one.
    See the module docstring."""

    def __init__(self, backend: SessionBackend, prompt, limits: PromptLimits, tools: list | None = None) -> None:
        """`prompt` (token ids, text or chat messages) is checked and encoded
        here, `tools` passed to the chat template, before anything else."""
        prompt_ids = prompt_token_ids(prompt, limits, backend.codec, tools)
        self._backend = backend
        # Chat follow-ups render after the same system message and tools (templates that move them show it).
        system = prompt[0].get("content") if is_chat(prompt) and prompt[0].get("role") == "system" else None
        self._chat_context = {"system": system if isinstance(system, str) else None, "tools": tools}
        self._ids = list(prompt_ids)
        self._mask = [0] * len(prompt_ids)
        self._logprobs = [0.0] * len(prompt_ids)
        self._versions = [-1] * len(prompt_ids)
        self._lock = threading.Lock()  # one call at a time changes the trajectory
        self._state = threading.Lock()  # guards `_closed` and the turn start's flags: never held across a turn
        self._closed = False
        self._starting = False  # a turn is being handed to the backend (guarded by `_state`)
        self._abort_asked = False  # abort() came while it was: replayed once the backend holds it
        self.samples: list[Sample] = []  # every turn's sample, in order
        self._routed: np.ndarray | None = None  # see `routed_experts`
        self._after_turn = False  # the trajectory ends with a sampled turn

    # -- the trajectory ------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        """The whole trajectory: prompt, sampled turns and observations."""
        return list(self._ids)

    @property
    def loss_mask(self) -> list[int]:
        """1 exactly where the model sampled the token, else 0."""
        return list(self._mask)

    @property
    def logprobs(self) -> list[float]:
        """The sampled token's logprob (per the turn's `logprobs_mode`), 0.0 elsewhere."""
        return list(self._logprobs)

    @property
    def versions(self) -> list[int]:
        """The policy version that sampled the token, -1 elsewhere."""
        return list(self._versions)

    @property
    def routed_experts(self) -> np.ndarray | None:
        """Mixture-of-experts models, after a turn with `return_routed_experts`: the experts every
        position that went through a forward was routed to, `[positions, sparse layers, top_k]`,
        the trajectory up to the last turn's final token (sampled, never computed), as that turn's
        KV holds them (one routing per position, the one later tokens attended to), on an engine
        or a cluster alike. None when the last turn did not ask."""
        return None if self._routed is None else self._routed.copy()

    @property
    def num_turns(self) -> int:
        return len(self.samples)

    @property
    def max_seq_len(self) -> int:
        """The longest trajectory a turn can still extend (the engine's context length)."""
        return self._backend.max_seq_len

    # -- turns ---------------------------------------------------------------------------
    def generate(self, params: SamplingParams | None = None, *, abort: threading.Event | None = None) -> Sample:
        """Sample the next turn from `token_ids` exactly; returns it and appends it.

        `params.n` must be 1. The turn's tokens run under whatever version the
        engine serves at each step (see `Sample.versions`). `abort`: an event
        another thread may set before this turn has started, to end it as
        soon as it does (it returns with reason "abort"); once it has started,
        `abort()` ends it. A caller that cannot tell which (a control thread
        racing this call) sets the event, then calls `abort()`.
        """
        params = _turn_params(params)
        with self._hold("generate"):
            return self._record(self._start_turn(params, abort).result())

    async def generate_async(
        self, params: SamplingParams | None = None, *, abort: threading.Event | None = None
    ) -> Sample:
        """`generate` for asyncio code: awaits the turn without a thread, so
        many sessions' turns batch together while the event loop goes on."""
        params = _turn_params(params)
        with self._hold("generate_async"):
            return self._record(await asyncio.wrap_future(self._start_turn(params, abort)))

    def _start_turn(self, params: SamplingParams, abort: threading.Event | None) -> Future:
        """The turn's future. Until the backend holds the turn, `abort()` has
        nothing to end, so one that comes meanwhile is replayed once it does."""
        with self._state:
            self._starting, self._abort_asked = True, False
        try:
            future = self._backend.turn(self._ids, params)
        finally:
            with self._state:
                self._starting = False
                asked = self._abort_asked or (abort is not None and abort.is_set())
        if asked:
            self._backend.abort()
        return future

    def _record(self, sample: Sample) -> Sample:
        prompt = self._backend.prompt_routing
        routed = sample.routed_experts
        self._routed = None if prompt is None or routed is None else np.concatenate([prompt, routed])
        self._ids += sample.token_ids
        self._mask += [1] * len(sample.token_ids)
        self._logprobs += sample.logprobs
        self._versions += sample.versions
        self.samples.append(sample)
        self._after_turn = True
        return sample

    def append(self, observation) -> list[int]:
        """Add what the environment answered; returns the token ids added.

        `observation` is token ids (a list, or a 1-D integer array or tensor:
        taken as they are), a string (encoded without special tokens), or chat
        messages (a list of dicts: rendered as the checkpoint's chat template
        renders them after the conversation so far, with the generation prompt
        of the next turn; only right after a sampled turn).
        """
        ids = self.observation_ids(observation)
        with self._hold("append"):
            limit = self._backend.max_seq_len
            if len(self._ids) + len(ids) >= limit:
                raise ValueError(
                    f"observation of {len(ids)} tokens would make the session {len(self._ids) + len(ids)} tokens "
                    f"long; max_seq_len is {limit} and a turn needs room for at least one token"
                )
            self._ids += ids
            self._mask += [0] * len(ids)
            self._logprobs += [0.0] * len(ids)
            self._versions += [-1] * len(ids)
            self._after_turn = self._after_turn and not ids
            return ids

    def abort(self) -> None:
        """End the turn under way now: it returns with `finish_reason="abort"` and
        the tokens sampled so far, which join the trajectory. Safe from any
        thread or task; a no-op between turns. The next turn recomputes the
        session's KV (an aborted turn's pages are not kept)."""
        with self._state:
            self._abort_asked = self._abort_asked or self._starting  # a turn being started ends once it is
        self._backend.abort()

    def close(self) -> None:
        """Release the KV the session keeps between turns. Idempotent, and never
        waits for a turn under way (that turn gives its pages back when it
        ends). The trajectory stays readable; later turns raise."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        self._backend.release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------
    def _hold(self, what: str) -> _Held:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"session.{what}() while another call on the same session runs; one at a time")
        with self._state:
            closed = self._closed
        if closed:
            self._lock.release()
            raise ValueError(f"session.{what}() on a closed session")
        return _Held(self._lock)

    def observation_ids(self, observation) -> list[int]:
        """The token ids `append(observation)` would add, without adding them."""
        backend = self._backend
        if isinstance(observation, str):
            if backend.codec is None:
                raise ValueError("a text observation needs a tokenizer; the checkpoint has no tokenizer.json")
            return backend.codec.encode(observation, add_special_tokens=False)
        if is_chat(observation):
            if not self._after_turn:
                raise ValueError(
                    "chat messages are appended right after a sampled turn (the template closes that turn); "
                    "put earlier messages in the session's prompt"
                )
            chat = backend.codec.chat if backend.codec is not None else None
            if chat is None:
                raise ValueError(
                    "chat-message observations need the checkpoint's chat template "
                    "(chat_template.jinja, or chat_template in tokenizer_config.json)"
                )
            return chat.followup_ids(observation, last_token_id=self._ids[-1], **self._chat_context)
        if isinstance(observation, (list, tuple)) or array_shape(observation) is not None:
            ids = as_token_ids("observation", observation)
            vocab = backend.vocab_size
            for t in ids:
                if not 0 <= t < vocab:
                    raise ValueError(f"observation has token id {t}, outside the vocabulary [0, {vocab})")
            return ids
        raise TypeError(
            f"observation must be token ids, a string or a list of chat messages, got {type(observation).__name__}"
        )


def _turn_params(params: SamplingParams | None) -> SamplingParams:
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise ValueError(f"a session turn samples one continuation: n must be 1, got {params.n}")
    if params.prompt_logprobs is not None:  # the history is adopted from the turn before, never recomputed
        raise ValueError("prompt_logprobs is not supported on a session turn: score the session's token_ids instead")
    return params


class _Held:
    """Releases a lock taken without blocking when the `with` block ends."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        self._lock.release()
