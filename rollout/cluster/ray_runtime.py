"""Ray plumbing for the cluster: joining or starting Ray, sizing and
reserving actor bundles, creating actors. Imported only when a cluster is
made, so `import rollout` never needs Ray."""

from __future__ import annotations

import os
from dataclasses import dataclass
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


def connect(address: str | None, init_kwargs: dict | None) -> bool:
    """Make sure this process is connected to Ray; returns True if this call started it.

    address None: reuse this process's connection, else join `RAY_ADDRESS`
    when set, else start a local instance. "auto", "HOST:PORT" or
    "ray://..." join a running cluster. A local start is explicit
    (`address="local"`): a plain `ray.init()` would try to join whatever
    `ray start` last ran on this machine, even after it stopped.
    """
    ray = ray_module()
    if ray.is_initialized():
        return False
    kwargs = {"include_dashboard": False, "log_to_driver": True, **(init_kwargs or {})}
    if address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(address="local", **kwargs)
        return True
    ray.init(address=address or os.environ["RAY_ADDRESS"], **kwargs)
    return True


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


def create_actor(worker_cls, pg, index: int, placement: Placement, args: tuple, generate_threads: int) -> Any:
    """A rollout actor with two thread pools: `generate_threads` threads for
    generate streams, and a small separate pool for control calls, so a
    weight push is never stuck behind long generations. Bounding the threads
    also bounds memory: every thread that runs torch keeps scratch buffers."""
    ray = ray_module()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # Concurrency groups can only be declared when the class is made remote.
    remote_cls = ray.remote(max_concurrency=2, concurrency_groups={CONTROL: 4, GENERATE: generate_threads})(worker_cls)
    return remote_cls.options(
        num_cpus=placement.cpus,
        num_gpus=placement.gpus,
        max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
    ).remote(*args)


def control(handle, method: str):
    """`handle.method` bound to the control thread pool."""
    return getattr(handle, method).options(concurrency_group=CONTROL)


class ActorStream:
    """One actor's `generate_stream` call: its outputs as they finish."""

    def __init__(self, refs, label: str) -> None:
        self._refs = refs  # Ray's generator of object refs, one per output
        self._label = label

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
    refs = handle.generate_stream.options(concurrency_group=GENERATE).remote(indices, prompts, params)
    return ActorStream(refs, label)
