"""Process-level helpers of a rollout actor: memory accounting, malloc
arenas, thread priority and page mapping. Plain Python, no Ray."""

from __future__ import annotations

import os
import threading

import numpy as np


def resident_bytes(kind: str = "VmRSS") -> int:
    """This process's resident memory from /proc/self/status (0 where unavailable).

    `kind`: "VmRSS" (all), "RssAnon" (private memory: what a leak grows),
    "RssFile" or "RssShmem" (mapped files and shared memory, such as Ray's
    object store pages the process has read).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(kind + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cap_malloc_arenas(arenas: int = 2) -> bool:
    """Limit glibc to `arenas` malloc arenas in this process.

    An actor serves calls on many threads, and glibc gives threads their own
    arenas that keep freed memory, so an actor's memory keeps growing; with
    few arenas it levels off. A no-op (False) off glibc.
    """
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").mallopt(-8, arenas) == 1  # M_ARENA_MAX
    except (OSError, AttributeError):
        return False


def lower_thread_priority(niceness: int = 10) -> None:
    """Make the calling thread yield the CPU to the process's other threads
    (Linux: a thread id's own nice value); a no-op where unsupported."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
    except (AttributeError, OSError):
        pass


def touch_pages(bucket: np.ndarray, page: int = 4096) -> None:
    """Read one byte per memory page of `bucket`, so the page-table work of
    a fresh object-store mapping happens here rather than in the first
    decode step after a commit, where it would lengthen the generation pause."""
    if bucket.nbytes:
        int(bucket[::page].max())
