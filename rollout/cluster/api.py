"""The module-level verbs (`rollout.init`, `rollout.generate`, ...) over one
default cluster: the documented exception to "no hidden globals", the way
`ray.init` and `wandb.init` work."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from ..engine.session import Session
from ..outputs import RolloutOutput, ScoredSequence
from ..sampling_params import SamplingParams
from .cluster import RolloutCluster
from .handles import GenerationHandle, PushHandle

_default: RolloutCluster | None = None


def init(
    model_path: str | Path,
    num_actors: int = 2,
    num_gpus_per_actor: int | None = None,
    address: str | None = None,
    **engine_kwargs,
) -> RolloutCluster:
    """Start the default cluster (see `RolloutCluster`) and return it."""
    global _default
    if _default is not None and not _default.closed:
        raise RuntimeError("rollout.init() was already called; call rollout.shutdown() first")
    _default = RolloutCluster(model_path, num_actors, num_gpus_per_actor, address, **engine_kwargs)
    return _default


def _cluster() -> RolloutCluster:
    if _default is None or _default.closed:
        raise RuntimeError("no rollout cluster: call rollout.init(...) first")
    return _default


def generate(prompts, params: SamplingParams | None = None, timeout: float | None = None) -> list[RolloutOutput]:
    """`RolloutCluster.generate` on the default cluster."""
    return _cluster().generate(prompts, params, timeout)


def score(
    sequences, top_logprobs: int = 0, params: SamplingParams | None = None, start=1, timeout: float | None = None
) -> list[ScoredSequence]:
    """`RolloutCluster.score` on the default cluster."""
    return _cluster().score(sequences, top_logprobs, params, start, timeout)


def submit(prompts, params: SamplingParams | None = None) -> GenerationHandle:
    """`RolloutCluster.submit` on the default cluster."""
    return _cluster().submit(prompts, params)


def session(prompt) -> Session:
    """`RolloutCluster.session` on the default cluster."""
    return _cluster().session(prompt)


def push_weights(
    state_dict: Mapping[str, torch.Tensor],
    version: int | None = None,
    inflight: str = "recompute",
    wait: bool = True,
    delta: bool = False,
) -> int | PushHandle:
    """`RolloutCluster.push_weights` on the default cluster."""
    return _cluster().push_weights(state_dict, version, inflight, wait, delta)


def policy_version() -> int:
    """`RolloutCluster.policy_version` of the default cluster."""
    return _cluster().policy_version()


def health() -> list[dict]:
    """`RolloutCluster.health` of the default cluster."""
    return _cluster().health()


def shutdown() -> None:
    """Shut the default cluster down (a no-op when there is none)."""
    global _default
    if _default is not None:
        _default.shutdown()
    _default = None
