"""Validating and staging policy weights before a commit.

`WeightUpdater.prepare` checks a state dict (checkpoint names, shapes,
dtypes, finiteness) and copies it into staging buffers next to the live
parameters, all without touching the live weights; `commit` then copies
staging into live under the guard (one device copy per touched parameter,
which keeps pointers stable for captured graphs). Staging buffers are
allocated on first use and reused by every later update.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .model import Model, WeightSlot


@dataclass(slots=True)
class StagedUpdate:
    """Parameters whose staging buffers hold the next weights."""

    params: list[str]  # live parameter names to copy from staging
    num_tensors: int  # checkpoint tensors in the update


class WeightUpdater:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.slots = model.weight_slots()
        self._live = dict(model.named_parameters())
        self._staging: dict[str, torch.Tensor] = {}

    def validate(self, state_dict: Mapping[str, torch.Tensor]) -> list[tuple[WeightSlot, torch.Tensor]]:
        """Check every entry; raises `TypeError`/`ValueError` naming the first bad one."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of name -> tensor, got {type(state_dict).__name__}")
        if not state_dict:
            raise ValueError("state_dict is empty: nothing to update")
        unknown = [k for k in state_dict if k not in self.slots]
        if unknown:
            shown = ", ".join(repr(k) for k in unknown[:5])
            raise ValueError(
                f"state_dict has names that are not parameters of this {self.model.cfg.model_type} model: "
                f"{shown}{' ...' if len(unknown) > 5 else ''} (expected checkpoint names such as "
                f"'model.layers.0.self_attn.q_proj.weight')"
            )
        items = []
        for name, tensor in state_dict.items():
            slot = self.slots[name]
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}")
            if not tensor.is_floating_point():
                raise TypeError(
                    f"state_dict[{name!r}] has dtype {tensor.dtype}; expected a floating-point dtype "
                    "(float32, bfloat16, float16 or float64), cast to the engine's dtype on load"
                )
            if tuple(tensor.shape) != slot.shape:
                raise ValueError(f"state_dict[{name!r}] has shape {tuple(tensor.shape)}, expected {slot.shape}")
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"state_dict[{name!r}] holds NaN or inf values")
            items.append((slot, tensor))
        self._check_tied_duplicate(state_dict)
        return items

    def _check_tied_duplicate(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        # A tied model's full state_dict carries the embedding twice; both copies must agree.
        embed, head = state_dict.get("model.embed_tokens.weight"), state_dict.get("lm_head.weight")
        if self.model.lm_head is None and embed is not None and head is not None:
            if embed.data_ptr() != head.data_ptr() and not torch.equal(embed.cpu(), head.cpu()):
                raise ValueError(
                    "state_dict has different 'model.embed_tokens.weight' and 'lm_head.weight', "
                    "but this model ties them (tie_word_embeddings=true)"
                )

    def stage(self, items: list[tuple[WeightSlot, torch.Tensor]]) -> StagedUpdate:
        """Copy validated tensors into staging; live weights are untouched."""
        by_param: dict[str, list[tuple[WeightSlot, torch.Tensor]]] = {}
        for slot, tensor in items:
            by_param.setdefault(slot.param_name, []).append((slot, tensor))
        for pname, parts in by_param.items():
            live = self._live[pname]
            staging = self._staging.get(pname)
            if staging is None:
                staging = self._staging[pname] = torch.empty_like(live)
            covered = sum(rows for _, rows in {(slot.start, slot.rows) for slot, _ in parts})
            if covered < live.shape[0]:
                staging.copy_(live)  # partial update of a fused parameter keeps the other rows
            for slot, tensor in parts:
                slot.view(staging).copy_(tensor)
        return StagedUpdate(list(by_param), len(items))

    def commit(self, staged: StagedUpdate) -> None:
        """Copy staging into the live parameters; call under the guard."""
        with torch.no_grad():
            for pname in staged.params:
                self._live[pname].copy_(self._staging[pname])
