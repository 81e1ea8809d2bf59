"""One device's engine: the `Engine` and the parts its step loop composes
(scheduler, stepper, sampler, policy version guard, weight updates).

Nothing here imports Ray: the engine runs and is tested in-process, and the
cluster (`rollout.cluster`) wraps it in actors.
"""

from .engine import ClosedError, Engine
from .errors import EngineAsleepError
from .step_stats import StepInfo, generation_pause
from .version_guard import PolicyVersionGuard
from .weights_api import INFLIGHT_MODES

__all__ = [
    "INFLIGHT_MODES",
    "ClosedError",
    "Engine",
    "EngineAsleepError",
    "PolicyVersionGuard",
    "StepInfo",
    "generation_pause",
]
