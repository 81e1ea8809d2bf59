"""rollout: an RL rollout engine with policy-weight sync.

The public surface lives here. `Engine` (`rollout.engine`) runs in-process on
one device and never imports Ray; the cluster verbs (`init`, `generate`,
`push_weights`, ...; `rollout.cluster`) import Ray when first used.
"""

from .cluster import (
    GenerationHandle,
    PushHandle,
    RolloutCluster,
    generate,
    health,
    init,
    policy_version,
    push_weights,
    score,
    session,
    shutdown,
    submit,
)
from .engine import (
    INFLIGHT_MODES,
    ClosedError,
    Engine,
    EngineAsleepError,
    PolicyVersionGuard,
    StepInfo,
    generation_pause,
)
from .outputs import RolloutOutput, Sample, ScoredSequence
from .sampling_params import LOGPROBS_MODES, SamplingParams
from .structured import StructuredOutputs

__all__ = [
    "ClosedError",
    "EngineAsleepError",
    "GenerationHandle",
    "PushHandle",
    "RolloutCluster",
    "generate",
    "generation_pause",
    "health",
    "init",
    "policy_version",
    "push_weights",
    "score",
    "session",
    "shutdown",
    "submit",
    "INFLIGHT_MODES",
    "LOGPROBS_MODES",
    "Engine",
    "PolicyVersionGuard",
    "RolloutOutput",
    "Sample",
    "SamplingParams",
    "ScoredSequence",
    "StepInfo",
    "StructuredOutputs",
]
