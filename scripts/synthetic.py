"""Random Qwen2-shaped checkpoints written straight to safetensors, for
benchmarks and soak runs that must not depend on transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scripts.presets import preset


def qwen2_config(name: str = "bench-sync", **overrides) -> dict:
    """A preset of scripts/presets.py (the weight-sync benchmark's by default)
    as the config.json of the tied Qwen2 checkpoints this module writes."""
    cfg = preset(name, **overrides)
    if cfg["model_type"] != "qwen2" or not cfg["tie_word_embeddings"]:
        raise ValueError(f"synthetic checkpoints are tied Qwen2 models; preset {name!r} is not")
    return cfg


def qwen2_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of a tied Qwen2 model."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def random_state(cfg: dict, seed: int, scale: float = 0.02) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in qwen2_shapes(cfg).items():
        t = torch.randn(shape, generator=g) * scale
        state[name] = t + 1.0 if name.endswith("norm.weight") else t
    return state


def write_checkpoint(path: str | Path, cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write config.json and model.safetensors of random weights; returns the state dict."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = random_state(cfg, seed)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return state
