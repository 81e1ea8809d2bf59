"""A PEFT LoRA model's adapters as an adapter push (`rollout.engine.weight_lora`):
per adapted weight, in the checkpoint's names, A, B and the scaling."""

from __future__ import annotations

import torch
from torch import nn

from rollout.engine.weight_lora import SCALING, A, B

from .names import canonical_name

_PEFT_PREFIX = "base_model.model."


def is_peft_lora(model) -> bool:
    """Whether `model` is a PEFT model with LoRA layers."""
    if not isinstance(model, nn.Module) or not hasattr(model, "peft_config"):
        return False
    return any(_is_lora_layer(m) for m in model.modules())


def _is_lora_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # a model with a peft_config but no peft: not one
        return False
    return isinstance(module, LoraLayer)


def checkpoint_name(peft_name: str) -> str:
    """A PEFT module's name as the checkpoint names its weight's module:
    `base_model.model.` and wrapper prefixes stripped."""
    name = canonical_name(peft_name)
    return name.removeprefix(_PEFT_PREFIX)


def export_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Per adapted weight `name`: `name@lora.A` (r x cols), `name@lora.B`
    (rows x r) in float32 and `name@lora.scaling`, so that the merged weight
    is `W + scaling * B @ A`. One active adapter per layer; DoRA, LoRA
    biases, `fan_in_fan_out` layers and `modules_to_save` raise `ValueError`."""
    out: dict[str, torch.Tensor] = {}
    for module_name, m in model.named_modules():
        if not _is_lora_layer(m):
            continue
        active = [a for a in m.active_adapters if a in m.r]
        if len(active) != 1:
            raise ValueError(f"{module_name}: adapter pushes take one active adapter per layer, got {active}")
        adapter = active[0]
        if m.use_dora.get(adapter) or getattr(m, "lora_bias", {}).get(adapter):
            raise ValueError(f"{module_name}: DoRA and LoRA biases cannot be pushed as adapters")
        if getattr(m, "fan_in_fan_out", False):
            raise ValueError(f"{module_name}: fan_in_fan_out (Conv1D) layers cannot be pushed as adapters")
        if adapter in getattr(m, "lora_A", {}):
            a, b = m.lora_A[adapter].weight, m.lora_B[adapter].weight  # W += s * B @ A
        elif adapter in getattr(m, "lora_embedding_A", {}):
            # An embedding's update is s * (B_e @ A_e).T = s * A_e.T @ B_e.T.
            a, b = m.lora_embedding_B[adapter].T, m.lora_embedding_A[adapter].T
        else:
            raise ValueError(f"{module_name}: a LoRA layer of a kind adapter pushes do not know ({type(m).__name__})")
        name = checkpoint_name(module_name) + ".weight"
        out[name + A] = a.detach().to(torch.float32).contiguous()
        out[name + B] = b.detach().to(torch.float32).contiguous()
        out[name + SCALING] = torch.tensor([float(m.scaling[adapter])], dtype=torch.float64)
    saved = [n for n, mod in model.named_modules() if type(mod).__name__ == "ModulesToSaveWrapper"]
    if saved:
        raise ValueError(f"modules_to_save ({saved[0]}) cannot be pushed as adapters: push the model whole")
    return out


def export_base(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's weights in the checkpoint's names, floating ones cast to `dtype`."""
    out = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        key = checkpoint_name(name).replace(".base_layer.", ".")
        tensor = tensor.detach()
        out[key] = tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor
    return out
