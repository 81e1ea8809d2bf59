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
    steps_after_request, stop = [], threading.Event()
    requested = threading.Event()

    def stepping_loop():
        while not stop.is_set():
            with guard.step() as version:
                if requested.is_set() and version == 0:
                    steps_after_request.append(1)
                time.sleep(0.002)  # a step's work, GIL released as torch kernels release it

    loop = threading.Thread(target=stepping_loop)
    loop.start()
    with guard.step():
        pass
    requested.set()
    guard.commit(None, lambda v: None)
    stop.set()
    loop.join(10)
    # The step in progress when the commit asked (and at most one that had
    # already passed the check) may finish first; no more.
    assert len(steps_after_request) <= 2
