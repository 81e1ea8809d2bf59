from __future__ import annotations

import threading
import time

import pytest

from rollout import PolicyVersionGuard


def test_versions_are_monotonic_and_validated():
    guard = PolicyVersionGuard()
    assert guard.version == 0
    assert guard.commit(None, lambda v: None) == 1
    assert guard.commit(5, lambda v: None) == 5
    for bad, error in [(5, ValueError), (2, ValueError), (6.0, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="version"):
            guard.commit(bad, lambda v: None)
    assert guard.version == 5


def test_failed_apply_publishes_nothing():
    guard = PolicyVersionGuard()

    def boom(version):
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError):
        guard.commit(None, boom)
    assert guard.version == 0


def test_a_waiting_commit_goes_before_the_next_step():
    guard = PolicyVersionGuard()
    in_step, release, seen = threading.Event(), threading.Event(), []

    def stepping():
        with guard.step():
            in_step.set()
            assert release.wait(10)
        with guard.step() as version:  # asked at once by the thread that just released the guard
            seen.append(version)

    stepper = threading.Thread(target=stepping)
    stepper.start()
    assert in_step.wait(10)
    committer = threading.Thread(target=lambda: guard.commit(None, lambda v: None))
    committer.start()
    deadline = time.monotonic() + 10
    while guard._pending == 0:  # the commit is waiting for the guard
        assert time.monotonic() < deadline
        time.sleep(0.001)
    release.set()
    stepper.join(10)
    committer.join(10)
    assert seen == [1]  # the commit went between the two steps
