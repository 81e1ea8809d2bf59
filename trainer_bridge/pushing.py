"""Pushing a trainer's weights, whole or as deltas, to an in-process
`Engine` or a `RolloutCluster`, and what each push cost."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import torch

from rollout import Engine, RolloutCluster
from rollout.engine.delta_encoder import DeltaEncoder
from rollout.engine.weight_delta import PushCost
from rollout.engine.weight_lora import adapter_cost, has_adapters

from .lora import export_adapters, export_base, is_peft_lora
from .names import export_state_dict


def state_to_push(model_or_state_dict, dtype: torch.dtype, weights_discarded: bool) -> dict[str, torch.Tensor]:
    """What `TrainerBridge.push` sends: a PEFT LoRA model's adapters (with its base weights
    when a level-2 sleep discarded the engines'), else the whole state dict cast to `dtype`."""
    if not is_peft_lora(model_or_state_dict):
        return export_state_dict(model_or_state_dict, dtype)
    state = export_adapters(model_or_state_dict)
    if weights_discarded:
        state.update(export_base(model_or_state_dict, dtype))
    return state


def push_metrics(cost: PushCost) -> dict[str, float]:
    """A push's cost as the bridge's metrics log it."""
    return {
        "push/bytes_sent": cost.bytes_sent,
        "push/bytes_full": cost.bytes_full,
        "push/delta": float(cost.encoding == "delta"),
        "push/changed_fraction": cost.changed_fraction,
    }


class WeightPusher:
    """Pushes cast state dicts to `target`. For an `Engine` it keeps the
    copy of the live weights that delta pushes are taken against (a cluster
    keeps its own, which also feeds its replacement actors): from the first
    delta push on, one copy of every pushed tensor (`reference_bytes`)."""

    def __init__(self, target: Engine | RolloutCluster) -> None:
        self.target = target
        self.last_push: PushCost | None = None
        self._encoder: DeltaEncoder | None = None
        self._version: int | None = None  # the engine's version the encoder's copy holds

    @property
    def reference_bytes(self) -> int:
        """Bytes kept on the trainer's side for delta pushes."""
        if isinstance(self.target, RolloutCluster):
            return self.target.reference_bytes
        return 0 if self._encoder is None else self._encoder.nbytes

    @property
    def weights_discarded(self) -> bool:
        """Whether the engines' weights were freed by a level-2 sleep (the next push must set them all)."""
        if isinstance(self.target, RolloutCluster):
            return self.target.weights_discarded
        return "weights" in self.target.asleep

    def push(self, state: Mapping[str, torch.Tensor], version: int | None, inflight: str, delta: bool | None) -> int:
        if delta is not None and not isinstance(delta, bool):
            raise TypeError(f"delta must be None (auto) or a bool, got {type(delta).__name__}")
        if delta is None:  # auto: deltas pay where bytes cross a network, not within one host's memory
            delta = isinstance(self.target, RolloutCluster) and self.target.actors_off_node()
        if isinstance(self.target, RolloutCluster):
            v = self.target.push_weights(state, version, inflight, delta=delta and not has_adapters(state))
            self.last_push = self.target.last_push
            return v
        start = time.perf_counter()
        if has_adapters(state):  # the adapted weights change under the copy: a later delta starts whole
            self._encoder = None
            v = self.target.update_weights(state, version, inflight)
            self.last_push = adapter_cost(state, self.target.config.dtype, time.perf_counter() - start)
            return v
        if delta and self._encoder is None:
            self._encoder = DeltaEncoder()
        if self._encoder is None:
            v = self.target.update_weights(state, version, inflight)
            full = sum(t.nbytes for t in state.values())
            self.last_push = PushCost(full, full, time.perf_counter() - start, "full", {"full": len(state)})
            return v
        base = self.target.policy_version
        if base != self._version or "weights" in self.target.asleep:
            self._encoder.clear()  # the engine holds other weights (another pusher) or none (a sleep): send whole
        encoded = self._encoder.encode(state, base, delta, stable=True)  # the update commits before this returns
        v = self.target.update_weights(encoded.state_dict, version, inflight)
        self._encoder.commit(encoded)
        self._version = v
        self.last_push = dataclasses.replace(encoded.cost, seconds=time.perf_counter() - start)
        return v
