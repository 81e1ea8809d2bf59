"""Sleep and wake: an engine that shares its devices with a trainer gives
its memory back while the trainer steps.

- `sleep(level=1)` frees the KV pool (and the decode graphs, which hold its
  pointers); the weights stay. Every cached prefix and every session's
  lease goes with the pool: a session's next turn prefills its history.
- `sleep(level=2)` frees the weights too (and their derived copies: packed
  GEMM weights, spare staging buffers). They are gone, not moved: the next
  push must set every weight whole (a delta has nothing to apply to).
- `wake_up(tags=None)` brings back what `tags` names: "weights" (storage
  for the weights, to be filled by that push when level 2 discarded them),
  "kv_cache" (a fresh, empty pool); None both. Waking the weights, pushing,
  then waking the KV keeps the push's staging and a new pool from adding up.

Memory goes back to the system, not to a cache: on the CPU the KV pool is
an anonymous mapping, unmapped when freed, and glibc is asked to return its
free heap pages (`malloc_trim`: weights below its mmap threshold live on the
heap); on CUDA the caching allocator's free blocks are returned to the
driver (`torch.cuda.empty_cache`).

While the KV is asleep, calls that would generate raise `EngineAsleepError`
(a `RuntimeError`; a server answers 503) at once, and so they do while
discarded weights wait for their push. Weight pushes are accepted asleep;
sleeping never changes the version. A sleep refuses while requests are in
flight.

A mixin of `Engine`; it uses the engine's `_guard`, `_update_lock`,
`_updater`, `scheduler`, `stepper`, `decode_cache`, `kv_pool`, `model`
and `config`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import torch

from workspace.kv_pool import zero_pages

from .errors import EngineAsleepError

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


class SleepAPI:
    _kv_shape: tuple[int, ...] | None = None  # the pool's shape while it is freed
    _routing_shape: tuple[int, ...] | None = None  # the pool's routing pages' shape while they are freed
    _weight_shapes: dict[str, tuple[torch.Size, torch.dtype]] | None = None  # weights freed: what to allocate
    _weights_discarded: bool = False  # the weights' values are gone until a push sets every one

    @property
    def asleep(self) -> tuple[str, ...]:
        """What is released now: () awake; "kv_cache" and/or "weights"."""
        released = {"weights": self._weights_discarded, "kv_cache": self._kv_shape is not None}
        return tuple(tag for tag in WAKE_TAGS if released[tag])

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (level 1), and the weights too (level 2).

        Raises `ValueError` for another level and `RuntimeError` while
        sequences are in flight (wait for them or abort them); nothing is
        freed then. Sleeping again at a deeper level frees the rest.
        """
        check_sleep_level(level)
        self._check_open()
        with self._update_lock, self._guard.ahead_of_steps():
            self._check_open()
            self._pipeline.settle()  # its extra tokens still write to the pool
            if self.scheduler.requests:
                raise RuntimeError(
                    f"sleep() with {len(self.scheduler.requests)} requests in flight; wait for them or abort them first"
                )
            self.scheduler.kv.leases.on_weights_committed("recompute")  # every lease released
            self.scheduler.kv.allocator.clear_cache()
            if self._kv_shape is None:
                self._kv_shape = tuple(self.kv_pool.k.shape)
                self.kv_pool.k = self.kv_pool.v = torch.empty(0, dtype=self.kv_pool.k.dtype, device=self.config.device)
                routing = self.kv_pool.routing  # mixture-of-experts models: the pages' routed experts
                if routing is not None:
                    self._routing_shape = tuple(routing.shape)
                    self.kv_pool.routing = torch.empty(0, dtype=routing.dtype, device=self.config.device)
                self.stepper.release_graphs()
                self.decode_cache.invalidate()
            if level == 2 and self._weight_shapes is None:
                self._free_weights()
            _return_to_driver(self.config.device)

    def wake_up(self, tags: list[str] | tuple[str, ...] | None = None) -> None:
        """Bring back what `tags` names ("weights", "kv_cache"; None: both).

        Raises `ValueError` for another tag (nothing changes then). Waking
        what is awake does nothing. Weights that level 2 discarded get their
        storage back but stay refused for generation until a push sets them.
        """
        wanted = check_wake_tags(tags)
        self._check_open()
        with self._update_lock, self._guard.ahead_of_steps():
            self._check_open()
            if "weights" in wanted:
                self._allocate_weights()
            if "kv_cache" in wanted and self._kv_shape is not None:
                dtype = self.kv_pool.k.dtype
                self.kv_pool.k = zero_pages(self._kv_shape, dtype, self.config.device)
                self.kv_pool.v = zero_pages(self._kv_shape, dtype, self.config.device)
                if self._routing_shape is not None:
                    routing = self.kv_pool.routing
                    self.kv_pool.routing = zero_pages(self._routing_shape, routing.dtype, self.config.device)
                    self._routing_shape = None
                self._kv_shape = None

    def _check_awake(self) -> None:
        """Raise `EngineAsleepError` unless this engine can generate."""
        if self._kv_shape is not None:
            raise EngineAsleepError("engine is asleep (its KV cache is freed): call wake_up() first")
        if self._weights_discarded:
            raise EngineAsleepError(
                "engine's weights were discarded by sleep(level=2): push every weight before generating"
            )

    def _free_weights(self) -> None:
        params = dict(self.model.named_parameters())
        self._weight_shapes = {name: (p.shape, p.dtype) for name, p in params.items()}
        self._weights_discarded = True
        self._updater.forget_buffers()
        self.model.weights_changed(None)
        if self.model.packed is not None:
            self.model.packed.release()
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _allocate_weights(self) -> None:
        if self._weight_shapes is None:
            return
        params = dict(self.model.named_parameters())
        for name, (shape, dtype) in self._weight_shapes.items():
            params[name].data = torch.empty(shape, dtype=dtype, device=self.config.device)
        self._weight_shapes = None

    def _before_push(self, state_dict: Mapping[str, torch.Tensor], is_delta: bool) -> bool:
        """After level 2, a push must set every weight whole; it brings their
        storage back. Returns whether the push restores discarded weights."""
        if not self._weights_discarded:
            return False
        if is_delta:
            raise ValueError("a delta push cannot apply to weights that sleep(level=2) discarded: push them whole")
        if self._weight_shapes is not None:
            shapes = {name: shape for name, (shape, _) in self._weight_shapes.items()}
        else:
            shapes = {name: p.shape for name, p in self.model.named_parameters()}
        covered: dict[str, set] = {}
        slots = self._updater.slots
        for name in state_dict:
            slot = slots.get(name)
            if slot is not None:
                covered.setdefault(slot.param_name, set()).add((slot.start, slot.rows))
        for pname, shape in shapes.items():
            if sum(rows for _, rows in covered.get(pname, ())) < shape[0]:
                missing = next(n for n, s in slots.items() if s.param_name == pname and n not in state_dict)
                raise ValueError(f"after sleep(level=2) the first push must set every weight; it lacks {missing!r}")
        self._allocate_weights()
        return True

    def _check_commit(self, restores: bool) -> None:
        """Under the guard, before a commit installs an update."""
        if self._weights_discarded and not restores:
            raise ValueError(
                "this weight update was prepared before sleep(level=2) discarded the weights: push every weight"
            )

    def _after_commit(self, restores: bool) -> None:
        if restores:
            self._weights_discarded = False


def check_sleep_level(level) -> None:
    """Raise `ValueError` unless `level` is one of SLEEP_LEVELS."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"level must be one of {SLEEP_LEVELS}, got {level!r}")


def check_wake_tags(tags) -> tuple[str, ...]:
    """The tags `wake_up(tags)` wakes; `ValueError` naming `tags` and the allowed values."""
    if tags is None:
        return WAKE_TAGS
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or not tags:
        raise ValueError(f"tags must be None or a non-empty list of {WAKE_TAGS}, got {tags!r}")
    bad = [t for t in tags if t not in WAKE_TAGS]
    if bad:
        raise ValueError(f"tags must be None or a list of {WAKE_TAGS}, got {bad[0]!r}")
    return tuple(tags)


def _return_to_driver(device: torch.device) -> None:
    """Hand freed memory back: CUDA's cached blocks to the driver; on the host,
    glibc's free heap pages (tensors below its mmap threshold live there, and
    freeing them alone returns nothing to the OS)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass
