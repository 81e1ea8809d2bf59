"""`RolloutWorker`: one engine behind a transport. It is plain Python and
never imports Ray, so everything it does is testable in-process; the cluster
makes it a Ray actor (`ray_runtime.create_actor`), which adds transport
only. Each method is a thin call into the engine or the wire format."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..checks import is_int
from ..engine.engine import Engine
from ..engine.requests import PromptLimits
from ..engine.score_requests import ScoreCall, score_iter
from ..engine.weight_delta import all_finite
from ..engine.weight_lora import has_adapters
from ..engine.weight_update import StagedUpdate
from ..model.weight_slots import WeightSlot
from ..outputs import RolloutOutput, Sample
from ..sampling_params import SamplingParams
from .actor_sessions import EngineSessions
from .call_aborts import CallAborts
from .host import cap_malloc_arenas, lower_thread_priority, resident_bytes, touch_pages
from .wire import Manifest, TensorEntry, check_bucket_entries
from .wire_receive import VerifyShare, assemble, unpack, unpack_entries, verification_shares, verify_entries

FAULTABLE = ("prepare_push", "generate_stream", "session_turn", "stream_tokens")  # methods `inject_fault` can make fail


def check_bucket(bucket: np.ndarray, entries: tuple[TensorEntry, ...], checksums: bool = True) -> None:
    """Checksums (unless told the bytes never left the trainer's node), then
    NaN/inf; raises `ValueError` naming the first bad tensor."""
    if checksums:
        verify_entries(bucket, entries)
    for name, tensor in unpack_entries(bucket, entries).items():
        if tensor.is_floating_point() and not all_finite(tensor):
            raise ValueError(f"state_dict[{name!r}] holds NaN or inf values")


def _checked_share(share) -> tuple[int, int]:
    if (
        not isinstance(share, tuple)
        or len(share) != 2
        or not all(is_int(v) for v in share)
        or not 0 <= share[0] < share[1]
    ):
        raise ValueError(f"share must be (part, parts) with 0 <= part < parts, got {share!r}")
    return share


class RolloutWorker:
    """Owns one `Engine`. With `manifest`, `version` and `buckets` (each
    bucket as its segments), it loads those published weights before
    serving (a replacement actor): every push since the checkpoint, composed
    (`published.compose`). It verifies every bucket in full (checksums and
    NaN/inf), commits them as `version`, and checks that each named tensor
    of its live weights equals the manifest's bytes; any failure raises
    here, so a replacement that could not load them never serves."""

    def __init__(
        self,
        model_path: str | Path,
        engine_kwargs: dict,
        num_threads: int | None = None,
        manifest: Manifest | None = None,
        version: int | None = None,
        *buckets: list[np.ndarray],
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        cap_malloc_arenas()
        self.engine = Engine(model_path, **engine_kwargs)
        self._sessions = EngineSessions(self.engine)
        self._aborts = CallAborts()  # generate_stream calls and token streams, by the driver's id
        self._incoming: dict[str, dict[int, tuple[tuple[TensorEntry, ...], np.ndarray]]] = {}
        self._prepared: dict[str, tuple[StagedUpdate, tuple[np.ndarray, ...]]] = {}
        self._lock = threading.Lock()
        self._faults: dict[str, str] = {}
        self._buckets_copied = 0  # buckets whose segments arrived apart and were copied together
        self._finished: deque[str] = deque(maxlen=64)  # push ids prepared or aborted: late buckets are dropped
        self._aborted: deque[str] = deque(maxlen=64)  # push ids aborted: a prepare still running drops its staging
        # Verifying a push yields the CPU to generation: on a busy host its
        # scans would otherwise stretch the decode steps they overlap.
        self._background = ThreadPoolExecutor(1, "rollout-verify", initializer=lower_thread_priority)
        if manifest is not None:
            for index, segments in enumerate(buckets):
                self.stage_bucket("published", index, manifest.bucket_entries(index), segments)
            self.prepare_push("published", manifest)
            self.commit_push("published", version, "keep")
            self._check_holds(manifest, buckets)

    def describe(self) -> dict:
        """What the driver needs to validate prompts (limits, eos ids,
        tokenizer) and to compose pushes for replacements (`weight_aliases`)."""
        codec = self.engine.codec
        return {
            "limits": PromptLimits.of(self.engine.config, self.engine.model_config),
            "eos_token_ids": codec.eos_token_ids if codec else self.engine.model_config.eos_token_ids,
            "tokenizer_json": codec.to_json() if codec else None,
            "chat": codec.chat_parts() if codec else None,
            "pid": os.getpid(),
            "version": self.engine.policy_version,
            "dtype": str(self.engine.config.dtype).removeprefix("torch."),
            "weight_aliases": weight_aliases(self.engine.model.weight_slots()),
        }

    def _check_holds(self, manifest: Manifest, buckets: tuple) -> None:
        """Raise unless every tensor `manifest` names is, in the live weights,
        the value of its bytes (cast to the engine's dtype as a commit does)."""
        slots = self.engine.model.weight_slots()
        tensors = unpack([assemble(b)[0] for b in buckets], manifest)
        if has_adapters(tensors):  # adapted tensors hold their base merged with the adapter
            tensors = self.engine._updater.lora.expand(tensors, lambda name: slots[name].view()).values()
        for name, tensor in tensors.items():
            live = slots[name].view()
            if not torch.equal(live, tensor.to(live.device, live.dtype)):
                raise RuntimeError(f"after loading the published weights, {name!r} differs from the manifest's bytes")

    def generate_stream(
        self, indices: list[int], prompts: list[list[int]], params: SamplingParams, call_id: str = ""
    ) -> Iterator[RolloutOutput]:
        """Each prompt's output as it finishes, `index` set to the caller's prompt
        index; `abort_generation(call_id)` ends the unfinished ones at once,
        even when it came before this call started (then every sample is
        yielded with reason "abort" and no tokens, and nothing is computed)."""
        self._raise_injected("generate_stream")
        if isinstance(params, ScoreCall):  # a cluster's `score`: the same dispatch, scored outputs
            starts = [params.starts[i] for i in indices]
            generation = score_iter(self.engine, prompts, params.top_logprobs, params.params, starts)
        else:
            generation = self.engine.generate_iter(prompts, params)  # its requests join at the first `next`
        self._aborts.register(call_id, generation.abort)
        try:
            for i, out in generation:
                out.index = indices[i]
                yield out
        finally:
            self._aborts.finish(call_id)

    def abort_generation(self, call_id: str) -> None:
        """End the unfinished samples of the `generate_stream` call `call_id` now
        (they are still yielded, with reason "abort"); an id not seen yet is
        aborted when its call starts."""
        self._aborts.abort(call_id)

    def session_turn(
        self, session_id: str, token_ids: list[int], params: SamplingParams, turn_id: str
    ) -> tuple[Sample, np.ndarray | None]:
        """One turn of the driver's session `session_id` from its whole
        trajectory `token_ids`, reusing the KV of its last turn here when
        there is one (`actor_sessions.EngineSessions`): its sample and the
        prompt's routed experts when asked; `session_abort(turn_id)` ends it,
        even before it started."""
        self._raise_injected("session_turn")
        return self._sessions.turn(session_id, token_ids, params, turn_id)

    def stream_tokens(self, stream_id: str, prompt: list[int], params: SamplingParams) -> Iterator:
        """One prompt's samples token by token (`Engine.stream`): `SampleDelta`s
        as they are sampled, then the finished `RolloutOutput`. A stream
        cancelled before this call started yields nothing."""
        self._raise_injected("stream_tokens")
        stream = None
        try:
            if self._aborts.take_early(stream_id):
                return  # cancelled before it came: nothing is computed
            stream = self.engine.stream(prompt, params)  # its request joins the engine's next step
            if self._aborts.register(stream_id, stream.cancel):
                return  # cancelled in between: nobody reads it
            for item in stream:  # noqa: UP028 (not `yield from`: Ray's generator protocol sends into it)
                yield item
        finally:
            self._aborts.finish(stream_id)
            if stream is not None:
                stream.cancel()  # a no-op once finished; a driver that stopped reading frees the KV

    def cancel_stream(self, stream_id: str) -> None:
        """Abort the stream `stream_id` (its KV is freed); an id not seen yet is
        cancelled when its call starts."""
        self._aborts.abort(stream_id)

    def session_abort(self, turn_id: str) -> None:
        """End the session turn `turn_id` here, now or, if it has not started, when it starts."""
        self._sessions.abort(turn_id)

    def session_close(self, session_id: str) -> None:
        """Close the engine session kept for `session_id`, if any."""
        self._sessions.close(session_id)

    def stage_bucket(
        self,
        push_id: str,
        index: int,
        entries: tuple[TensorEntry, ...],
        segments: list[np.ndarray],
        share: tuple[int, int] = (0, 1),
        checksums: bool = True,
    ) -> int:
        """Receive one bucket of a push as the segments the object store laid
        side by side, and verify share `part` of `parts` of it (checksums,
        NaN/inf) while later buckets are still on their way. Actors that
        share an object store read the same bytes, so the cluster gives each
        of them one share of every bucket; `checksums=False` where that store
        is the trainer's own (the bytes crossed no network). Returns the
        bucket's size."""
        part, parts = _checked_share(share)
        with self._lock:
            if push_id in self._finished:
                return 0  # a late bucket of a push that was aborted meanwhile: not worth verifying
        bucket, copied = assemble(segments)
        check_bucket_entries(entries, bucket.nbytes)  # once, before any share of it is read
        self._verify_share(bucket, entries, part, parts, checksums)
        with self._lock:
            if push_id in self._finished:
                return bucket.nbytes  # a late bucket of a push that was aborted meanwhile
            # Pushes run one at a time: an older one is over, even one whose
            # driver was interrupted before its abort reached this actor.
            for stale in [k for k in self._incoming if k != push_id]:
                del self._incoming[stale]
            stale_prepared = [self._prepared.pop(k) for k in list(self._prepared) if k != push_id]
            self._incoming.setdefault(push_id, {})[index] = (tuple(entries), bucket)
            self._buckets_copied += copied
        for staged, _ in stale_prepared:
            self.engine.discard_weights(staged)
        return bucket.nbytes

    def _verify_share(self, bucket: np.ndarray, entries, part: int, parts: int, checksums: bool) -> None:
        """Verify share `part` of `parts` of `bucket` on the low-priority thread."""
        share = verification_shares(entries, parts)[part]
        self._background.submit(self._receive, bucket, share, checksums).result()

    def _receive(self, bucket: np.ndarray, entries: tuple[TensorEntry, ...], checksums: bool) -> None:
        check_bucket(bucket, entries, checksums)
        if self.engine.config.device.type == "cpu":
            touch_pages(bucket)  # the engine will adopt these bytes: map them now, not in its next step

    def prepare_push(self, push_id: str, manifest: Manifest, verify: tuple[VerifyShare, ...] = ()) -> int:
        """Phase one: check the received buckets against the manifest, verify
        the `VerifyShare`s in `verify` (shares whose verifier died), validate
        and stage; returns the bytes the commit will install."""
        with self._lock:
            incoming = self._incoming.pop(push_id, {})
            self._finished.append(push_id)
        self._raise_injected("prepare_push")
        buckets = []
        for index, size in enumerate(manifest.bucket_nbytes):
            entries, bucket = incoming.get(index, ((), None))
            if bucket is None or bucket.nbytes != size:
                raise ValueError(f"weight push bucket {index} did not arrive intact")
            if entries != manifest.bucket_entries(index):
                raise ValueError(f"weight push bucket {index} does not match the manifest")
            for share in (VerifyShare(*v) for v in verify if v[0] == index):
                part, parts = _checked_share((share.part, share.parts))
                self._verify_share(bucket, entries, part, parts, share.checksums)
            buckets.append(bucket)
        staged = self.engine.prepare_weights(unpack(buckets, manifest), adopt=True, verified_finite=True)
        with self._lock:
            aborted = push_id in self._aborted  # while it was being prepared: the driver gave up on it
            if not aborted:
                self._prepared[push_id] = (staged, tuple(buckets))  # the buckets stay alive until commit
        if aborted:
            self.engine.discard_weights(staged)
            raise ValueError(f"weight push {push_id} was aborted while it was being prepared")
        return staged.nbytes

    def commit_push(self, push_id: str, version: int, inflight: str) -> int:
        """Phase two: install a prepared push as `version`."""
        with self._lock:
            staged, _ = self._prepared.pop(push_id)
        return self.engine.commit_weights(staged, version, inflight)

    def sleep(self, level: int) -> None:
        """`Engine.sleep` (see `rollout.engine.sleep`)."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None) -> None:
        """`Engine.wake_up`."""
        self.engine.wake_up(tags)

    def abort_push(self, push_id: str) -> None:
        """Drop a push: its received buckets, its staged update, and any of its buckets still to come."""
        with self._lock:
            self._finished.append(push_id)
            self._aborted.append(push_id)
            self._incoming.pop(push_id, None)
            entry = self._prepared.pop(push_id, None)
        if entry is not None:
            self.engine.discard_weights(entry[0])

    def health(self) -> dict:
        """Version, scheduler and KV usage, computed and recompute counters, sessions, aborts waiting for
        their call, copied buckets, pushes staged and not committed, and resident memory of this actor."""
        stats = self.engine.stats()
        return {
            "pid": os.getpid(),
            "version": self.engine.policy_version,
            "running": len(self.engine.scheduler.running),
            "waiting": len(self.engine.scheduler.waiting),
            "kv_pages_used": stats["kv_pages_used"],
            "kv_pages_total": stats["kv_pages_total"],
            "computed_tokens": stats["computed_tokens"],
            "recomputed_tokens": stats["recomputed_tokens"],
            "discarded_tokens": stats["discarded_tokens"],
            "sessions": self._sessions.num_kept,  # kept between turns
            "session_turns": self._sessions.num_running,
            "early_aborts": self._aborts.num_early + self._sessions.num_early_aborts,  # for calls not started yet
            "buckets_copied": self._buckets_copied,
            "staged_pushes": self.staged_pushes(),
            "rss_bytes": resident_bytes(),
            "rss_private_bytes": resident_bytes("RssAnon"),
            "rss_shared_bytes": resident_bytes("RssFile") + resident_bytes("RssShmem"),
        }

    def staged_pushes(self) -> int:
        """Pushes this actor received in part or prepared, neither committed nor aborted yet."""
        with self._lock:
            return len(self._incoming.keys() | self._prepared.keys())

    def progress(self) -> dict:
        """The watchdog's ping, answered on a thread of its own without waiting
        on the engine: steps the engine completed so far and the sequences it
        holds (running or waiting). Holding sequences while `steps` stands
        still is a stall; no answer at all is a hang."""
        scheduler = self.engine.scheduler
        return {"steps": self.engine.num_steps, "holding": len(scheduler.running) + len(scheduler.waiting)}

    def policy_version(self) -> int:
        """The version of the weights this actor serves."""
        return self.engine.policy_version

    def step_log(self, since: float | None = None) -> list:
        """The engine's recent `StepInfo`s (see `Engine.step_log`)."""
        return self.engine.step_log(since)

    def inject_fault(self, method: str, message: str) -> None:
        """A test hook, not for production use: the next call of `method`
        ("prepare_push", "generate_stream", "session_turn" or "stream_tokens") raises
        `ValueError(message)`, so tests and failure drills can make one actor
        reject a push or fail a generation without killing it."""
        if method not in FAULTABLE:
            raise ValueError(f"method must be one of {', '.join(map(repr, FAULTABLE))}, got {method!r}")
        with self._lock:
            self._faults[method] = message

    def _raise_injected(self, method: str) -> None:
        with self._lock:
            message = self._faults.pop(method, None)
        if message is not None:
            raise ValueError(message)


def weight_aliases(slots: dict[str, WeightSlot]) -> dict[str, tuple[str, ...]]:
    """Per checkpoint name, the other names held in the very same weight (a
    tied `lm_head.weight` is the embedding): a push that sets one sets all."""
    groups: dict[tuple, list[str]] = {}
    for name, slot in slots.items():
        groups.setdefault((slot.param_name, slot.start, slot.rows), []).append(name)
    return {n: tuple(m for m in g if m != n) for g in groups.values() if len(g) > 1 for n in g}
