"""Ray plumbing for the cluster: joining or starting Ray, sizing and
reserving actor bundles, creating actors. Imported only when a cluster is
made, so `import rollout` never needs Ray."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..outputs import RolloutOutput
from .actor_slots import ActorGone


@dataclass(frozen=True, slots=True)
class Placement:
    """The resources reserved per actor."""

    num_actors: int
    cpus: int  # per actor; torch threads follow it
    gpus: int  # per actor


def ray_module():
    """The `ray` module, imported on first use."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a dependency
        raise ImportError("the rollout cluster needs Ray: pip install ray") from e
    return ray


def connect(address: str | None, init_kwargs: dict | None, model_path=None, dtype="float32") -> bool:
    """Make sure this process is connected to Ray; returns True if this call started it.

    address None: reuse this process's connection, else join `RAY_ADDRESS`
    when set, else start a local instance. "auto", "HOST:PORT" or
    "ray://..." join a running cluster. A local start is explicit
    (`address="local"`): a plain `ray.init()` would try to join whatever
    `ray start` last ran on this machine, even after it stopped. A local
    start sizes and preallocates the object store for `model_path`'s weights
    at `dtype` (`local_store_kwargs`); `init_kwargs` win over that.
    """
    ray = ray_module()
    if ray.is_initialized():
        return False
    kwargs = {"include_dashboard": False, "log_to_driver": True, **(init_kwargs or {})}
    if address is None and not os.environ.get("RAY_ADDRESS"):
        address = "local"
    if address == "local":
        kwargs = local_store_kwargs(kwargs, model_path, dtype)
    ray.init(address=address or os.environ["RAY_ADDRESS"], **kwargs)
    return True


# Object store sizing for a local start. Ray's default store (30% of
# available memory) is neither sized for the weights nor preallocated: each
# process faults in the store's pages the first time it touches them, and a
# large store keeps handing pushes fresh pages. A store that holds two
# versions of the weights (the live one and the next push) plus headroom,
# preallocated when Ray starts, reuses the same warm pages on every push
# (docs/weight_sync.md#sizing-the-object-store).
STORE_VERSIONS = 2
STORE_HEADROOM_MIN = 256 * 2**20  # room for anything else put while two versions are live
STORE_MEMORY_SHARE = 0.3  # at most Ray's own default share of available memory
STORE_SHM_SHARE = 0.95  # Ray's margin below /dev/shm's free space
STORE_MINIMUM = 75 * 2**20  # Ray refuses a smaller store


def weights_bytes(model_path, dtype="float32") -> int | None:
    """Bytes a push of the checkpoint's weights carries at `dtype`, read from
    the safetensors headers alone; None when the path holds no safetensors on
    this machine. Only floating tensors are pushed (the engine refuses
    others), and a tied `lm_head.weight` travels once, as the embedding."""
    import torch
    from safetensors import safe_open

    from ..model.loader import checkpoint_files

    path = Path(model_path)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not path.is_dir() or not isinstance(dtype, torch.dtype):
        return None  # the engine names a bad dtype or path when it starts
    try:
        files = checkpoint_files(path)
    except ValueError:
        return None
    config = path / "config.json"
    tied = config.is_file() and bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
    numel = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                entry = f.get_slice(name)
                if entry.get_dtype() in _FLOATING and not (tied and name == "lm_head.weight"):
                    numel += math.prod(entry.get_shape())
    return numel * dtype.itemsize


_FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}  # safetensors' names of floating dtypes


