"""The Ray cluster of rollout actors: the only part of `rollout` that imports
Ray, and only when a cluster is made. `RolloutCluster` is the driver side;
`RolloutWorker` the plain-Python actor body around one `Engine`; the weight
wire format packs pushes into a few large buckets (both sides)."""

from .api import generate, health, init, policy_version, push_weights, score, session, shutdown, submit
from .cluster import RolloutCluster
from .handles import GenerationHandle, PushHandle

__all__ = [
    "GenerationHandle",
    "PushHandle",
    "RolloutCluster",
    "generate",
    "health",
    "init",
    "policy_version",
    "push_weights",
    "score",
    "session",
    "shutdown",
    "submit",
]
