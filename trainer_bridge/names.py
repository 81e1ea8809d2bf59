"""Turning a training model's parameters into the engine's checkpoint names
and dtype: wrapper prefixes stripped, floating tensors cast."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

# Prefixes wrappers put in front of parameter names (DDP, torch.compile).
_LEADING = ("module.", "_orig_mod.")
# Path components wrappers insert anywhere (FSDP1, activation checkpointing).
_INNER = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """`name` without DDP/compile/FSDP/checkpointing wrapper components."""
    changed = True
    while changed:
        changed = False
        for prefix in _LEADING:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    for part in _INNER:
        name = name.replace(part, "")
    return name


def export_state_dict(model_or_state: nn.Module | Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """The weights to push: canonical names, detached, floating tensors cast to `dtype`.

    Raises `TypeError` for anything but an `nn.Module` or a mapping of
    tensors, and `ValueError` when two names collapse to one.
    """
    if isinstance(model_or_state, nn.Module):
        state = model_or_state.state_dict()
    elif isinstance(model_or_state, Mapping):
        state = model_or_state
    else:
        raise TypeError(f"push takes an nn.Module or a state dict, got {type(model_or_state).__name__}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        key = canonical_name(name)
        if key in out:
            raise ValueError(f"state dict names {name!r} and another both map to {key!r}")
        tensor = tensor.detach()
        out[key] = tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor
    return out