def store_bytes(weights: int, available: int, shm_free: int | None) -> int:
    """Object store size for `weights` bytes of weights: two versions plus
    headroom (the larger of half a version and `STORE_HEADROOM_MIN`), capped
    at `STORE_MEMORY_SHARE` of `available` memory and `STORE_SHM_SHARE` of
    /dev/shm's free bytes (None: no /dev/shm), never below Ray's minimum."""
    want = STORE_VERSIONS * weights + max(weights // 2, STORE_HEADROOM_MIN)
    cap = int(available * STORE_MEMORY_SHARE)
    if shm_free is not None:
        cap = min(cap, int(shm_free * STORE_SHM_SHARE))
    return max(min(want, cap), STORE_MINIMUM)


def _memory_available() -> int:
    """This machine's available memory in bytes (Ray's own measure, cgroup limits included)."""
    try:
        from ray._private.utils import estimate_available_memory
    except ImportError:  # a private helper: fall back to the kernel's figure
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return estimate_available_memory()


def _shm_free() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bsize * st.f_bavail


def local_store_bytes(model_path, dtype="float32") -> int | None:
    """`store_bytes` for `model_path`'s weights on this machine; None when they cannot be read here."""
    weights = None if model_path is None else weights_bytes(model_path, dtype)
    return None if weights is None else store_bytes(weights, _memory_available(), _shm_free())


def local_store_kwargs(kwargs: dict, model_path, dtype="float32") -> dict:
    """`ray.init` keywords for a local start: `kwargs` with an object store
    sized by `store_bytes` for `model_path`'s weights and preallocated, unless
    `kwargs` sets `object_store_memory` itself (then its store is left as Ray
    makes it) or the weights cannot be read here. Keys of `kwargs` and of its
    `_system_config` win over these defaults."""
    if "object_store_memory" in kwargs:
        return kwargs
    size = local_store_bytes(model_path, dtype)
    if size is None:
        return kwargs
    system = {"preallocate_plasma_memory": True, **(kwargs.get("_system_config") or {})}
    if "RAY_preallocate_plasma_memory" in os.environ:  # the user's own setting
        system.pop("preallocate_plasma_memory")
    out = {**kwargs, "object_store_memory": size}
    if system:
        out["_system_config"] = system
    return out


def plan_placement(num_actors: int, cpus: int | None, gpus: int | None) -> Placement:
    """Resources per actor; raises `ValueError` when the cluster cannot hold them."""
    ray = ray_module()
    total = ray.cluster_resources()
    have_gpus, have_cpus = int(total.get("GPU", 0)), int(total.get("CPU", 0))
    if gpus is None:
        gpus = 1 if have_gpus else 0
    if gpus * num_actors > have_gpus:
        raise ValueError(
            f"num_gpus_per_actor={gpus} x num_actors={num_actors} needs {gpus * num_actors} GPUs; "
            f"the Ray cluster has {have_gpus}"
        )
    if cpus is None:
        cpus = 1 if gpus else max(1, have_cpus // num_actors)
    if cpus * num_actors > max(have_cpus, 1):
        raise ValueError(
            f"num_cpus_per_actor={cpus} x num_actors={num_actors} needs {cpus * num_actors} CPUs; "
            f"the Ray cluster has {have_cpus}"
        )
    return Placement(num_actors, cpus, gpus)


def reserve(placement: Placement, timeout_s: float):
    """A ready placement group with one bundle per actor, or `RuntimeError`."""
    ray = ray_module()
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle: dict[str, float] = {"CPU": placement.cpus}
    if placement.gpus:
        bundle["GPU"] = placement.gpus
    pg = placement_group([dict(bundle) for _ in range(placement.num_actors)], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not place {placement.num_actors} actors of {bundle} within {timeout_s} s; "
            f"available: {ray.available_resources()}"
        ) from None
    return pg


def local_node() -> str | None:
    """Id of the Ray node whose object store this process's puts land in;
    None through Ray Client (`ray://`), where a put first crosses the network."""
    ray = ray_module()
    from ray.util.client import ray as client

    return None if client.is_connected() else ray.get_runtime_context().get_node_id()


def bundle_nodes(pg) -> dict[int, str]:
    """Bundle index -> id of the Ray node that holds it."""
    from ray.util.placement_group import placement_group_table

    return dict(placement_group_table(pg)["bundles_to_node_id"])


CONTROL = "control"  # pushes, health, logs: never queued behind generation
GENERATE = "generate"
SESSIONS = "sessions"
LIVENESS = "liveness"  # the watchdog's pings: never queued behind anything, so silence means a hang


def create_actor(
    worker_cls, pg, index: int, placement: Placement, args: tuple, generate_threads: int, session_threads: int
) -> Any:
    """A rollout actor with three thread pools: `generate_threads` threads for
    generate streams, `session_threads` for session turns (short calls, many
    at once: their sequences share the engine's batches), and a small
    separate pool for control calls, so a weight push is never stuck behind
    long generations. Bounding the threads also bounds memory: every thread
    that runs torch keeps scratch buffers. One more thread answers only the
    watchdog's pings (`progress`), so a busy control pool never looks hung."""
    ray = ray_module()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # Concurrency groups can only be declared when the class is made remote.
    groups = {CONTROL: 4, GENERATE: generate_threads, SESSIONS: session_threads, LIVENESS: 1}
    remote_cls = ray.remote(max_concurrency=2, concurrency_groups=groups)(worker_cls)
    return remote_cls.options(
        num_cpus=placement.cpus,
        num_gpus=placement.gpus,
        max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
    ).remote(*args)


def control(handle, method: str):
    """`handle.method` bound to the control thread pool."""
    return getattr(handle, method).options(concurrency_group=CONTROL)


def ping(handle):
    """Start the actor's `progress` call on its liveness thread; returns the call's object ref."""
    return handle.progress.options(concurrency_group=LIVENESS).remote()


def terminate(handle, pid: int | None, node: str, grace_s: float = 2.0) -> None:
    """End an actor for good: through Ray, then, when its process runs on this
    machine and is still there after `grace_s`, with SIGKILL (a stopped or hung
    process may never act on Ray's request to exit; one that does exits as
    Ray expects, without a worker-crash report). Returns at once; errors of an
    actor already gone are ignored."""
    ray = ray_module()
    with contextlib.suppress(Exception):
        ray.kill(handle, no_restart=True)
    if pid is not None and node and node == local_node():
        threading.Thread(target=_kill_if_lingering, args=(pid, grace_s), name="rollout-terminate", daemon=True).start()


def actor_process(handle) -> tuple[int | None, str]:
    """The process id and Ray node id of the actor `handle`, from Ray's actor
    table, which knows them once a worker process is leased for the actor,
    before its constructor runs or answers; (None, "") when the table has
    no process for it (through Ray Client, or before a worker is leased)."""
    try:
        from ray._private import state

        info = state.actors(handle._actor_id.hex())
    except Exception:  # a private table: without it, Ray's kill alone ends the actor
        return None, ""
    return (info.get("Pid") or None), info.get("Address", {}).get("NodeID", "")


def _kill_if_lingering(pid: int, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _running(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    if not os.path.isdir("/proc"):  # no procfs: ask the process table (a zombie counts as running)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone, also while being read
        return False


class ActorStream:
    """One actor's `generate_stream` call: its outputs as they finish."""

    def __init__(self, refs, label: str, handle=None, call_id: str = "") -> None:
        self._refs = refs  # Ray's generator of object refs, one per output
        self._label = label
        self._handle, self._call_id = handle, call_id

    def abort(self) -> None:
        """Ask the actor to end this call's unfinished samples now; a dead actor has none left."""
        with contextlib.suppress(Exception):
            control(self._handle, "abort_generation").remote(self._call_id)

    def next(self, timeout: float) -> RolloutOutput | None:
        """The next output, or None when none came within `timeout` s.
        Raises `ActorGone` when the actor died, else the actor's own error."""
        ray = ray_module()
        try:
            ready, _ = ray.wait([self._refs], timeout=timeout)
            if not ready:
                return None
            return ray.get(next(self._refs))
        except ray.exceptions.RayActorError as e:
            raise ActorGone(f"{self._label} died while generating: {e}") from e
        except StopIteration:
            raise RuntimeError(f"{self._label} ended its output stream early") from None


def open_stream(handle, label: str, indices: list[int], prompts: list[list[int]], params) -> ActorStream:
    """Start `generate_stream` on the actor `handle`, on its generate threads."""
    call_id = uuid.uuid4().hex
    refs = handle.generate_stream.options(concurrency_group=GENERATE).remote(indices, prompts, params, call_id)
    return ActorStream(refs, label, handle, call_id)
