"""Who verifies a pushed bucket, and the cluster's version counter: the
bookkeeping of a push, without Ray."""

from __future__ import annotations

import pytest

from rollout.cluster.actor_slots import ActorGone, ActorSlot
from rollout.cluster.cluster_version import ClusterVersion
from rollout.cluster.pushes import received_per_actor, verifiers
from rollout.cluster.wire_receive import VerifyShare as V


def test_actors_on_one_node_split_each_bucket_and_checksum_only_off_the_trainers_node():
    a, b, c = ActorSlot(0, None, node="n1"), ActorSlot(1, None, node="n2"), ActorSlot(2, None, node="n1")
    # n1 is the trainer's node: a and c share its object store, each verifying one half
    # without checksums, the halves rotating per bucket; b alone on n2 checks all of it.
    assert verifiers([a, b, c], "n1", 0) == [(a, V(0, 0, 2, False)), (c, V(0, 1, 2, False)), (b, V(0, 0, 1, True))]
    assert verifiers([a, b, c], "n1", 1) == [(a, V(1, 1, 2, False)), (c, V(1, 0, 2, False)), (b, V(1, 0, 1, True))]
    # Through Ray Client no node is the trainer's: every byte crossed the network.
    assert [role.checksums for _, role in verifiers([a, b], None, 3)] == [True, True]


def test_shares_of_a_dead_actor_are_verified_by_its_node_mates():
    a, b, c = ActorSlot(0, None, node="n1"), ActorSlot(1, None, node="n1"), ActorSlot(2, None, node="n2")
    # Per bucket, a and b verify one half each on n1 (the trainer's node: no checksums);
    # c verifies all of it on n2.
    roles = [V(0, 0, 2, False), V(0, 1, 2, False), V(0, 0, 1, True), V(1, 1, 2, False), V(1, 0, 2, False)]
    roles.append(V(1, 0, 1, True))
    gone = ActorGone("actor 1 died")
    results = [(a, 10), (b, gone), (c, 10), (a, 20), (b, gone), (c, 20)]
    assert received_per_actor([a, b, c], results, roles) == [
        (a, (V(0, 1, 2, False), V(1, 0, 2, False))),
        (b, gone),
        (c, ()),
    ]


def test_a_rejection_is_the_actors_first_failure_and_orphans_nothing():
    a, b = ActorSlot(0, None, node="n1"), ActorSlot(1, None, node="n1")
    roles = [V(0, 0, 2, True), V(0, 1, 2, True), V(1, 1, 2, True), V(1, 0, 2, True)]
    bad, late = ValueError("NaN"), TimeoutError("slow")
    results = [(a, bad), (b, 10), (a, late), (b, 20)]
    assert received_per_actor([a, b], results, roles) == [(a, bad), (b, ())]


def test_the_cluster_version_only_moves_forward():
    versions = ClusterVersion()
    assert versions.version == 0 and versions.check_next(None) == 1 and versions.check_next(7) == 7
    with pytest.raises(TypeError, match=r"version must be an int > 0 or None, got bool"):
        versions.check_next(True)
    with pytest.raises(ValueError, match=r"version must be > the current policy version 0, got 0"):
        versions.check_next(0)
    versions.commit(5)
    assert versions.version == 5 and versions.check_next(None) == 6
    with pytest.raises(ValueError, match="current policy version 5, got 5"):
        versions.commit(5)
    assert versions.version == 5


@pytest.mark.parametrize("requested", [None, 3, 2, 1.5, True])
def test_the_cluster_version_checks_like_an_engines(requested):
    """The cluster refuses a version with the very words an `Engine` uses."""
    from rollout.engine.version_guard import PolicyVersionGuard

    def outcome(counter):
        try:
            return counter.check_next(requested)
        except (TypeError, ValueError) as e:
            return type(e), str(e)

    assert outcome(ClusterVersion(2)) == outcome(PolicyVersionGuard(2))
