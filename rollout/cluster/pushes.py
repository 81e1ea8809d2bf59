"""Weight pushes on the cluster: pack, put and ship buckets; two-phase
prepare and commit on every live actor; publish for replacements."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..engine.engine import check_inflight
from .actor_slots import ActorGone, ActorSlot, Published
from .handles import PushHandle
from .ray_runtime import control, local_node, ray_module
from .wire import Manifest, check_state_dict


@dataclass(slots=True)
class _Shipment:
    """A push whose buckets are in the object store, on their way to the actors."""

    version: int  # the cluster-wide version it will commit as
    push_id: str  # names the push in every actor call
    slots: list[ActorSlot]  # the actors alive when it started
    manifest: Manifest  # every tensor's place and checksum
    refs: tuple  # object refs of the buckets, kept alive until published or dropped
    calls: list  # (slot, generation, ref) of every `stage_bucket` call
    roles: list[tuple[int, int, int, bool]]  # per call: (bucket, part, parts, checksums), what that actor verifies


class WeightPushes:
    """The weight half of `RolloutCluster` (a mixin over its actor state)."""

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
        here. Pushes run one at a time: a call first waits for the previous
        push to finish. `wait=False` returns a `PushHandle` as soon as the
        weights are in the object store: from then on the caller may change
        its tensors (train the next step) while the actors verify and commit.
        """
        self._check_open()
        check_inflight(inflight)
        self._versions.check_next(version)
        check_state_dict(state_dict)  # before waiting for the previous push
        push_id, slots, shipping = uuid.uuid4().hex, [], False
        self._push_lock.acquire()  # released when the push ends, by whichever thread ends it
        try:
            self._check_open()  # a shutdown may have finished while this call waited for the lock
            with self._cond:
                slots = [s for s in self._slots if s.state == "alive"]
            shipping = True
            shipment = self._ship(state_dict, version, push_id, slots)
            if not wait:
                return PushHandle(lambda: self._finish(shipment, inflight))
        except BaseException:
            try:
                if shipping and not self._closed:
                    self._abort(push_id, slots)  # buckets already sent must not stay staged on the actors
            finally:
                self._push_lock.release()
            raise
        return self._finish(shipment, inflight)

    def _abort(self, push_id: str, slots: list[ActorSlot]) -> None:
        self._call_all(slots, lambda h: control(h, "abort_push").remote(push_id), "aborting a weight push")

    def _ship(self, state_dict, requested: int | None, push_id: str, slots: list[ActorSlot]) -> _Shipment:
        """Pack and put the buckets one by one, sending each to the actors as
        it lands: actors receive bucket i while bucket i+1 is packed. Actors
        on one node share its object store, so each verifies one share of
        every bucket. Checksums guard bytes that crossed the network: actors
        on this process's node read the very memory the put wrote, so they
        only scan for NaN/inf (that saved 8 ms of 87 on a 485 MiB push)."""
        ray = ray_module()
        version = self._versions.check_next(requested)
        here = local_node()
        by_node: dict[str, list[ActorSlot]] = {}
        for slot in slots:
            by_node.setdefault(slot.node, []).append(slot)
        entries, sizes, refs, calls, roles = [], [], [], [], []
        for packed in self._packer.pack_buckets(state_dict):
            ref = ray.put(list(packed.segments))  # the store's one copy lays the segments side by side
            refs.append(ref)
            entries.extend(packed.entries)
            sizes.append(packed.nbytes)
            for node, members in by_node.items():
                parts, checksums = len(members), node != here
                for position, slot in enumerate(members):
                    part = (position + packed.index) % parts  # rotates, as the first share is the heaviest
                    call = control(slot.handle, "stage_bucket").remote(
                        push_id, packed.index, packed.entries, ref, (part, parts), checksums
                    )
                    calls.append((slot, slot.generation, call))
                    roles.append((packed.index, part, parts, checksums))
        manifest = Manifest(tuple(entries), tuple(sizes))
        return _Shipment(version, push_id, slots, manifest, tuple(refs), calls, roles)

    def _finish(self, shipment: _Shipment, inflight: str) -> int:
        """Phase one on every actor that received the push, then phase two
        where all accepted it; releases the push lock."""
        try:
            version, push_id = shipment.version, shipment.push_id
            received = received_per_actor(
                shipment.slots,
                self._collect(shipment.calls, f"receiving weight push v{version}"),
                shipment.roles,
            )
            prepared = self._collect(
                [
                    (s, s.generation, control(s.handle, "prepare_push").remote(push_id, shipment.manifest, todo))
                    for s, todo in received
                    if not isinstance(todo, BaseException)
                ],
                f"preparing weight push v{version}",
            )
            results = [(s, r) for s, r in received if isinstance(r, BaseException)] + prepared
            ready = [s for s, r in results if not isinstance(r, BaseException)]
            rejected = [(s, r) for s, r in results if isinstance(r, BaseException) and not isinstance(r, ActorGone)]
            if rejected:
                self._abort(push_id, shipment.slots)
                raise _rejection(*rejected[0], version)
            self._published = Published(shipment.manifest, version, shipment.refs)
            self._commit(ready, push_id, version, inflight)
            self._versions.commit(version, lambda _: None)
            return version
        finally:
            self._push_lock.release()

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

    def policy_version(self) -> int:
        """The version of the last push every live actor committed. While a
        push is committing, actors that have committed it already serve its
        version, so tokens may be one version newer than this."""
        return self._versions.version


def received_per_actor(slots: list[ActorSlot], results: list, roles: list[tuple[int, int, int, bool]]) -> list:
    """Per actor, from the `(slot, result)` of every bucket call and its role
    `(bucket, part, parts, checksums)` (the share of the bucket it verifies):
    the actor's first failure, or the shares it must verify itself because
    their verifier on its node died."""
    failed: dict[int, BaseException] = {}
    orphans: dict[str, set[tuple[int, int, int, bool]]] = {s.node: set() for s in slots}
    for (slot, result), role in zip(results, roles, strict=True):
        if isinstance(result, BaseException):
            failed.setdefault(slot.index, result)
            if isinstance(result, ActorGone):
                orphans[slot.node].add(role)
    return [(s, failed.get(s.index) or tuple(sorted(orphans[s.node]))) for s in slots]


def _rejection(slot: ActorSlot, error: BaseException, version: int) -> BaseException:
    message = f"{slot.label} rejected weight push v{version}; no actor committed it: {error}"
    if isinstance(error, (ValueError, TypeError)):
        return type(error)(message)
    return RuntimeError(message)
