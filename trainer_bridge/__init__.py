"""What a trainer imports: `TrainerBridge` (weight pushes with name mapping
and dtype casts, rollouts as padded batches, the staleness bound),
`RolloutBatch`, `token_logprobs` (the engine's logprob math on the
trainer's model) and `routing_replay` (the engine's experts forced in a
mixture-of-experts trainer's forward)."""

from .alarm import MismatchAlarm, WeightSyncError
from .batch import RolloutBatch
from .bridge import PendingRollout, TrainerBridge
from .corrections import Correction, CorrectionResult, corrected_policy_loss, correction_weights
from .distill import response_log_softmax, reverse_kl_loss, teacher_logprobs, topk_reverse_kl_loss
from .logprobs import logprob_mismatch, token_logprobs
from .names import canonical_name, export_state_dict
from .routing_replay import routing_replay, sparse_routers
from .staleness import STALE_ACTIONS, StalenessPolicy

__all__ = [
    "MismatchAlarm",
    "WeightSyncError",
    "STALE_ACTIONS",
    "Correction",
    "CorrectionResult",
    "PendingRollout",
    "RolloutBatch",
    "StalenessPolicy",
    "TrainerBridge",
    "canonical_name",
    "corrected_policy_loss",
    "correction_weights",
    "export_state_dict",
    "logprob_mismatch",
    "response_log_softmax",
    "reverse_kl_loss",
    "teacher_logprobs",
    "topk_reverse_kl_loss",
    "routing_replay",
    "sparse_routers",
    "token_logprobs",
]
