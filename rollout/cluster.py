"""`RolloutCluster`: the driver side of a Ray cluster of rollout actors.

It dispatches prompt groups to actors (a group never splits: its samples
share KV pages), balances by outstanding work, collects outputs as they
finish, re-dispatches the groups of an actor that dies, pushes weights to
every actor in two phases, and respawns dead actors with the latest
published weights. Ray is imported when a cluster is made, never before.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .actor import RolloutWorker
from .config import ModelConfig
from .engine import INFLIGHT_MODES, ClosedError
from .handles import GenerationHandle, PushHandle
from .outputs import RolloutOutput
from .prompts import validate_prompts
from .ray_runtime import GENERATE, connect, control, create_actor, plan_placement, ray_module, reserve
from .sampling_params import SamplingParams
from .tokenizer import TextCodec
from .wire import DEFAULT_BUCKET_BYTES, BucketPacker, Manifest


@dataclass(slots=True)
class ActorSlot:
    """One actor position of the cluster; its handle changes when it is respawned."""

    index: int
    handle: Any
    generation: int = 0  # bumps on every respawn, so stale failure reports are ignored
    state: str = "starting"  # starting | alive | restarting | dead
    load: int = 0  # outstanding work dispatched to it (samples x max_tokens)
    pid: int | None = None
    error: str | None = None  # why it is dead

    @property
    def label(self) -> str:
        return f"actor {self.index} (pid {self.pid})"


@dataclass(frozen=True, slots=True)
class Published:
    """The latest committed push: what a replacement actor loads before it serves."""

    manifest: Manifest
    version: int
    refs: tuple  # Ray object refs of the buckets, kept alive here


class ActorGone(RuntimeError):
    """An actor died while answering; it is being replaced."""


class RolloutCluster:
    """`num_actors` rollout actors, each owning one `Engine` (see DESIGN section 2).

    Bad arguments raise `ValueError`/`TypeError` before any actor starts.
    `timeout_s` bounds every control call (start, pushes, health);
    `stall_timeout_s` bounds how long an actor may produce no output while
    generating. `generate_concurrency`: generate calls one actor runs at once
    (their sequences share batches; more queue). Measured in a soak, 16
    threads made actor memory grow without levelling off and served fewer
    calls than 4, which held it flat. Extra keywords go to each `Engine`.
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
        generate_concurrency: int = 4,
        ray_init_kwargs: dict | None = None,
        **engine_kwargs,
    ) -> None:
        _check_args(
            num_actors, num_gpus_per_actor, num_cpus_per_actor, generate_concurrency, timeout_s, stall_timeout_s
        )
        if Path(model_path).exists():
            ModelConfig.from_dir(model_path)  # a bad checkpoint fails here, before any actor starts
        self._packer = BucketPacker(bucket_bytes)
        self.model_path = str(model_path)
        self.timeout_s, self.stall_timeout_s = timeout_s, stall_timeout_s
        self._generate_threads = generate_concurrency
        self._engine_kwargs = dict(engine_kwargs)
        self._version = 0
        self._published: Published | None = None
        self._push_lock = threading.RLock()
        self._cond = threading.Condition()
        self._closed = False
        self._slots: list[ActorSlot] = []
        self._pg = None
        self._owns_ray = connect(address, ray_init_kwargs)
        try:
            self._start(num_actors, num_cpus_per_actor, num_gpus_per_actor)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, num_actors: int, cpus: int | None, gpus: int | None) -> None:
        self._placement = plan_placement(num_actors, cpus, gpus)
        self._pg = reserve(self._placement, self.timeout_s)
        self._engine_kwargs.setdefault("device", "cuda" if self._placement.gpus else "cpu")
        self._slots = [ActorSlot(i, self._spawn(i, None)) for i in range(num_actors)]
        described = self._call_all(self._slots, lambda h: control(h, "describe").remote(), "starting")
        for slot, desc in described:
            if isinstance(desc, BaseException):
                raise RuntimeError(f"{slot.label} failed to start: {desc}") from desc
            slot.pid, slot.state = desc["pid"], "alive"
        desc = described[0][1]
        self._limits = desc["limits"]
        self.engine_dtype: torch.dtype = getattr(torch, desc["dtype"])
        tok = desc["tokenizer_json"]
        self._codec = TextCodec.from_json(tok, desc["eos_token_ids"]) if tok else None

    def _spawn(self, index: int, published: Published | None):
        args: tuple = (self.model_path, self._engine_kwargs, self._placement.cpus)
        if published is not None:
            args += (published.manifest, published.version, *published.refs)
        return create_actor(RolloutWorker, self._pg, index, self._placement, args, self._generate_threads)

    # -- generation ------------------------------------------------------------------------
    def generate(
        self, prompts, params: SamplingParams | None = None, timeout: float | None = None
    ) -> list[RolloutOutput]:
        """Outputs in prompt order, as `Engine.generate` returns them."""
        return self.submit(prompts, params).result(timeout)

    def submit(self, prompts, params: SamplingParams | None = None) -> GenerationHandle:
        """Start generating and return at once; the handle gives `result()` and
        `as_completed()`. Prompts are validated here, before any is dispatched."""
        self._check_open()
        params = SamplingParams() if params is None else params
        token_lists, texts = validate_prompts(prompts, params, self._limits, self._codec)
        handle = GenerationHandle(texts)
        if token_lists:
            self._dispatch(handle, token_lists, params, list(range(len(token_lists))))
        return handle

    def _dispatch(self, handle: GenerationHandle, prompts, params: SamplingParams, indices: list[int]) -> None:
        cost = params.n * params.max_tokens
        with self._cond:
            live = self._wait_for_live()
            shares: dict[int, list[int]] = {s.index: [] for s in live}
            loads = {s.index: s.load for s in live}
            for i in sorted(indices, key=lambda i: -len(prompts[i])):
                target = min(live, key=lambda s: loads[s.index])
                shares[target.index].append(i)
                loads[target.index] += cost
            for slot in live:
                slot.load += cost * len(shares[slot.index])
            work = [(slot, slot.generation, slot.handle, sorted(shares[slot.index])) for slot in live]
        for slot, generation, actor, share in work:
            if share:
                handle._assign(share, slot.label)
                stream = actor.generate_stream.options(concurrency_group=GENERATE).remote(
                    share, [prompts[i] for i in share], params
                )
                threading.Thread(
                    target=self._consume,
                    args=(handle, prompts, params, slot, generation, share, stream),
                    name=f"rollout-stream-{slot.index}",
                    daemon=True,
                ).start()

    def _consume(self, handle, prompts, params, slot: ActorSlot, generation: int, share, stream) -> None:
        ray = ray_module()
        remaining, cost = set(share), params.n * params.max_tokens
        try:
            while remaining:
                ready, _ = ray.wait([stream], timeout=self.stall_timeout_s)
                if not ready:
                    raise TimeoutError(
                        f"{slot.label} produced no output for {self.stall_timeout_s} s while generating "
                        f"prompts {sorted(remaining)[:8]}"
                    )
                out = ray.get(next(stream))
                remaining.discard(out.index)
                handle._deliver(out)
                self._unload(slot, generation, cost)
        except ray.exceptions.RayActorError:
            self._unload(slot, generation, cost * len(remaining))
            self._actor_died(slot, generation, "died while generating")
            lost = handle._missing(sorted(remaining))
            if lost:
                try:
                    self._dispatch(handle, prompts, params, lost)
                except BaseException as e:
                    handle._fail(e)
        except BaseException as e:
            self._unload(slot, generation, cost * len(remaining))
            handle._fail(_unwrap(e))

    def _unload(self, slot: ActorSlot, generation: int, amount: int) -> None:
        with self._cond:
            if slot.generation == generation:
                slot.load = max(0, slot.load - amount)

    def _wait_for_live(self) -> list[ActorSlot]:
        """Alive actors (waits for a replacement when none is); call holding `_cond`."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._check_open()
            live = [s for s in self._slots if s.state == "alive"]
            if live:
                return live
            if all(s.state == "dead" for s in self._slots):
                raise RuntimeError(
                    "no rollout actor is alive: " + "; ".join(f"{s.label}: {s.error}" for s in self._slots)
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no rollout actor came back within {self.timeout_s} s")
            self._cond.wait(left)

    # -- weights ---------------------------------------------------------------------------
    def push_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int | None = None,
        inflight: str = "recompute",
        wait: bool = True,
    ) -> int | PushHandle:
        """Push new policy weights to every actor; returns the new cluster-wide version.

        Two-phase: every live actor fetches, verifies and stages the push;
        if any rejects it, none commits it and the actor's error is raised
        here. `wait=False` returns a `PushHandle` at once.
        """
        self._check_open()
        if inflight not in INFLIGHT_MODES:
            raise ValueError(f"inflight must be one of {INFLIGHT_MODES}, got {inflight!r}")
        self._next_version(version)
        if not wait:
            return PushHandle(lambda: self._push(state_dict, version, inflight))
        return self._push(state_dict, version, inflight)

    def _push(self, state_dict, requested: int | None, inflight: str) -> int:
        with self._push_lock:
            version = self._next_version(requested)
            push_id = uuid.uuid4().hex
            with self._cond:
                slots = [s for s in self._slots if s.state == "alive"]
            manifest, refs, received = self._ship(state_dict, push_id, slots, version)
            prepared = self._call_all(
                [s for s, r in received if not isinstance(r, BaseException)],
                lambda h: control(h, "prepare_push").remote(push_id, manifest),
                f"preparing weight push v{version}",
            )
            results = [(s, r) for s, r in received if isinstance(r, BaseException)] + prepared
            ready = [s for s, r in results if not isinstance(r, BaseException)]
            rejected = [(s, r) for s, r in results if isinstance(r, BaseException) and not isinstance(r, ActorGone)]
            if rejected:
                self._call_all(
                    slots, lambda h: control(h, "abort_push").remote(push_id), f"aborting weight push v{version}"
                )
                raise _rejection(*rejected[0], version)
            self._published = Published(manifest, version, refs)
            self._commit(ready, push_id, version, inflight)
            self._version = version
            return version

    def _ship(self, state_dict, push_id: str, slots: list[ActorSlot], version: int):
        """Pack, put and send the buckets one by one: actors verify bucket i
        while bucket i+1 is packed. Returns the manifest, the bucket refs and
        per actor the first failure or its received byte count."""
        ray = ray_module()
        entries, sizes, refs, calls = [], [], [], []
        for index, bucket, bucket_entries in self._packer.pack_buckets(state_dict):
            ref = ray.put(bucket)
            refs.append(ref)
            entries.extend(bucket_entries)
            sizes.append(bucket.nbytes)
            for slot in slots:
                calls.append(
                    (
                        slot,
                        slot.generation,
                        control(slot.handle, "stage_bucket").remote(push_id, index, bucket_entries, ref),
                    )
                )
        per_slot: dict[int, object] = {}
        for slot, result in self._collect(calls, f"receiving weight push v{version}"):
            if not isinstance(per_slot.get(slot.index), BaseException):
                per_slot[slot.index] = (
                    result if isinstance(result, BaseException) else per_slot.get(slot.index, 0) + result
                )
        received = [(slot, per_slot[slot.index]) for slot in slots]
        return Manifest(tuple(entries), tuple(sizes)), tuple(refs), received

    def _commit(self, ready: list[ActorSlot], push_id: str, version: int, inflight: str) -> None:
        committed = self._call_all(
            ready,
            lambda h: control(h, "commit_push").remote(push_id, version, inflight),
            f"committing weight push v{version} ({inflight})",
            timeout=max(self.timeout_s, self.stall_timeout_s) if inflight == "drain" else self.timeout_s,
        )
        for slot, result in committed:
            if isinstance(result, BaseException) and not isinstance(result, ActorGone):
                # Validated already, so this is a fault: replace the actor; the
                # replacement loads the published version, keeping all actors equal.
                self._kill(slot, f"failed to commit weight push v{version}: {result}")

    def _next_version(self, requested: int | None) -> int:
        if requested is None:
            return self._version + 1
        if isinstance(requested, bool) or not isinstance(requested, int):
            raise TypeError(f"version must be an int > {self._version} or None, got {type(requested).__name__}")
        if requested <= self._version:
            raise ValueError(f"version must be > the cluster's policy version {self._version}, got {requested}")
        return requested

    def policy_version(self) -> int:
        """The version of the last push every live actor committed. While a
        push is committing, actors that have committed it already serve its
        version, so tokens may be one version newer than this."""
        return self._version

    # -- actors ----------------------------------------------------------------------------
    def _call_all(self, slots, make_ref: Callable, what: str, timeout: float | None = None) -> list:
        """(slot, result or exception) per slot, all bounded by one deadline."""
        return self._collect([(s, s.generation, make_ref(s.handle)) for s in slots], what, timeout)

    def _collect(self, calls: list, what: str, timeout: float | None = None) -> list:
        """Results of `(slot, generation, ref)` calls; a dead actor's calls come back as `ActorGone`."""
        ray = ray_module()
        deadline = time.monotonic() + (timeout or self.timeout_s)
        out = []
        for slot, generation, ref in calls:
            try:
                out.append((slot, ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))))
            except ray.exceptions.GetTimeoutError:
                out.append(
                    (
                        slot,
                        TimeoutError(f"{slot.label} did not answer within {timeout or self.timeout_s} s while {what}"),
                    )
                )
            except ray.exceptions.RayActorError as e:
                self._actor_died(slot, generation, f"died while {what}")
                out.append((slot, ActorGone(f"{slot.label} died while {what}: {e}")))
            except Exception as e:  # the actor's own error, raised in its process
                out.append((slot, _unwrap(e)))
        return out

    def _actor_died(self, slot: ActorSlot, generation: int, why: str) -> None:
        with self._cond:
            if slot.generation != generation or slot.state not in ("alive", "starting") or self._closed:
                return
            slot.state, slot.load, slot.error = "restarting", 0, why
        threading.Thread(target=self._respawn, args=(slot,), name=f"rollout-respawn-{slot.index}", daemon=True).start()

    def _kill(self, slot: ActorSlot, why: str) -> None:
        ray_module().kill(slot.handle, no_restart=True)
        self._actor_died(slot, slot.generation, why)

    def _respawn(self, slot: ActorSlot) -> None:
        ray = ray_module()
        with self._push_lock:  # the replacement serves only after loading the latest push
            if self._closed:
                return
            try:
                ray.kill(slot.handle, no_restart=True)
            except Exception:  # already gone
                pass
            handle = self._spawn(slot.index, self._published)
            try:
                desc = ray.get(control(handle, "describe").remote(), timeout=self.timeout_s)
            except Exception as e:
                with self._cond:
                    slot.state, slot.error = "dead", f"replacement failed to start: {e}"
                    self._cond.notify_all()
                return
            with self._cond:
                slot.handle, slot.pid, slot.state, slot.load = handle, desc["pid"], "alive", 0
                slot.generation += 1
                self._cond.notify_all()

    def health(self) -> list[dict]:
        """Per actor: index, state, pid, version, dispatched load, and its engine's counters."""
        ray = ray_module()
        with self._cond:
            slots = list(self._slots)
        report = []
        for slot in slots:
            entry = {"index": slot.index, "state": slot.state, "pid": slot.pid, "load": slot.load}
            if slot.state == "alive":
                try:
                    entry.update(ray.get(control(slot.handle, "health").remote(), timeout=min(self.timeout_s, 30.0)))
                except Exception as e:
                    entry["state"], entry["error"] = "unreachable", str(e).splitlines()[0]
            elif slot.error:
                entry["error"] = slot.error
            report.append(entry)
        return report

    def step_logs(self, since: float | None = None) -> list[list]:
        """Each live actor's recent `StepInfo`s (ended after `since`), for pause and throughput metrics."""
        with self._cond:
            slots = [s for s in self._slots if s.state == "alive"]
        results = self._call_all(slots, lambda h: control(h, "step_log").remote(since), "reporting its step log")
        return [r for _, r in results if not isinstance(r, BaseException)]

    def wait_until_healthy(self, timeout: float | None = None) -> None:
        """Block until every actor is alive (after respawns), or raise `TimeoutError`."""
        deadline = time.monotonic() + (timeout or self.timeout_s)
        with self._cond:
            while not all(s.state == "alive" for s in self._slots):
                left = deadline - time.monotonic()
                if left <= 0 or any(s.state == "dead" for s in self._slots):
                    raise TimeoutError(
                        "actors not all alive: " + ", ".join(f"{s.label}={s.state}" for s in self._slots)
                    )
                self._cond.wait(left)

    @property
    def num_actors(self) -> int:
        return len(self._slots)

    @property
    def closed(self) -> bool:
        return self._closed

    def shutdown(self) -> None:
        """Stop every actor, release the placement group, and stop Ray if this cluster started it."""
        ray = ray_module()
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        with self._push_lock:
            for slot in self._slots:
                try:
                    ray.kill(slot.handle, no_restart=True)
                except Exception:  # already gone
                    pass
            if self._pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
            self._published = None
        if self._owns_ray:
            ray.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the rollout cluster is shut down; call rollout.init(...) again")


def _check_args(num_actors, gpus, cpus, generate_concurrency, timeout_s, stall_timeout_s) -> None:
    for name, value, low in (
        ("num_actors", num_actors, 1),
        ("num_gpus_per_actor", gpus, 0),
        ("num_cpus_per_actor", cpus, 1),
        ("generate_concurrency", generate_concurrency, 1),
    ):
        if value is None and name != "num_actors":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int >= {low}, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value}")
    for name, value in (("timeout_s", timeout_s), ("stall_timeout_s", stall_timeout_s)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")


def _unwrap(e: BaseException) -> BaseException:
    """The original exception of an error raised inside an actor."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def _rejection(slot: ActorSlot, error: BaseException, version: int) -> BaseException:
    message = f"{slot.label} rejected weight push v{version}; no actor committed it: {error}"
    if isinstance(error, (ValueError, TypeError)):
        return type(error)(message)
    return RuntimeError(message)
