"""Weight pushes on the cluster: pack, put and ship buckets; two-phase
prepare and commit on every live actor; publish for replacements (composed
over the pushes before, see `published`)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..engine.delta_encoder import DeltaEncoder
from ..engine.weight_delta import Encoded, PushCost
from ..engine.weight_lora import adapter_cost, has_adapters
from ..engine.weights_api import check_inflight
from .actor_pool import ActorPool
from .actor_slots import ActorCall, ActorGone, ActorSlot, PushGate
from .cluster_version import ClusterVersion
from .handles import PushHandle
from .ray_runtime import local_node, ray_module
from .wire import Manifest, check_state_dict
from .wire_receive import VerifyShare, assemble, unpack_entries
from .wire_send import BucketPacker


@dataclass(slots=True)
class _Shipment:
    """A push whose buckets are in the object store, on their way to the actors."""

    version: int  # the cluster-wide version it will commit as
    push_id: str  # names the push in every actor call
    slots: list[ActorSlot]  # the actors alive when it started
    manifest: Manifest  # every tensor's place and checksum
    refs: tuple  # object refs of the buckets, kept alive until published or dropped
    calls: list[ActorCall]  # every `stage_bucket` call
    roles: list[VerifyShare]  # per call: the share of its bucket that actor verifies
    encoded: Encoded | None  # the encoded push, once the cluster keeps a copy of the live weights
    cost: PushCost  # what it sends (seconds still 0)
    started: float  # perf_counter when the call came
    adapters: bool  # an adapter push (`weight_lora`): published composed, never encoded


class WeightPushes:
    """Weight pushes to the actors of `pool`: `packer` lays the buckets out,
    `versions` is the cluster's version counter, and `gate` runs one push at
    a time and publishes each for replacement actors. `stall_timeout_s`
    bounds a commit that waits for generation to drain."""

    def __init__(
        self,
        pool: ActorPool,
        packer: BucketPacker,
        versions: ClusterVersion,
        gate: PushGate,
        stall_timeout_s: float,
    ) -> None:
        self._pool = pool
        self._packer = packer
        self._versions = versions
        self._gate = gate
        self._stall_timeout_s = stall_timeout_s
        self._encoder: DeltaEncoder | None = None  # from the first delta push on: the live weights' copy
        self.last_push: PushCost | None = None  # the cost of the last push that committed
        self.whole_next = False  # the actors' weights were discarded (sleep level 2): the next push goes whole
        self.engine_dtype = torch.float32  # the actors' dtype, once they described themselves

    @property
    def reference_bytes(self) -> int:
        """Bytes of the copy of the live weights kept for delta pushes (0 before the first)."""
        return 0 if self._encoder is None else self._encoder.nbytes

    def actors_off_node(self) -> bool:
        here = local_node()
        return any(slot.node != here for slot in self._pool.alive())

    def push_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int | None = None,
        inflight: str = "recompute",
        wait: bool = True,
        delta: bool = False,
    ) -> int | PushHandle:
        """Push new policy weights to every live actor; see `RolloutCluster.push_weights`."""
        if not isinstance(delta, bool):
            raise TypeError(f"delta must be a bool, got {type(delta).__name__}")
        started = time.perf_counter()
        self._pool.check_open()
        check_inflight(inflight)
        self._versions.check_next(version)
        check_state_dict(state_dict)  # before waiting for the previous push
        push_id, slots, shipping = uuid.uuid4().hex, [], False
        self._gate.lock.acquire()  # released when the push ends, by whichever thread ends it
        try:
            self._pool.check_open()  # a shutdown may have finished while this call waited for the lock
            slots = self._pool.alive()
            shipping = True
            shipment = self._ship(state_dict, version, push_id, slots, delta, started, wait)
            if not wait:
                return PushHandle(lambda: self._finish(shipment, inflight))
        except BaseException:
            try:
                if shipping and not self._pool.closed:
                    self._abort(push_id, slots)  # buckets already sent must not stay staged on the actors
            finally:
                self._gate.lock.release()
            raise
        return self._finish(shipment, inflight)

    def _abort(self, push_id: str, slots: list[ActorSlot]) -> None:
        self._pool.call_all(slots, "abort_push", (push_id,), "aborting a weight push", kill_hung=True)

    def _ship(self, state_dict, requested, push_id, slots: list[ActorSlot], delta: bool, started: float, wait: bool):
        """Pack and put the buckets one by one, sending each to the actors as
        it lands: actors receive bucket i while bucket i+1 is packed. Once a
        delta push was asked for, every push is encoded against the copy of
        the live weights (`delta_encoder.DeltaEncoder`), whole or as a delta."""
        ray = ray_module()
        version = self._versions.check_next(requested)
        adapters = has_adapters(state_dict)
        if delta and adapters:
            raise ValueError("delta=True cannot encode an adapter push; push adapters with delta=False")
        if delta and self._encoder is None:
            self._encoder = DeltaEncoder()
        encoded = None
        if adapters:
            cost = adapter_cost(state_dict, self.engine_dtype, 0.0)
        elif self._encoder is not None:
            # A push that waits commits before its caller may change the tensors: no clone for the copy.
            # Host tensors sent whole become the copy as the store holds them (`_sent_views`): no copy at all.
            encoded = self._encoder.encode(
                state_dict, self._versions.version, delta and not self.whole_next, wait, borrow=True
            )
            state_dict, cost = encoded.state_dict, encoded.cost
        else:
            full = sum(t.nbytes for t in state_dict.values())
            cost = PushCost(full, full, 0.0, "full", {"full": len(state_dict)})
        here = local_node()
        entries, sizes, refs, calls, roles = [], [], [], [], []
        for packed in self._packer.pack_buckets(state_dict):
            ref = ray.put(list(packed.segments))  # the store's one copy lays the segments side by side
            refs.append(ref)
            entries.extend(packed.entries)
            sizes.append(packed.nbytes)
            for slot, role in verifiers(slots, here, packed.index):
                share = (role.part, role.parts)
                calls.append(
                    self._pool.call(
                        slot, "stage_bucket", push_id, packed.index, packed.entries, ref, share, role.checksums
                    )
                )
                roles.append(role)
        manifest = Manifest(tuple(entries), tuple(sizes))
        return _Shipment(version, push_id, slots, manifest, tuple(refs), calls, roles, encoded, cost, started, adapters)

    @staticmethod
    def _sent_views(shipment: _Shipment) -> dict[str, torch.Tensor]:
        """The tensors an encoded push sent whole from the host, as read-only
        views of its buckets in this node's object store (mapped, not
        copied). On one node the CPU actors adopted the same bytes as their
        weights, so the copy for deltas costs neither a copy nor memory."""
        pending = shipment.encoded.pending
        by_bucket: dict[int, list] = {}
        for entry in shipment.manifest.entries:
            if pending.get(entry.name, ("",))[0] == "borrow":
                by_bucket.setdefault(entry.bucket, []).append(entry)
        views = {}
        for index, entries in by_bucket.items():
            bucket, _ = assemble(ray_module().get(shipment.refs[index]))
            views.update(unpack_entries(bucket, entries))
        return views

    def _snapshot(self) -> tuple[Manifest, tuple]:
        """The copy of the live weights, put in the store as a push's buckets, for a replacement actor."""
        ray = ray_module()
        entries, sizes, refs = [], [], []
        for packed in self._packer.pack_buckets(self._encoder.reference):
            refs.append(ray.put(list(packed.segments)))
            entries.extend(packed.entries)
            sizes.append(packed.nbytes)
        return Manifest(tuple(entries), tuple(sizes)), tuple(refs)

    def _finish(self, shipment: _Shipment, inflight: str) -> int:
        """Phase one on every actor that received the push, then phase two
        where all accepted it; releases the push lock. Until the commit is
        sent, any way out (a rejection, an error, a KeyboardInterrupt) aborts
        the push on every actor, so none keeps it staged. An actor that hangs
        in either phase is killed and counts as gone, as one that died."""
        try:
            try:
                ready = self._prepare(shipment)
            except BaseException:
                if not self._pool.closed:
                    self._abort(shipment.push_id, shipment.slots)
                raise
            previous = self._gate.saved()
            if shipment.adapters:  # a due snapshot holds the adapted tensors' bases: the adapters compose over it
                self._gate.make_due_snapshot()
            if shipment.encoded is None or shipment.cost.encoding == "full":
                self._gate.publish(shipment.manifest, shipment.version, shipment.refs)
            if shipment.encoded is not None:
                self._gate.publish_snapshot(shipment.version, self._snapshot)
            self._commit(ready, shipment, previous, inflight)
            return shipment.version
        finally:
            self._gate.lock.release()

    def _prepare(self, shipment: _Shipment) -> list[ActorSlot]:
        """The actors that received and prepared the push; raises the first
        rejection, or when every actor it started on was lost."""
        version, push_id = shipment.version, shipment.push_id
        staged = self._pool.collect(shipment.calls, f"receiving weight push v{version}", kill_hung=True)
        received = received_per_actor(shipment.slots, staged, shipment.roles)
        prepared = self._pool.collect(
            [
                self._pool.call(s, "prepare_push", push_id, shipment.manifest, todo)
                for s, todo in received
                if not isinstance(todo, BaseException)
            ],
            f"preparing weight push v{version}",
            kill_hung=True,
        )
        results = [(s, r) for s, r in received if isinstance(r, BaseException)] + prepared
        rejected = [(s, r) for s, r in results if isinstance(r, BaseException) and not isinstance(r, ActorGone)]
        if rejected:
            raise _rejection(*rejected[0], version)
        ready = [s for s, r in results if not isinstance(r, BaseException)]
        if shipment.slots and not ready:  # every actor it started on died or hung: nobody vouches for it
            raise _all_lost(results, version, "prepared", self._versions.version)
        return ready

    def _commit(self, ready: list[ActorSlot], shipment: _Shipment, previous, inflight: str) -> None:
        """Phase two on `ready`, then the cluster's version moves to the push's.
        Sent commits cannot be called back: when the wait for them is
        interrupted, it waits for them once more before the interrupt goes
        on, so the cluster's version still says what the actors serve."""
        timeout = self._pool.timeout_s
        if inflight == "drain":  # the commit waits for the generation in flight to finish
            timeout = max(timeout, self._stall_timeout_s)
        version = shipment.version
        calls = [self._pool.call(s, "commit_push", shipment.push_id, version, inflight) for s in ready]
        what = f"committing weight push v{version} ({inflight})"
        try:
            committed = self._pool.collect(calls, what, timeout, kill_hung=True)
        except BaseException:
            self._settle(self._pool.collect(calls, what, timeout, kill_hung=True), shipment, previous)
            raise
        self._settle(committed, shipment, previous)

    def _settle(self, committed: list, shipment: _Shipment, previous) -> None:
        """After phase two: an actor that failed its commit is replaced (its
        replacement loads the published push); when every actor was lost, the
        push is unpublished and raises, else the cluster's version moves."""
        version = shipment.version
        for slot, result in committed:
            if isinstance(result, BaseException) and not isinstance(result, ActorGone):
                # Validated already, so this is a fault: replace the actor; the
                # replacement loads the published version, keeping all actors equal.
                self._pool.kill(slot, f"failed to commit weight push v{version}: {result}")
        if shipment.slots and all(isinstance(r, BaseException) for _, r in committed):
            self._gate.restore(previous)  # their replacements, waiting for the lock, load the version before
            raise _all_lost(committed, version, "committed", self._versions.version)
        if shipment.adapters:
            self._encoder = None  # the adapted tensors moved under its copy: a later delta push starts whole
        elif shipment.encoded is not None:
            # Before the lock is released: replacements snapshot it.
            self._encoder.commit(shipment.encoded, self._sent_views(shipment))
        self._versions.commit(version)
        self.whole_next = False
        self.last_push = dataclasses.replace(shipment.cost, seconds=time.perf_counter() - shipment.started)


