"""Who verifies a pushed bucket: the bookkeeping behind one verifier per node."""

from __future__ import annotations

from rollout.actor_slots import ActorGone, ActorSlot
from rollout.pushes import received_per_actor


def test_buckets_of_a_dead_verifier_are_verified_by_its_node_mates():
    a, b, c = ActorSlot(0, None, node="n1"), ActorSlot(1, None, node="n1"), ActorSlot(2, None, node="n2")
    # Bucket 0: a verifies on n1; bucket 1: b verifies on n1; c verifies both on n2.
    roles = [(0, True), (0, False), (0, True), (1, False), (1, True), (1, True)]
    gone = ActorGone("actor 1 died")
    results = [(a, 10), (b, 10), (c, 10), (a, 20), (b, gone), (c, 20)]
    assert received_per_actor([a, b, c], results, roles) == [(a, (1,)), (b, gone), (c, ())]


def test_a_rejection_is_the_actors_first_failure_and_orphans_nothing():
    a, b = ActorSlot(0, None, node="n1"), ActorSlot(1, None, node="n1")
    roles = [(0, True), (0, False), (1, False), (1, True)]
    bad, late = ValueError("NaN"), TimeoutError("slow")
    results = [(a, bad), (b, 10), (a, late), (b, 20)]
    assert received_per_actor([a, b], results, roles) == [(a, bad), (b, ())]
