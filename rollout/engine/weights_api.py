"""The weight-update half of `Engine`'s API: validate and stage a push while
generation goes on, then commit it between two steps under the policy
version guard, applying the push's in-flight mode.

A mixin of `Engine`, kept apart so the engine module stays the glue of one
step. It uses the engine's `_guard`, `_update_lock`, `_updater`,
`scheduler`, `decode_cache`, `_iterators`, `_background` and `_closed`,
and `SleepAPI`'s checks of weights a sleep discarded.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from .weight_delta import is_delta
from .weight_update import StagedUpdate

INFLIGHT_MODES = ("recompute", "keep", "drain", "restart")


def check_inflight(inflight: str) -> None:
    """Raise `ValueError` unless `inflight` is one of INFLIGHT_MODES."""
    if inflight not in INFLIGHT_MODES:
        raise ValueError(f"inflight must be one of {INFLIGHT_MODES}, got {inflight!r}")


class WeightsAPI:
    def update_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int | None = None,
        inflight: str = "recompute",
    ) -> int:
        """Install new policy weights and return the new policy version.

        `state_dict` uses the checkpoint's own names; a subset updates only
        those tensors. A delta push (`rollout.engine.weight_delta`) sets only
        the elements it carries, over the version it names as its base. Everything is validated (names, shapes, dtypes,
        finiteness, version order) and staged before the guard is taken; a
        rejected update leaves weights and version exactly as they were.
        `inflight` says what happens to sequences mid-generation (see
        docs/design.md). May be called from another thread while
        `generate` runs. "drain" is refused (`RuntimeError`) from a thread
        that holds an unfinished `generate_iter` iterator, a step callback
        included: it would wait for requests only that thread advances.
        """
        check_inflight(inflight)
        self._guard.check_next(version)
        with self._update_lock:
            return self.commit_weights(self.prepare_weights(state_dict), version, inflight)

    def prepare_weights(
        self, state_dict: Mapping[str, torch.Tensor], adopt: bool = False, verified_finite: bool = False
    ) -> StagedUpdate:
        """Phase one of an update: validate and stage, changing nothing live.

        Raises `TypeError`/`ValueError` naming the first bad entry. With
        `adopt=True` the caller promises the tensors never change while
        the engine uses them: they are committed straight from the source,
        and a host engine adopts them as its weights (no copy) until a later
        update replaces them. `verified_finite=True`: the caller has checked
        for NaN/inf already.
        """
        self._check_open()
        with self._update_lock:
            restores = self._before_push(state_dict, isinstance(state_dict, Mapping) and is_delta(state_dict))
            base, state_dict, lora, patches = self._updater.expand(state_dict, self._guard.version, adopt)
            merges = lora.merges if lora is not None else {}
            if not state_dict and not patches and not merges and (base is not None or lora is not None):
                # a delta, or adapters, that change nothing: the version moves
                return StagedUpdate([], {}, {}, frozenset(), 0, base=base, restores=restores, lora=lora)
            whole = state_dict or not (patches or merges)  # patches or merges alone have no whole tensor to check
            items = self._updater.validate(state_dict, check_finite=not verified_finite) if whole else []
            own = frozenset(self._updater.slots[name].param_name for name in merges)
            staged = self._updater.stage(items, adopt=adopt, own=own)
            try:  # a refused patch or merge gives back the buffers staging took
                self._updater.stage_patches(staged, patches, check_finite=not verified_finite)
                self._updater.stage_merges(staged, lora)
            except BaseException:
                self._updater.release(staged)
                raise
            staged.base, staged.restores, staged.lora = base, restores, lora
            return staged

    def discard_weights(self, staged: StagedUpdate) -> None:
        """Drop a prepared update that will not be committed."""
        with self._update_lock:
            self._updater.release(staged)

    def commit_weights(self, staged: StagedUpdate, version: int | None = None, inflight: str = "recompute") -> int:
        """Phase two: install `staged` between two steps under the guard; returns the version."""
        self._check_open()
        check_inflight(inflight)
        self._guard.check_next(version)
        if inflight == "drain":
            self._check_drain_would_not_wait_on_itself()
        try:
            return self._commit(staged, version, inflight)
        finally:
            with self._update_lock:
                self._updater.release(staged)

    def _commit(self, staged: StagedUpdate, version: int | None, inflight: str) -> int:

        def apply(_: int) -> None:
            self._check_open()  # a close that came first leaves nothing to install into
            self._check_commit(staged.restores)
            self._pipeline.settle()  # the step in flight ran under the old weights: its tokens say so
            if staged.base is not None and staged.base != self._guard.version:
                raise ValueError(
                    f"delta push is relative to version {staged.base}, but version {self._guard.version} "
                    "was committed since it was prepared"
                )
            self._updater.commit(staged)
            self._after_commit(staged.restores)
            self.scheduler.on_weights_committed(inflight)
            self.decode_cache.invalidate()

        with self._update_lock:
            if inflight != "drain":
                return self._guard.commit(version, apply)
            with self._guard.held():
                self.scheduler.draining = True
                try:
                    self._guard.wait_for(lambda: self._closed or not self.scheduler.has_inflight, None)
                    return self._guard.commit(version, apply)
                finally:
                    self.scheduler.draining = False
                    self._guard.notify()

    def _check_drain_would_not_wait_on_itself(self) -> None:
        if threading.current_thread() is self._background.thread:
            raise RuntimeError(
                "update_weights(inflight='drain') from a step callback of the background driver would wait on "
                "itself: that thread steps the session turns the drain waits for; drain from another thread"
            )
        with self._guard.held():
            self._iterators.check_drain()
