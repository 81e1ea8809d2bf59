"""`ClusterVersion`: the cluster-wide policy version, the version of the
last push every live actor committed."""

from __future__ import annotations

import threading

from ..checks import next_version


class ClusterVersion:
    """A monotonic policy version counter. Pushes run one at a time, so
    checking the next version and committing it need no lock between them;
    the lock only keeps `commit` itself from going backwards."""

    def __init__(self, version: int = 0) -> None:
        self._version = version
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        """The last committed version."""
        return self._version

    def check_next(self, requested: int | None) -> int:
        """The version a push would commit as: `requested`, or current + 1.

        Raises `TypeError`/`ValueError` unless `requested` is None or an int
        greater than the current version.
        """
        return next_version(self._version, requested)

    def commit(self, version: int) -> None:
        """Make `version` current; raises like `check_next` if it is not newer."""
        with self._lock:
            self._version = self.check_next(version)
