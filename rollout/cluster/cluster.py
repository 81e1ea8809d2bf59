"""`RolloutCluster`: the driver side of a Ray cluster of rollout actors.

It is a thin composition of parts with one owner each: the `ActorPool`
(the actors: spawning, calls, deaths, respawns, health), the
`GenerationDispatch` (prompt groups to actors, outputs back, exactly once),
the `ClusterSessions` (multi-turn sessions pinned to actors) and the
`WeightPushes` (two-phase pushes, published for replacements). Ray is
imported when a cluster is made, never before.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from ..checks import check_int, check_positive
from ..engine.requests import PromptLimits, prompt_token_ids
from ..engine.session import Session
from ..engine.sleep import check_sleep_level, check_wake_tags
from ..engine.streams import TokenStream
from ..engine.weight_delta import PushCost
from ..episodes import Episode, run_episodes, run_episodes_async
from ..model.config import ModelConfig
from ..outputs import RolloutOutput, ScoredSequence
from ..sampling_params import SamplingParams
from ..tokenizer import TextCodec
from .actor_pool import ActorPool
from .actor_slots import ActorSlot, PushGate
from .cluster_version import ClusterVersion
from .dispatch import GenerationDispatch
from .handles import GenerationHandle, PushHandle
from .pushes import WeightPushes
from .ray_runtime import connect, ray_module
from .sessions import ClusterSessions, ClusterTurns
from .streams import start_stream
from .watchdog import HangBounds, Watchdog
from .wire_send import DEFAULT_BUCKET_BYTES, BucketPacker


class RolloutCluster:
    """`num_actors` rollout actors, each owning one `Engine`.

    Bad arguments raise `ValueError`/`TypeError` before any actor starts.
    `timeout_s` bounds every control call (start, pushes, health); an actor
    that does not answer one of a push in time is hung: it is killed and
    replaced. `stall_timeout_s` bounds a session turn, the gap between a
    token stream's tokens and a `drain` commit.

    A watchdog on the driver pings every live actor every `ping_interval_s`;
    one that answers no ping within `liveness_timeout_s` is hung, one that
    holds work and completes no engine step for `progress_timeout_s` is
    stalled. Either is killed and replaced as if it had died: its prompts
    are generated elsewhere, its sessions' turns run again elsewhere, a push
    commits without it and its replacement loads that push (see
    `rollout.cluster.watchdog` and docs/cluster.md). A generation sets no
    other bound on an actor's silence.

    `generate_concurrency`: generate calls one actor runs at once
    (their sequences share batches; more queue). Every such call runs on its
    own thread with its own scratch memory, so many threads make an actor's
    memory grow while serving no more calls than a few. Extra keywords go to
    each `Engine`. `session_concurrency`: session turns one actor runs at once
    (`session`, `run_episodes`); more queue.
    """

    def __init__(
        self,
        model_path: str | Path,
        num_actors: int = 2,
        num_gpus_per_actor: int | None = None,
        address: str | None = None,
        *,
        num_cpus_per_actor: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
        stall_timeout_s: float = 600.0,
        ping_interval_s: float = 5.0,
        liveness_timeout_s: float = 30.0,
        progress_timeout_s: float = 60.0,
        generate_concurrency: int = 4,
        session_concurrency: int = 32,
        ray_init_kwargs: dict | None = None,
        **engine_kwargs,
    ) -> None:
        num_actors, num_gpus_per_actor, num_cpus_per_actor, generate_concurrency, session_concurrency = _checked_counts(
            num_actors, num_gpus_per_actor, num_cpus_per_actor, generate_concurrency, session_concurrency
        )
        timeout_s = check_positive("timeout_s", timeout_s)
        stall_timeout_s = check_positive("stall_timeout_s", stall_timeout_s)
        bounds = HangBounds(ping_interval_s, liveness_timeout_s, progress_timeout_s)
        if Path(model_path).exists():
            ModelConfig.from_dir(model_path)  # a bad checkpoint fails here, before any actor starts
        packer = BucketPacker(bucket_bytes)
        self.model_path = str(model_path)
        self.timeout_s, self.stall_timeout_s = timeout_s, stall_timeout_s
        self._versions = ClusterVersion(0)
        gate = PushGate()
        threads = (generate_concurrency, session_concurrency)
        self._pool = ActorPool(self.model_path, dict(engine_kwargs), threads, timeout_s, gate)
        self._watchdog = Watchdog(self._pool, bounds)
        # A turn's only output is the turn itself: it may go as long without one as a generate stream.
        self._sessions = ClusterSessions(self._pool, stall_timeout_s, num_actors * session_concurrency)
        self._pushes = WeightPushes(self._pool, packer, self._versions, gate, stall_timeout_s)
        self._owns_ray = connect(address, ray_init_kwargs, self.model_path, engine_kwargs.get("dtype", "float32"))
        try:
            desc = self._pool.start(num_actors, num_cpus_per_actor, num_gpus_per_actor)
        except BaseException:
            self.shutdown()
            raise
        self._watchdog.start()
        self._limits = desc["limits"]
        self.engine_dtype: torch.dtype = getattr(torch, desc["dtype"])
        self._pushes.engine_dtype = self.engine_dtype
        tok = desc["tokenizer_json"]
        self._codec = TextCodec.from_json(tok, desc["eos_token_ids"], desc["chat"]) if tok else None
        self._dispatch = GenerationDispatch(self._pool, self._limits, self._codec)

    # -- generation ------------------------------------------------------------------------
    def generate(
        self, prompts, params: SamplingParams | None = None, timeout: float | None = None
    ) -> list[RolloutOutput]:
        """Outputs in prompt order, as `Engine.generate` returns them. When the
        wait ends early (`timeout`, an error, a KeyboardInterrupt), the
        unfinished samples are aborted on their actors: nobody else can read them."""
        handle = self.submit(prompts, params)
        try:
            return handle.result(timeout)
        except BaseException:
            handle.abort()
            raise

    def submit(self, prompts, params: SamplingParams | None = None) -> GenerationHandle:
        """Start generating and return at once; the handle gives `result()` and
        `as_completed()`. Prompts are validated here, before any is dispatched."""
        return self._dispatch.submit(prompts, params)

    def score(
        self,
        sequences,
        top_logprobs: int = 0,
        params: SamplingParams | None = None,
        start=1,
        timeout: float | None = None,
    ) -> list[ScoredSequence]:
        """`Engine.score` over the actors: sequences balanced and, when an actor
        dies, scored again elsewhere, as `generate` does with prompts; results
        in order. Arguments are checked here first; an early end aborts the rest."""
        handle = self._dispatch.submit_score(sequences, top_logprobs, params, start)
        try:
            return handle.result(timeout)
        except BaseException:
            handle.abort()
            raise

    def session(self, prompt, tools: list[dict] | None = None) -> Session:
        """A multi-turn episode starting from `prompt` (token ids, a string, or
        chat messages, `tools` passed to the template), its turns pinned to the
        least loaded live actor, where its KV stays between turns. When that
        actor dies, the session goes on on another live actor (or its
        replacement) from its token ids: a turn in flight runs again there. The
        prompt is checked here, before any actor is chosen; see `Session` and
        `rollout.cluster.sessions`."""
        self._pool.check_open()
        prompt_token_ids(prompt, self._limits, self._codec, tools)  # bad input raises before an actor is pinned
        return Session(ClusterTurns(self._sessions, self._limits, self._codec), prompt, self._limits, tools)

    def stream(self, prompt, params: SamplingParams | None = None) -> TokenStream:
        """One prompt's samples token by token from the least loaded live actor,
        as `Engine.stream` gives them: `SampleDelta`s, then the `RolloutOutput`
        (see `rollout.cluster.streams`). The prompt is checked here first."""
        return start_stream(self._pool, self._limits, self._codec, prompt, params, self.stall_timeout_s)

    @property
    def limits(self) -> PromptLimits:
        """What a prompt must fit (vocabulary, context, batch size, KV pages), as the actors described it."""
        return self._limits

    @property
    def tokenizer(self) -> TextCodec | None:
        """The checkpoint's tokenizer (and chat template) as the actors sent it; None without one."""
        return self._codec

    def run_episodes(self, envs, params: SamplingParams | None = None, max_turns: int = 8) -> list[Episode]:
        """One multi-turn episode per environment, all at once, each a `session`
        of this cluster (see `rollout.episodes`)."""
        return run_episodes(self.session, envs, params, max_turns)

    async def run_episodes_async(self, envs, params: SamplingParams | None = None, max_turns: int = 8):
        """`run_episodes` for asyncio code."""
        return await run_episodes_async(self.session, envs, params, max_turns)

    # -- weights ---------------------------------------------------------------------------
    def push_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int | None = None,
        inflight: str = "recompute",
        wait: bool = True,
        delta: bool = False,
    ) -> int | PushHandle:
        """Push new policy weights to every actor; returns the new cluster-wide version.

        Two-phase: every live actor fetches, verifies and stages the push;
        if any rejects it, none commits it and the actor's error is raised
        here. Pushes run one at a time: a call first waits for the previous
        push to finish. `wait=False` returns a `PushHandle` as soon as the
        weights are in the object store: from then on the caller may change
        its tensors (train the next step) while the actors verify and commit.
        `delta=True` sends only the elements whose bits changed since the
        last committed push (the cluster keeps a copy of the live weights from
        then on; see docs/weight_sync.md). `last_push` tells what it cost.
        """
        return self._pushes.push_weights(state_dict, version, inflight, wait, delta)

    @property
    def last_push(self) -> PushCost | None:
        """Bytes sent, bytes of a full push, seconds and encoding of the last committed push."""
        return self._pushes.last_push

    def actors_off_node(self) -> bool:
        """Whether some live actor runs on another node than this process (a push's bytes cross a network)."""
        return self._pushes.actors_off_node()

    @property
    def weights_discarded(self) -> bool:
        """Whether a level-2 `sleep` freed the actors' weights and no push has set them since."""
        return self._pushes.whole_next

    @property
    def reference_bytes(self) -> int:
        """Bytes of the copy of the live weights the driver keeps for delta pushes (0 before the first)."""
        return self._pushes.reference_bytes

    def sleep(self, level: int = 1) -> None:
        """Put every live actor's engine to sleep (`Engine.sleep`): level 1
        frees the KV pools, level 2 the weights too, and the next push then
        goes whole. Generation calls fail while the actors sleep; a
        replacement actor starts awake. Raises the first actor's error (actors
        that slept stay asleep: `wake_up` undoes it)."""
        check_sleep_level(level)
        self._pool.check_open()
        if level == 2:
            self._pushes.whole_next = True
        _raise_first(self._pool.call_all(self._pool.alive(), "sleep", (level,), f"sleeping (level {level})"))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """`Engine.wake_up(tags)` on every live actor; raises the first actor's error."""
        tags = None if tags is None else list(check_wake_tags(tags))
        self._pool.check_open()
        _raise_first(self._pool.call_all(self._pool.alive(), "wake_up", (tags,), "waking up"))

    def policy_version(self) -> int:
        """The version of the last push every live actor committed. While a
        push is committing, actors that have committed it already serve its
        version, so tokens may be one version newer than this."""
        return self._versions.version

    # -- actors ----------------------------------------------------------------------------
    def health(self) -> list[dict]:
        """Per actor: index, state, pid, version, dispatched load, its engine's
        counters, and its position's faults: `replacements`, `replaced_because`
        (the last reason), the `hangs` and `stalls` the watchdog found, and
        `failed_starts` (replacements killed because they failed to start or
        hung while loading) with `failed_start_because`."""
        return self._pool.health()

    def step_logs(self, since: float | None = None) -> list[list]:
        """Each live actor's recent `StepInfo`s (ended after `since`), for pause and throughput metrics."""
        return self._pool.step_logs(since)

    def wait_until_healthy(self, timeout: float | None = None) -> None:
        """Block until every actor is alive (after respawns), or raise `TimeoutError`."""
        self._pool.wait_until_healthy(timeout)

    @property
    def num_actors(self) -> int:
        """Actor positions of the cluster (a respawning actor keeps its position)."""
        return len(self._pool.slots)

    @property
    def closed(self) -> bool:
        """Whether `shutdown` was called."""
        return self._pool.closed

    @property
    def _slots(self) -> list[ActorSlot]:
        # Tests and tools reach single actors through their slots.
        return self._pool.slots

    @property
    def _engine_kwargs(self) -> dict:
        # The keywords every actor's engine got, "device" included; tools build a local twin from them.
        return self._pool.engine_kwargs

    def shutdown(self) -> None:
        """Stop the watchdog and every actor, release the placement group, and stop Ray if this cluster started it."""
        self._watchdog.stop()
        self._sessions.shutdown()
        if self._pool.shutdown() and self._owns_ray:
            ray_module().shutdown()


def _checked_counts(num_actors, gpus, cpus, generate_concurrency, session_concurrency) -> list:
    """The counts as plain Python ints (numpy scalars accepted), or the error naming the first bad one."""
    return [
        None if value is None and name != "num_actors" else check_int(name, value, low)
        for name, value, low in (
            ("num_actors", num_actors, 1),
            ("num_gpus_per_actor", gpus, 0),
            ("num_cpus_per_actor", cpus, 1),
            ("generate_concurrency", generate_concurrency, 1),
            ("session_concurrency", session_concurrency, 1),
        )
    ]


def _raise_first(results: list) -> None:
    for slot, result in results:
        if isinstance(result, BaseException):
            raise RuntimeError(f"{slot.label}: {result}") from result
