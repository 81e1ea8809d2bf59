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
    """The copies a commit performs, everything validated already."""

    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (live destination, staged or immutable source)
    num_tensors: int  # checkpoint tensors in the update
    nbytes: int  # bytes the commit copies
    uses_staging: bool  # holds the shared staging buffers until committed or released


class WeightUpdater:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.slots = model.weight_slots()
        self._live = dict(model.named_parameters())
        self._staging: dict[str, torch.Tensor] = {}
        self._holder: StagedUpdate | None = None  # the prepared update that owns the staging buffers

    def validate(
        self, state_dict: Mapping[str, torch.Tensor], check_finite: bool = True
    ) -> list[tuple[WeightSlot, torch.Tensor]]:
        """Check every entry; raises `TypeError`/`ValueError` naming the first bad one.

        `check_finite=False` skips the NaN/inf scan, for callers that did it already.
        """
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
            if check_finite and not all_finite(tensor):
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

    def stage(self, items: list[tuple[WeightSlot, torch.Tensor]], immutable: bool = False) -> StagedUpdate:
        """Prepare the commit's copies; live weights are untouched.

        By default every tensor is copied into staging buffers next to the
        live parameters (allocated once, reused by later updates), so the
        caller may reuse its tensors as soon as this returns. With
        `immutable=True` the caller promises the tensors stay unchanged until
        the commit, and those already on the engine's device and dtype are
        committed straight from the source (no staging copy).
        """
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        by_param: dict[str, list[tuple[WeightSlot, torch.Tensor]]] = {}
        for slot, tensor in items:
            live = self._live[slot.param_name]
            if immutable and tensor.device == live.device and tensor.dtype == live.dtype:
                copies.append((slot.view(), tensor))
            else:
                by_param.setdefault(slot.param_name, []).append((slot, tensor))
        if by_param and self._holder is not None:
            raise RuntimeError("another prepared weight update holds the staging buffers; commit or discard it first")
        for pname, parts in by_param.items():
            copies.append((self._live[pname], self._stage_param(pname, parts)))
        staged = StagedUpdate(copies, len(items), sum(dst.nbytes for dst, _ in copies), bool(by_param))
        if staged.uses_staging:
            self._holder = staged
        return staged

    def release(self, staged: StagedUpdate) -> None:
        """`staged` no longer needs the staging buffers (committed or discarded)."""
        if self._holder is staged:
            self._holder = None

    def _stage_param(self, pname: str, parts: list[tuple[WeightSlot, torch.Tensor]]) -> torch.Tensor:
        live = self._live[pname]
        staging = self._staging.get(pname)
        if staging is None:
            staging = self._staging[pname] = torch.empty_like(live)
        covered = sum(rows for _, rows in {(slot.start, slot.rows) for slot, _ in parts})
        if covered < live.shape[0]:
            staging.copy_(live)  # partial update of a fused parameter keeps the other rows
        for slot, tensor in parts:
            slot.view(staging).copy_(tensor)
        return staging

    def commit(self, staged: StagedUpdate) -> None:
        """Copy the staged weights into the live parameters; call under the guard."""
        with torch.no_grad():
            for dst, src in staged.copies:
                dst.copy_(src)


def all_finite(t: torch.Tensor) -> bool:
    # One reduction pass (NaN and +-inf reach the min or max) instead of
    # isfinite().all(), which allocates a mask and ran 20x slower here.
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))
