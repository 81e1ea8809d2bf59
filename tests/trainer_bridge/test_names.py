from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer_bridge import canonical_name, export_state_dict


@pytest.mark.parametrize(
    "name,expected",
    [
        ("module.model.norm.weight", "model.norm.weight"),
        ("_orig_mod.module.lm_head.weight", "lm_head.weight"),
        ("module._orig_mod.model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("model.layers.0._fsdp_wrapped_module.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("model.layers.1._checkpoint_wrapped_module.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"),
        ("model.norm.weight", "model.norm.weight"),
    ],
)
def test_wrapper_prefixes_are_stripped(name, expected):
    assert canonical_name(name) == expected


def test_export_casts_floats_and_keeps_other_dtypes():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(3, 2)
            self.register_buffer("steps", torch.tensor([4]))

    out = export_state_dict(Wrapped(), torch.bfloat16)
    assert set(out) == {"weight", "bias", "steps"}
    assert out["weight"].dtype == torch.bfloat16 and out["steps"].dtype == torch.int64
    assert not out["weight"].requires_grad


def test_export_errors():
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        export_state_dict([1, 2], torch.float32)
    with pytest.raises(TypeError, match="torch.Tensor"):
        export_state_dict({"a": 1.0}, torch.float32)
    with pytest.raises(ValueError, match="both map to"):
        export_state_dict({"module.a": torch.zeros(1), "a": torch.zeros(1)}, torch.float32)
