"""Validating and staging policy weights before a commit.

`WeightUpdater.validate` checks a state dict (checkpoint names, shapes,
dtypes, finiteness) and `stage` puts it next to the live parameters, all
without touching the live weights; `commit` then installs it under the guard:

- On the host nothing holds parameter pointers, so a commit rebinds each
  touched parameter to its new storage: no copy under the guard. The old
  storage becomes the next update's staging buffer, and sources the caller
  lets the engine adopt (object-store buckets) are used as they are, fused
  q/k/v and gate/up included when the parts lie side by side: a push then
  copies nothing on the actor.
- On a device, captured graphs hold parameter pointers, so a commit copies
  staging (or an adopted source already on the device) into the live
  parameters: one device copy per touched parameter.
- A delta push (`weight_delta`) is checked and turned into flat indices and
  values in phase one; the commit writes them into the live weights with
  one scatter per tensor (`weight_delta.put`), copying nothing else. On the
  host, a parameter the engine does not own (an adopted object-store
  bucket, shared with other actors and read-only) or one whose patch is
  dense (more than 1/32 of it: a scatter under the guard would pause
  generation longer than a rebind) gets a staged copy instead, patched in
  phase one and rebound at commit, as a whole tensor would.

Staging buffers are allocated on first use and reused by every later update.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..model.decoder import Model
from ..model.weight_slots import WeightSlot
from .weight_delta import BASE, all_finite, changed_at, is_delta, put, split
from .weight_lora import LoraBases, LoraPlan, has_adapters, merge_into


@dataclass(slots=True)
class StagedUpdate:
    """What a commit installs, everything validated already."""

    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (live destination, source) copied at commit (device engines)
    swaps: dict[str, torch.Tensor]  # parameter name -> its new storage, rebound at commit (host engines)
    staging: dict[str, torch.Tensor]  # parameter name -> staging buffer this update holds (returned when done)
    adopted: frozenset[str]  # swapped parameters that view memory the caller lets the engine keep
    nbytes: int  # bytes the commit installs
    done: bool = field(default=False)  # committed or discarded
    base: int | None = None  # a delta's base version: the commit refuses to install it over any other
    restores: bool = False  # it sets every weight that a sleep discarded (see `rollout.engine.sleep`)
    lora: LoraPlan | None = None  # what the commit does to the adapter bases (None: nothing)
    kept: frozenset[str] = frozenset()  # parameters whose replaced storage becomes adapter bases (not spare)
    patches: list[tuple[WeightSlot, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # (slot, where (`weight_delta.changed_at`), values) a delta writes into the live weights at commit, after the swaps


Patches = dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (where, values) from `weight_delta.changed_at`


class Expanded(NamedTuple):
    """A push as the tensors it sets."""

    base: int | None  # a delta's base version
    state_dict: Mapping[str, torch.Tensor]  # every tensor it sets whole
    lora: LoraPlan | None  # what its commit does to the adapter bases
    patches: Patches = {}  # tensors a delta sets as changed elements


DENSE = 32  # a patch of more than 1/DENSE of a host parameter is staged in a copy, not scattered at commit


class WeightUpdater:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.slots = model.weight_slots()
        self._live = dict(model.named_parameters())
        self.rebind = next(iter(self._live.values())).device.type == "cpu"  # see the module docstring
        self._spare: dict[str, torch.Tensor] = {}  # owned buffers free for staging, by parameter
        self._adopted: set[str] = set()  # parameters whose live storage is the caller's memory
        self.lora = LoraBases()  # base weights of the tensors adapter pushes set

    def expand(self, state_dict: Mapping[str, torch.Tensor], version: int, adopt: bool = False) -> Expanded:
        """Every tensor a push sets, with what a delta or adapter push needs
        at commit. A plain push is itself; a delta push (`weight_delta`) is
        checked against `version` and its patches against the live
        weights; an adapter push (`weight_lora`) names the merges that
        `stage_merges` runs over the kept bases. Raises `ValueError` or
        `TypeError` naming the first bad entry; nothing changes here."""
        if not isinstance(state_dict, Mapping):
            return Expanded(None, state_dict, None)
        delta, adapters = is_delta(state_dict), has_adapters(state_dict)
        if delta and adapters:
            raise ValueError("a push cannot carry both a delta and adapters")
        if adapters:
            plan = self.lora.expand(state_dict, self._live_view, keep_live=self.rebind, keep_whole=adopt)
            return Expanded(None, plan.full, plan)
        cleared = LoraPlan({}, {}, frozenset(k for k in state_dict if not delta or k != BASE))
        if not delta:
            return Expanded(None, state_dict, cleared if self.lora.bases else None)
        parts = split(state_dict)
        if parts.base != version:
            raise ValueError(
                f"delta push is relative to version {parts.base}, but this engine holds version {version}: "
                "push the weights whole"
            )
        patches = {name: changed_at(name, self._live_view(name), p) for name, p in parts.patches.items()}
        cleared = LoraPlan({}, {}, frozenset(parts.whole) | frozenset(patches)) if self.lora.bases else None
        return Expanded(parts.base, parts.whole, cleared, patches)

    def _live_view(self, name: str) -> torch.Tensor:
        if name not in self.slots:
            raise ValueError(f"push changes {name!r}, not a parameter of this {self.model.cfg.model_type} model")
        return self.slots[name].view()

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

    def stage(
        self, items: list[tuple[WeightSlot, torch.Tensor]], adopt: bool = False, own: frozenset[str] = frozenset()
    ) -> StagedUpdate:
        """Prepare what the commit installs; live weights are untouched.

        By default every tensor is copied into staging buffers, so the caller
        may reuse its tensors as soon as this returns. With `adopt=True`
        the caller promises the tensors never change while the engine uses
        them: sources on the engine's device and dtype are then installed
        without a staging copy (on the host, adopted as the live weights
        until a later update replaces them). Parameters in `own` get a
        staging buffer whatever `adopt` says (adapter merges write into it).
        """
        by_param: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        for slot, tensor in items:  # a tied duplicate maps onto the same rows: the first is kept
            by_param.setdefault(slot.param_name, {}).setdefault((slot.start, slot.rows), slot.as_rows(tensor))
        staged = StagedUpdate([], {}, {}, frozenset(), 0)
        adopted = set()
        for pname, parts in by_param.items():
            live = self._live[pname]
            source = _whole(live, parts) if adopt and pname not in own else None
            if source is not None and self.rebind:
                staged.swaps[pname] = source
                adopted.add(pname)
            elif source is not None:
                staged.copies.append((live, source))
            elif adopt and pname not in own and not self.rebind and all(_same_kind(t, live) for t in parts.values()):
                staged.copies.extend((live.narrow(0, start, rows), t) for (start, rows), t in parts.items())
            else:
                buffer = staged.staging[pname] = self._stage_param(pname, parts)
                if self.rebind:
                    staged.swaps[pname] = buffer
                else:
                    staged.copies.append((live, buffer))
        staged.adopted = frozenset(adopted)
        staged.nbytes = sum(d.nbytes for d, _ in staged.copies) + sum(t.nbytes for t in staged.swaps.values())
        return staged

    def stage_patches(self, staged: StagedUpdate, patches: Patches, check_finite: bool = True) -> None:
        """Add a delta's `patches` to `staged`: written at commit into live
        weights the engine owns, now into a staged copy where `staged` has
        one for the parameter or, on the host, where the live weights are
        adopted memory (a bucket other actors read too) or the patch is
        dense (see the module docstring). Raises `ValueError` naming the
        first bad patch; live weights are untouched."""
        seen: dict[tuple[str, int, int], tuple[str, torch.Tensor, torch.Tensor]] = {}
        for name, (where, values) in patches.items():
            slot = self.slots[name]
            key = (slot.param_name, slot.start, slot.rows)
            if key in seen:  # a tied duplicate: the same rows, so it must carry the same change
                first, w0, v0 = seen[key]
                if not (torch.equal(where, w0) and torch.equal(values, v0)):
                    raise ValueError(f"delta push changes {first!r} and {name!r} differently, but they are one tensor")
                continue
            seen[key] = (name, where, values)
            if check_finite and not all_finite(values):
                raise ValueError(f"delta values of {name!r} hold NaN or inf")
            if slot.param_name in staged.adopted:
                raise ValueError(f"delta push sets {name!r} both whole and as changed elements")
            buffer = staged.staging.get(slot.param_name)
            if buffer is None and slot.param_name not in staged.swaps and self._needs_copy(slot, where):
                buffer = staged.staging[slot.param_name] = self._owned_copy(slot.param_name)
                staged.swaps[slot.param_name] = buffer
                staged.nbytes += buffer.nbytes
            if buffer is not None:
                put(slot.view(buffer).view(-1), where, values)
            else:
                staged.patches.append((slot, where, values))
                staged.nbytes += values.nbytes

    def stage_merges(self, staged: StagedUpdate, plan: LoraPlan | None) -> None:
        """Add an adapter push's merges to `staged`: each writes `base +
        scaling * B @ A` straight into its parameter's staging buffer (a
        spare one when there is one; the parameter's other rows copied from
        the live value), which the commit then installs like a whole push's.
        The merge runs here, in phase one, so the commit stays a rebind (or
        a device copy) and cannot fail; live weights are untouched. Raises
        `ValueError` when a merge overflows the dtype."""
        if plan is None or not plan.merges:
            return
        by_param: dict[str, list[tuple[str, WeightSlot]]] = {}
        for name in plan.merges:
            slot = self.slots[name]
            by_param.setdefault(slot.param_name, []).append((name, slot))
        for pname, merges in by_param.items():
            buffer = staged.staging.get(pname)
            if buffer is None:
                live = self._live[pname]
                buffer = self._spare.pop(pname, None)
                if buffer is None:
                    buffer = torch.empty_like(live)
                if sum(slot.rows for slot in {(s.start, s.rows): s for _, s in merges}.values()) < live.shape[0]:
                    buffer.copy_(live)  # the rows no adapter sets keep their value
                staged.staging[pname] = buffer
                if self.rebind:
                    staged.swaps[pname] = buffer
                else:
                    staged.copies.append((live, buffer))
                staged.nbytes += buffer.nbytes
            for name, slot in merges:
                base, adapter = plan.merges[name]
                if not merge_into(name, slot.view(buffer), base, adapter):
                    raise ValueError(
                        f"adapter of {name!r} makes values that are not finite in {buffer.dtype} "
                        "(the merge overflows, or the whole value sent with it holds NaN or inf)"
                    )
        staged.kept = frozenset(self.slots[name].param_name for name in plan.from_live)

    def _needs_copy(self, slot: WeightSlot, where: torch.Tensor) -> bool:
        if not self.rebind:  # a device's live weights are the engine's own; graphs hold their pointers
            return False
        return slot.param_name in self._adopted or where.numel() * DENSE > slot.rows * slot.param[0].numel()

    def _owned_copy(self, pname: str) -> torch.Tensor:
        """A staging buffer holding the live value of `pname`."""
        live = self._live[pname]
        buffer = self._spare.pop(pname, None)
        return torch.empty_like(live).copy_(live) if buffer is None else buffer.copy_(live)

    def _stage_param(self, pname: str, parts: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        live = self._live[pname]
        staging = self._spare.pop(pname, None)
        if staging is None:
            staging = torch.empty_like(live)
        if sum(rows for _, rows in parts) < live.shape[0]:
            staging.copy_(live)  # partial update of a fused parameter keeps the other rows
        for (start, rows), tensor in parts.items():
            staging.narrow(0, start, rows).copy_(tensor)
        return staging

    def commit(self, staged: StagedUpdate) -> None:
        """Install `staged` in the live parameters; call under the guard."""
        if staged.done:
            raise RuntimeError("this weight update was committed or discarded already")
        staged.done = True  # from here on its buffers belong to the live weights or the spare pool
        if staged.lora is not None:
            self.lora.commit(staged.lora)
        with torch.no_grad():
            for dst, src in staged.copies:
                dst.copy_(src)
            for pname, new in staged.swaps.items():
                param = self._live[pname]
                old, param.data = param.data, new
                if pname not in self._adopted and pname not in staged.adopted and pname not in staged.kept:
                    self._spare[pname] = old  # owned and replaced by owned: the next staging buffer
                self._adopted.discard(pname)
            self._adopted |= staged.adopted
            for slot, where, values in staged.patches:  # owned live weights: `stage_patches` checked
                put(slot.view().view(-1), where, values)
        # Copies write views whose parameter names are not kept: every derived copy goes then.
        patched = {slot.param_name for slot, _, _ in staged.patches}
        self.model.weights_changed(None if staged.copies else staged.swaps.keys() | patched)
        for pname, buffer in staged.staging.items():
            if pname not in staged.swaps:
                self._spare.setdefault(pname, buffer)

    def forget_buffers(self) -> None:
        """The live weights are being freed: drop the spare staging buffers with them."""
        self._spare.clear()
        self._adopted.clear()
        self.lora.clear()

    def release(self, staged: StagedUpdate) -> None:
        """`staged` will not be committed: its staging buffers become free again."""
        if not staged.done:
            for pname, buffer in staged.staging.items():
                self._spare.setdefault(pname, buffer)
            staged.done = True


def _same_kind(tensor: torch.Tensor, live: torch.Tensor) -> bool:
    return tensor.device == live.device and tensor.dtype == live.dtype


def _whole(live: torch.Tensor, parts: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor | None:
    """One tensor over the caller's memory holding all of `live`'s new rows:
    a single source, or sources that lie side by side in row order in one
    storage (fused q/k/v, gate/up); None when there is no such view."""
    ordered = sorted(parts.items())
    if sum(rows for (_, rows), _ in ordered) != live.shape[0] or ordered[0][0][0] != 0:
        return None
    first = ordered[0][1]
    storage, cursor = first.untyped_storage(), first.data_ptr()
    for _, t in ordered:
        if not (_same_kind(t, live) and t.is_contiguous() and t.data_ptr() == cursor):
            return None
        if t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        cursor += t.nbytes
    if len(ordered) == 1:
        return first.view(live.shape)
    return first.new_empty(0).set_(storage, first.storage_offset(), live.shape)
