"""The engine sessions an actor keeps for the driver's sessions
(`rollout.cluster.sessions`), so that a session's next turn on this actor
reuses the KV of its last (`rollout.engine.leases`).

The driver holds each trajectory and sends it whole with every turn: it is
the source of truth. The session kept here is only a cache of it: when its
token ids lead the ones sent, the rest is appended and the KV carries on;
otherwise (evicted, replaced, a turn the driver gave up on) a fresh engine
session starts from the driver's ids. Either way the turn samples the same
tokens; only the work differs.

The driver names every turn, and aborts a turn by that name: an abort that
arrives before its turn started ends exactly that turn when it starts (with
no tokens), never a later one (`call_aborts.CallAborts`).
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict

import numpy as np

from ..engine.engine import Engine
from ..engine.session import Session
from ..outputs import Sample, unstarted_sample
from ..sampling_params import SamplingParams
from .call_aborts import CallAborts

# Sessions kept between turns. Each holds its trajectory and a lease, which
# gives its pages back whenever anything else needs them, so the bound is
# generous: it only stops forgotten sessions from piling up without end.
MAX_KEPT_SESSIONS = 4096
CLOSED_IDS_REMEMBERED = 4096  # a turn that ends after its session closed is not kept


class EngineSessions:
    """Engine sessions by the driver's session id, least recently used first."""

    def __init__(self, engine: Engine, limit: int = MAX_KEPT_SESSIONS) -> None:
        self._engine = engine
        self._limit = limit
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, tuple[int, Session]] = OrderedDict()  # id -> (turn ticket, session)
        self._running: Counter[str] = Counter()  # turns in flight per id
        self._aborts = CallAborts()  # turns in flight by the driver's turn id, and turns aborted before they came
        self._closed: OrderedDict[str, None] = OrderedDict()  # ids closed lately, oldest first
        self._tickets = itertools.count()

    @property
    def num_kept(self) -> int:
        """Sessions kept between turns."""
        with self._lock:
            return len(self._kept)

    @property
    def num_running(self) -> int:
        """Session turns in flight."""
        with self._lock:
            return sum(self._running.values())

    @property
    def num_early_aborts(self) -> int:
        """Aborts remembered for turns that have not started here."""
        return self._aborts.num_early

    def turn(
        self, session_id: str, token_ids: list[int], params: SamplingParams, turn_id: str
    ) -> tuple[Sample, np.ndarray | None]:
        """Sample one continuation of `token_ids` for `session_id`; `abort(turn_id)`
        ends it. Returns the sample and, when `params.return_routed_experts`,
        the routed experts of `token_ids` as this turn's KV holds them (None
        otherwise, or when the turn computed nothing). A turn aborted before it
        started returns at once with reason "abort" and no tokens, its session
        kept as it was. The engine's own errors (bad ids, params) propagate unchanged."""
        with self._lock:
            kept = self._kept.pop(session_id, (None, None))[1]  # a turn has its session to itself
            self._running[session_id] += 1
            ticket = next(self._tickets)
        sess, prompt_routing = None, None
        try:
            sess = self._continued(kept, token_ids)
            aborted = threading.Event()  # an abort between registering and the engine holding the turn

            def abort(sess: Session = sess) -> None:
                aborted.set()
                sess.abort()

            if self._aborts.register(turn_id, abort):
                sample = unstarted_sample(params.top_logprobs, self._engine.codec is not None)
            else:
                sample = sess.generate(params, abort=aborted)
                routed = sess.routed_experts  # the trajectory's: the prompt's, then the sample's
                prompt_routing = None if routed is None else routed[: len(token_ids)]
        except BaseException:
            if sess is not None:
                sess.close()
            self._finish(session_id, ticket, None)
            raise
        finally:
            self._aborts.finish(turn_id)
        self._finish(session_id, ticket, sess)
        return sample, prompt_routing

    def abort(self, turn_id: str) -> None:
        """End the turn `turn_id` (it returns with reason "abort"), now or when it starts."""
        self._aborts.abort(turn_id)

    def close(self, session_id: str) -> None:
        """Close `session_id`'s engine session (its KV goes back); idempotent."""
        with self._lock:
            _, sess = self._kept.pop(session_id, (None, None))
            self._closed[session_id] = None
            while len(self._closed) > CLOSED_IDS_REMEMBERED:
                self._closed.popitem(last=False)
        if sess is not None:
            sess.close()

    def _continued(self, kept: Session | None, token_ids: list[int]) -> Session:
        """`kept` carried on to `token_ids` when its ids lead them, else a fresh session."""
        if kept is not None:
            ids = kept.token_ids
            if len(ids) <= len(token_ids) and token_ids[: len(ids)] == ids:
                try:
                    if len(token_ids) > len(ids):
                        kept.append(token_ids[len(ids) :])
                    return kept
                except BaseException:
                    kept.close()
                    raise
            kept.close()
        return self._engine.session(token_ids)

    def _finish(self, session_id: str, ticket: int, sess: Session | None) -> None:
        """End a turn: keep its session (the newest turn's, if two overlapped)
        unless the session was closed meanwhile; evict beyond the bound."""
        dropped = []
        with self._lock:
            self._running[session_id] -= 1
            if not self._running[session_id]:
                del self._running[session_id]
            newer = self._kept.get(session_id)
            if sess is not None and (session_id in self._closed or (newer is not None and newer[0] > ticket)):
                dropped.append(sess)
            elif sess is not None:
                if newer is not None:
                    dropped.append(newer[1])
                self._kept[session_id] = (ticket, sess)
                self._kept.move_to_end(session_id)
                while len(self._kept) > self._limit:
                    dropped.append(self._kept.popitem(last=False)[1][1])
        for s in dropped:
            s.close()
