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
from collections.abc import Callable
from pathlib import Path

import torch

from ..checks import check_int, check_positive
from ..engine.engine import ClosedError
from ..engine.version_guard import PolicyVersionGuard
from ..model.config import ModelConfig
from ..tokenizer import TextCodec
from .actor import RolloutWorker
from .actor_slots import ActorGone, ActorSlot, Published, unwrap
from .dispatch import GenerationDispatch
from .pushes import WeightPushes
from .ray_runtime import bundle_nodes, connect, control, create_actor, plan_placement, ray_module, reserve
from .wire import DEFAULT_BUCKET_BYTES, BucketPacker


class RolloutCluster(GenerationDispatch, WeightPushes):
    """`num_actors` rollout actors, each owning one `Engine` (see docs/design.md).

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
        self._versions = PolicyVersionGuard(0)  # cluster-wide version counter; pushes are serialised
        self._published: Published | None = None
        self._push_lock = threading.Lock()  # one push at a time; a background push releases it on its thread
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
        nodes = bundle_nodes(self._pg)
        self._slots = [ActorSlot(i, self._spawn(i, None), node=nodes[i]) for i in range(num_actors)]
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
                out.append((slot, unwrap(e)))
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
                slot.node = bundle_nodes(self._pg)[slot.index]  # a lost node's bundle moves elsewhere
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
        check_int(name, value, low)
    check_positive("timeout_s", timeout_s)
    check_positive("stall_timeout_s", stall_timeout_s)
