"""Random Qwen2-shaped checkpoints written straight to safetensors, for
benchmarks and soak runs that must not depend on transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def qwen2_config(vocab=32000, hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=8, max_positions=4096):
    return dict(
        model_type="qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=True,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        eos_token_id=2,
    )


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
