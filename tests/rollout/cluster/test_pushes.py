"""Who verifies a pushed bucket: the bookkeeping behind shared verification on a node."""

from __future__ import annotations

from rollout.cluster.actor_slots import ActorGone, ActorSlot
from rollout.cluster.pushes import received_per_actor


def test_shares_of_a_dead_actor_are_verified_by_its_node_mates():
    a, b, c = ActorSlot(0, None, node="n1"), ActorSlot(1, None, node="n1"), ActorSlot(2, None, node="n2")
    # Per bucket, a and b verify one half each on n1 (the trainer's node: no checksums);
    # c verifies all of it on n2.
    roles = [(0, 0, 2, False), (0, 1, 2, False), (0, 0, 1, True), (1, 1, 2, False), (1, 0, 2, False), (1, 0, 1, True)]
    gone = ActorGone("actor 1 died")
    results = [(a, 10), (b, gone), (c, 10), (a, 20), (b, gone), (c, 20)]
    assert received_per_actor([a, b, c], results, roles) == [
        (a, ((0, 1, 2, False), (1, 0, 2, False))),
        (b, gone),
        (c, ()),
    ]


def test_a_rejection_is_the_actors_first_failure_and_orphans_nothing():
    a, b = ActorSlot(0, None, node="n1"), ActorSlot(1, None, node="n1")
    roles = [(0, 0, 2, True), (0, 1, 2, True), (1, 1, 2, True), (1, 0, 2, True)]
    bad, late = ValueError("NaN"), TimeoutError("slow")
    results = [(a, bad), (b, 10), (a, late), (b, 20)]
    assert received_per_actor([a, b], results, roles) == [(a, bad), (b, ())]
