"""`ModelConfig`: the architecture read from a Hugging Face `config.json`,
validated, for the Llama family (llama, qwen2, qwen3, mistral)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checks import is_int

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float  # base wavelength
    type: str  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear / llama3 scaling factor
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (qwen2, or attention_bias)
    o_bias: bool  # the output projection carries a bias (llama/qwen3 with attention_bias)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (qwen3)
    rope: RopeConfig
    sliding_windows: tuple[int | None, ...]  # per layer: window in tokens, None = full
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        file = path / "config.json"
        if not path.is_dir():
            raise ValueError(f"model path {str(path)!r} is not a directory")
        if not file.is_file():
            raise ValueError(f"model path {str(path)!r} has no config.json")
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"config.json in {str(path)!r} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"config.json in {str(path)!r} must hold a JSON object")
        gen = path / "generation_config.json"
        gen_raw = json.loads(gen.read_text()) if gen.is_file() else {}
        return cls.from_dict(raw, generation_config=gen_raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act {raw['hidden_act']!r} is not supported; supported: 'silu'")
        if raw.get("mlp_bias", False):
            raise ValueError("config.json mlp_bias=true is not supported")
        hidden = _pos_int(raw, "hidden_size")
        heads = _pos_int(raw, "num_attention_heads")
        kv_heads = _pos_int(raw, "num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        head_dim = raw.get("head_dim") or hidden // heads
        layers = _pos_int(raw, "num_hidden_layers")
        max_pos = _pos_int(raw, "max_position_embeddings", default=2048)
        return cls(
            model_type=model_type,
            vocab_size=_pos_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_pos_int(raw, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_pos_int({"head_dim": head_dim}, "head_dim"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            rope=_rope(raw, max_pos),
            sliding_windows=_sliding_windows(raw, model_type, layers),
            eos_token_ids=_eos_ids(raw, generation_config or {}),
        )


def _pos_int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not is_int(value) or value < 1:
        raise ValueError(f"config.json {key} must be a positive integer, got {value!r}")
    return value


def _rope(raw: dict[str, Any], max_pos: int) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older
    # checkpoints write `rope_theta` plus an optional `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"config.json rope_theta must be a positive number, got {theta!r}")
    if raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=theta, type="default")
    factor = float(params.get("factor", 0))
    if not factor >= 1.0:
        raise ValueError(f"config.json rope factor must be >= 1 for rope type {rope_type!r}, got {factor!r}")
    if rope_type == "linear":
        return RopeConfig(theta=theta, type="linear", factor=factor)
    return RopeConfig(
        theta=theta,
        type="llama3",
        factor=factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", max_pos)),
    )


def _sliding_windows(raw: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * layers
    if not is_int(window) or window < 1:
        raise ValueError(f"config.json sliding_window must be a positive integer or null, got {window!r}")
    types = raw.get("layer_types")
    if types is None:
        if model_type == "mistral":
            types = ["sliding_attention"] * layers
        else:
            first = int(raw.get("max_window_layers", 0))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"config.json layer_types has {len(types)} entries for {layers} layers")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _eos_ids(raw: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (raw, gen):
        value = source.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if is_int(v) and v not in ids:
                ids.append(v)
    return tuple(ids)
