"""rollout: an RL rollout engine with policy-weight sync.

`Engine` runs in-process on one device and never imports Ray; the cluster
layer (`init`, `generate`, `push_weights`, ...) imports Ray when first used.
"""

from .api import generate, health, init, policy_version, push_weights, shutdown, submit
from .cluster import RolloutCluster
from .engine import INFLIGHT_MODES, ClosedError, Engine, StepInfo, generation_pause
from .handles import GenerationHandle, PushHandle
from .outputs import RolloutOutput, Sample
from .sampling_params import LOGPROBS_MODES, SamplingParams
from .version_guard import PolicyVersionGuard

__all__ = [
    "ClosedError",
    "GenerationHandle",
    "PushHandle",
    "RolloutCluster",
    "generate",
    "generation_pause",
    "health",
    "init",
    "policy_version",
    "push_weights",
    "shutdown",
    "submit",
    "INFLIGHT_MODES",
    "LOGPROBS_MODES",
    "Engine",
    "PolicyVersionGuard",
    "RolloutOutput",
    "Sample",
    "SamplingParams",
    "StepInfo",
]