def verifiers(slots: list[ActorSlot], here: str | None, bucket: int) -> list[tuple[ActorSlot, VerifyShare]]:
    """Who verifies which share of bucket `bucket`. Actors on one node share
    its object store, so each verifies one share; shares rotate from bucket
    to bucket, as the first share is the heaviest. Checksums guard bytes that
    crossed the network: actors on this process's node (`here`) read the very
    memory the put wrote, so they only scan for NaN/inf."""
    by_node: dict[str, list[ActorSlot]] = {}
    for slot in slots:
        by_node.setdefault(slot.node, []).append(slot)
    out = []
    for node, members in by_node.items():
        parts = len(members)
        for position, slot in enumerate(members):
            out.append((slot, VerifyShare(bucket, (position + bucket) % parts, parts, node != here)))
    return out


def received_per_actor(slots: list[ActorSlot], results: list, roles: list[VerifyShare]) -> list:
    """Per actor, from the `(slot, result)` of every bucket call and its role
    (the share of the bucket it verifies): the actor's first failure, or the
    shares it must verify itself because their verifier on its node died."""
    failed: dict[int, BaseException] = {}
    orphans: dict[str, set[VerifyShare]] = {s.node: set() for s in slots}
    for (slot, result), role in zip(results, roles, strict=True):
        if isinstance(result, BaseException):
            failed.setdefault(slot.index, result)
            if isinstance(result, ActorGone):
                orphans[slot.node].add(VerifyShare(*role))
    return [(s, failed.get(s.index) or tuple(sorted(orphans[s.node]))) for s in slots]


def _all_lost(results: list, version: int, phase: str, current: int) -> RuntimeError:
    """The error of a push that every actor it started on was lost to (dead, or hung and killed)."""
    why = "; ".join(str(r).splitlines()[0] for _, r in results if isinstance(r, BaseException))
    return RuntimeError(
        f"no actor {phase} weight push v{version}: every actor it went to died or hung ({why}); "
        f"the cluster stays at version {current} and its replacements load that"
    )


def _rejection(slot: ActorSlot, error: BaseException, version: int) -> BaseException:
    message = f"{slot.label} rejected weight push v{version}; no actor committed it: {error}"
    if isinstance(error, (ValueError, TypeError)):
        return type(error)(message)
    return RuntimeError(message)
