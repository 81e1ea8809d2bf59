"""`ActorPool`: the cluster's rollout actors and their lifecycle. It spawns
them into one placement group, makes calls to them under one deadline,
notices deaths, respawns replacements that load the latest published push,
reports their health and shuts them down."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from ..engine.engine import ClosedError
from ..engine.errors import NoActorInTimeError, NoLiveActorError
from ..sampling_params import SamplingParams
from .actor import RolloutWorker
from .actor_slots import ActorCall, ActorGone, ActorSlot, Published, PushGate, unwrap
from .ray_runtime import (
    ActorStream,
    Placement,
    actor_process,
    bundle_nodes,
    control,
    create_actor,
    open_stream,
    plan_placement,
    ray_module,
    reserve,
    terminate,
)

log = logging.getLogger("rollout.cluster")

# Tries to start a replacement before its position is dead for good; each one
# that fails or hangs while loading is killed, its process included, first.
START_TRIES = 3


class ActorPool:
    """The actors of one cluster, one `ActorSlot` per position.

    `cond` guards every slot's state and load and is notified whenever an
    actor comes back, dies for good, or the pool shuts down. `timeout_s`
    bounds every control call. A dead actor is replaced in the background,
    holding `gate`, so that it loads the latest push before it serves.
    """

    def __init__(
        self,
        model_path: str,
        engine_kwargs: dict,
        threads: tuple[int, int],
        timeout_s: float,
        gate: PushGate,
    ) -> None:
        self.model_path = model_path
        self.engine_kwargs = engine_kwargs
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.slots: list[ActorSlot] = []
        self._threads = threads  # per actor: generate streams, session turns
        self._gate = gate
        self._closed = False
        self._watchdog_error: BaseException | None = None  # the watchdog stopped on it
        self._placement: Placement | None = None
        self._pg = None

    def start(self, num_actors: int, cpus: int | None, gpus: int | None) -> dict:
        """Reserve resources, start every actor and wait until each has
        described itself; returns the first description (limits, dtype,
        tokenizer), or raises `ValueError`/`RuntimeError`."""
        self._placement = plan_placement(num_actors, cpus, gpus)
        self._pg = reserve(self._placement, self.timeout_s)
        self.engine_kwargs.setdefault("device", "cuda" if self._placement.gpus else "cpu")
        nodes = bundle_nodes(self._pg)
        self.slots = [ActorSlot(i, self._spawn(i, None), node=nodes[i]) for i in range(num_actors)]
        described = self.call_all(self.slots, "describe", (), "starting")
        for slot, desc in described:
            if isinstance(desc, BaseException):
                raise RuntimeError(f"{slot.label} failed to start: {desc}") from desc
            slot.pid, slot.state = desc["pid"], "alive"
        # Every actor loaded the same checkpoint: one description says which names share a weight.
        self._gate.aliases = described[0][1]["weight_aliases"]
        return described[0][1]

    def _spawn(self, index: int, published: Published | None):
        args: tuple = (self.model_path, self.engine_kwargs, self._placement.cpus)
        if published is not None:
            args += (published.manifest, published.version, *published.refs)
        return create_actor(RolloutWorker, self._pg, index, self._placement, args, *self._threads)

    # -- calls ------------------------------------------------------------------------------
    def call(self, slot: ActorSlot, method: str, *args) -> ActorCall:
        """Start `method(*args)` on `slot`'s actor, on its control threads."""
        return ActorCall(slot, slot.generation, control(slot.handle, method).remote(*args))

    def call_all(
        self,
        slots: list[ActorSlot],
        method: str,
        args: tuple,
        what: str,
        timeout: float | None = None,
        kill_hung: bool = False,
    ) -> list[tuple[ActorSlot, object]]:
        """`method(*args)` on every slot's actor: (slot, result or exception) per slot, as `collect` gives them."""
        return self.collect([self.call(s, method, *args) for s in slots], what, timeout, kill_hung=kill_hung)

    def collect(self, calls: list[ActorCall], what: str, timeout: float | None = None, kill_hung: bool = False) -> list:
        """`(slot, result or exception)` per call, all bounded by one deadline
        (`timeout`, else `timeout_s`); a dead actor's calls come back as
        `ActorGone` and start its replacement. A call past the deadline comes
        back as `TimeoutError`, or with `kill_hung` its actor is hung: it is
        killed and replaced, and the call comes back as `ActorGone`."""
        ray = ray_module()
        limit = timeout or self.timeout_s
        deadline = time.monotonic() + limit
        out = []
        for slot, generation, ref in calls:
            try:
                out.append((slot, ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))))
            except ray.exceptions.GetTimeoutError:
                silence = f"did not answer within {limit} s while {what}"
                if kill_hung:
                    self.kill(slot, f"hung: {silence}", generation, "hung")
                    out.append((slot, ActorGone(f"{slot.label} {silence}; it was killed and is being replaced")))
                else:
                    out.append((slot, TimeoutError(f"{slot.label} {silence}")))
            except ray.exceptions.RayActorError as e:
                self.actor_died(slot, generation, f"died while {what}")
                out.append((slot, ActorGone(f"{slot.label} died while {what}: {e}")))
            except Exception as e:  # the actor's own error, raised in its process
                out.append((slot, unwrap(e)))
        return out

    def open_stream(self, actor, label: str, indices: list[int], prompts: list, params: SamplingParams) -> ActorStream:
        """Start generating `prompts` (numbered `indices`) on `actor`; its outputs stream back."""
        return open_stream(actor, label, indices, prompts, params)

    # -- deaths and replacements ------------------------------------------------------------
    def actor_died(self, slot: ActorSlot, generation: int, why: str) -> None:
        """Mark `slot`'s actor of `generation` dead and start its replacement;
        a report about an actor that was already replaced is ignored."""
        with self.cond:
            if slot.generation != generation or slot.state not in ("alive", "starting") or self._closed:
                return
            slot.state, slot.load, slot.error = "restarting", 0, why
            slot.replacements += 1
            slot.replaced_because = why
        log.warning("%s %s; replacing it", slot.label, why)
        threading.Thread(target=self._respawn, args=(slot,), name=f"rollout-respawn-{slot.index}", daemon=True).start()

    def kill(self, slot: ActorSlot, why: str, generation: int | None = None, fault: str | None = None) -> None:
        """Kill `slot`'s actor of `generation` (default: its current one), a
        faulty one, its process included (`terminate`), and replace it;
        `fault` ("hung" or "stalled") is counted in `health()`. An actor
        replaced already is left alone."""
        with self.cond:
            generation = slot.generation if generation is None else generation
            if slot.generation != generation or slot.state not in ("alive", "starting") or self._closed:
                return
            handle, pid, node = slot.handle, slot.pid, slot.node
            if fault == "hung":
                slot.hangs += 1
            elif fault == "stalled":
                slot.stalls += 1
        # Marked first, so that `why` is what `health()` reports, not the error of a call the kill ends.
        self.actor_died(slot, generation, why)
        terminate(handle, pid, node)

    def serving(self, slot: ActorSlot, generation: int) -> bool:
        """Whether the actor of `generation` still serves in `slot` (not dead, hung or replaced)."""
        with self.cond:
            return slot.generation == generation and slot.state == "alive"

    def watchdog_failed(self, error: BaseException) -> None:
        """The watchdog stopped on `error`: every later public call raises it (`check_open`)."""
        with self.cond:
            self._watchdog_error = error
            self.cond.notify_all()

    def _respawn(self, slot: ActorSlot) -> None:
        """Replace `slot`'s actor with one that loads `gate.latest`, every push
        since the checkpoint composed, and checks it holds them before it
        answers (`RolloutWorker`); it serves once it reports their version.
        A replacement that fails to start or does not describe itself within
        `timeout_s` is killed and another started, `START_TRIES` in all;
        then the position is dead."""
        ray = ray_module()
        with self._gate.lock:  # the replacement serves only after loading the latest push
            if self._closed:
                return
            with contextlib.suppress(Exception):  # already gone
                ray.kill(slot.handle, no_restart=True)
            published = self._gate.latest
            for attempt in range(1, START_TRIES + 1):
                try:
                    handle, desc = self._start(slot.index, published)
                except Exception as e:
                    self._failed_start(slot, f"replacement failed to start (try {attempt} of {START_TRIES}): {e}")
                    if self._closed:
                        return
                    continue
                with self.cond:
                    slot.handle, slot.pid, slot.state, slot.load = handle, desc["pid"], "alive", 0
                    slot.node = bundle_nodes(self._pg)[slot.index]  # a lost node's bundle moves elsewhere
                    slot.generation += 1
                    self.cond.notify_all()
                return
            with self.cond:
                slot.state = "dead"
                self.cond.notify_all()
            log.warning("%s is dead: its replacement failed to start %d times", slot.label, START_TRIES)

    def _start(self, index: int, published: Published | None) -> tuple:
        """`(handle, description)` of a new actor in position `index` that
        loaded `published` and described itself within `timeout_s`. One that
        fails or stays silent is ended for good, its process found in Ray's
        actor table (it has not told its pid yet) and killed, so it cannot
        linger stopped in the position's bundle; then the error is raised."""
        ray = ray_module()
        handle = None
        try:
            handle = self._spawn(index, published)
            desc = ray.get(control(handle, "describe").remote(), timeout=self.timeout_s)
            _check_loaded(desc, published)
            return handle, desc
        except ray.exceptions.GetTimeoutError:
            terminate(handle, *actor_process(handle))
            silent = f"it did not load and describe itself within {self.timeout_s} s; it was killed"
            raise TimeoutError(silent) from None
        except Exception:
            if handle is not None:
                terminate(handle, *actor_process(handle))
            raise

    def _failed_start(self, slot: ActorSlot, why: str) -> None:
        with self.cond:
            slot.error = slot.failed_start_because = why
            slot.failed_starts += 1
        log.warning("%s: %s", slot.label, why)

    # -- state ------------------------------------------------------------------------------
    def alive(self) -> list[ActorSlot]:
        """The slots whose actor is alive now."""
        with self.cond:
            return [s for s in self.slots if s.state == "alive"]

    def wait_for_live(self, stop: Callable[[], bool] | None = None) -> list[ActorSlot]:
        """Alive actors, waiting up to `timeout_s` for a replacement when none
        is; call holding `cond`. Raises when every actor is dead for good.
        Returns [] once `stop()` is true (checked whenever `cond` is
        notified: whoever makes it true calls `wake()`)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self.check_open()
            if stop is not None and stop():
                return []
            live = [s for s in self.slots if s.state == "alive"]
            if live:
                return live
            if all(s.state == "dead" for s in self.slots):
                raise NoLiveActorError(
                    "no rollout actor is alive: " + "; ".join(f"{s.label}: {s.error}" for s in self.slots)
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoActorInTimeError(f"no rollout actor came back within {self.timeout_s} s")
            self.cond.wait(left)

    def wake(self) -> None:
        """Wake `wait_for_live`'s waiters to check their `stop` again."""
        with self.cond:
            self.cond.notify_all()

    def wait_until_healthy(self, timeout: float | None = None) -> None:
        """Block until every actor is alive (after respawns), or raise `TimeoutError`."""
        deadline = time.monotonic() + (timeout or self.timeout_s)
        with self.cond:
            while not all(s.state == "alive" for s in self.slots):
                left = deadline - time.monotonic()
                if left <= 0 or any(s.state == "dead" for s in self.slots):
                    raise TimeoutError("actors not all alive: " + ", ".join(f"{s.label}={s.state}" for s in self.slots))
                self.cond.wait(left)

    def health(self) -> list[dict]:
        """Per actor: index, state, pid, dispatched load, what the actor reports
        of itself, and its position's faults: replacements and why the last
        one, hangs and stalls the watchdog found, replacements that failed to
        start and why the last one did. The live actors are asked
        at once, under one deadline of `min(timeout_s, 30)` s; one that does
        not answer is `unreachable`."""
        ray = ray_module()
        with self.cond:
            slots = list(self.slots)
            alive = {s.index: s.handle for s in slots if s.state == "alive"}
        calls = {index: control(handle, "health").remote() for index, handle in alive.items()}
        deadline = time.monotonic() + min(self.timeout_s, 30.0)
        report = []
        for slot in slots:
            entry = {"index": slot.index, "state": slot.state, "pid": slot.pid, "load": slot.load}
            entry.update(replacements=slot.replacements, hangs=slot.hangs, stalls=slot.stalls)
            entry["failed_starts"] = slot.failed_starts
            if slot.replaced_because:
                entry["replaced_because"] = slot.replaced_because
            if slot.failed_start_because:
                entry["failed_start_because"] = slot.failed_start_because
            if slot.index in calls:
                try:
                    entry.update(ray.get(calls[slot.index], timeout=max(0.0, deadline - time.monotonic())))
                except Exception as e:
                    entry["state"], entry["error"] = "unreachable", str(e).splitlines()[0]
            elif slot.error:
                entry["error"] = slot.error
            report.append(entry)
        return report

    def step_logs(self, since: float | None = None) -> list[list]:
        """Each live actor's recent `StepInfo`s (ended after `since`)."""
        results = self.call_all(self.alive(), "step_log", (since,), "reporting its step log")
        return [r for _, r in results if not isinstance(r, BaseException)]

    @property
    def closed(self) -> bool:
        """Whether `shutdown` was called."""
        return self._closed

    def check_open(self) -> None:
        """Raise `ClosedError` once the pool is shut down, or the error the watchdog stopped on."""
        if self._closed:
            raise ClosedError("the rollout cluster is shut down; call rollout.init(...) again")
        if self._watchdog_error is not None:
            raise RuntimeError(f"the rollout watchdog stopped: {self._watchdog_error}") from self._watchdog_error

    def shutdown(self) -> bool:
        """Stop every actor and release the placement group; False if it was shut down already."""
        ray = ray_module()
        with self.cond:
            if self._closed:
                return False
            self._closed = True
            self.cond.notify_all()
        with self._gate.lock:  # waits for a push or respawn in progress
            for slot in self.slots:
                try:
                    ray.kill(slot.handle, no_restart=True)
                except Exception:  # already gone
                    pass
            if self._pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
            self._gate.latest = None
        return True


def _check_loaded(desc: dict, published: Published | None) -> None:
    """Raise unless a replacement reports the version of what it was given to load."""
    expected = 0 if published is None else published.version
    if desc["version"] != expected:
        raise RuntimeError(f"it loaded version {desc['version']}, not the published version {expected}")
