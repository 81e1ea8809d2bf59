"""`ModelConfig`: the architecture read from a Hugging Face `config.json`,
validated, for the Llama family (llama, qwen2, qwen3, mistral) and its
mixture-of-experts variants (qwen3_moe, mixtral; `moe_config.py`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checks import is_int, is_number
from .moe_config import MOE_MODEL_TYPES, MoeConfig, moe_config

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", *MOE_MODEL_TYPES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Upper bounds on a config's sizes, checked as it is parsed so that a corrupt
# or hostile config.json fails before anything is allocated from it. Each is
# far above the largest public models: Llama-3.1-405B (hidden 16384,
# intermediate 53248, 126 layers, 128 heads, vocab 128256), Gemma 3 (vocab
# 262144, head_dim 256), Llama 4 Scout (10M positions, rope factor 16),
# DeepSeek-V3 (rope factor 40).
MAX_SIZES = {
    "vocab_size": 2**21,
    "hidden_size": 2**16,
    "intermediate_size": 2**18,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 2**24,
    "original_max_position_embeddings": 2**24,
    "sliding_window": 2**24,
}
MAX_ROPE_FACTOR = 1024.0  # linear/llama3 `factor`, `low_freq_factor` and `high_freq_factor`
# Sizes derived from several fields. A sequence is at most max_position_embeddings
# tokens (the engine's max_seq_len defaults to it and may not exceed it), so these
# bound the rotary table for any accepted max_seq_len and the KV one token takes.
MAX_ROTARY_ELEMENTS = 2**32  # max_position_embeddings x head_dim (cos and sin each)
MAX_KV_ELEMENTS_PER_TOKEN = 2**24  # 2 (K and V) x num_hidden_layers x num_key_value_heads x head_dim


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
    moe: MoeConfig | None = None  # experts (qwen3_moe, mixtral); None for a dense model

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
        sizes = _sizes(raw)
        layers, max_pos = sizes["num_layers"], sizes["max_position_embeddings"]
        return cls(
            model_type=model_type,
            **sizes,
            rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6, 0.0, 1.0),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope=_rope(raw, max_pos),
            sliding_windows=_sliding_windows(raw, model_type, layers),
            eos_token_ids=_eos_ids(raw, generation_config or {}),
            moe=moe_config(raw, model_type, layers),
        )


def _sizes(raw: dict[str, Any]) -> dict[str, int]:
    """The model's sizes, each within `MAX_SIZES`, and the sizes derived from
    them within their bounds: all checked before anything is built."""
    hidden = _size(raw, "hidden_size")
    heads = _size(raw, "num_attention_heads")
    kv_heads = _size(raw, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    head_dim = _size({"head_dim": raw.get("head_dim") or hidden // heads}, "head_dim")
    if head_dim % 2:
        raise ValueError(f"config.json head_dim must be even (rotary embeddings turn pairs of dims), got {head_dim}")
    layers = _size(raw, "num_hidden_layers")
    max_pos = _size(raw, "max_position_embeddings", default=2048)
    _check_bound("max_position_embeddings x head_dim (the rotary table)", max_pos * head_dim, MAX_ROTARY_ELEMENTS)
    kv_per_token = 2 * layers * kv_heads * head_dim
    _check_bound(
        "2 x num_hidden_layers x num_key_value_heads x head_dim (the KV of one token)",
        kv_per_token,
        MAX_KV_ELEMENTS_PER_TOKEN,
    )
    return dict(
        vocab_size=_size(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_size(raw, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
    )


def _size(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    """`raw[key]` (or `default`): an int in 1 .. `MAX_SIZES[key]`."""
    value, cap = raw.get(key, default), MAX_SIZES[key]
    if not is_int(value) or not 1 <= value <= cap:
        raise ValueError(f"config.json {key} must be an integer in 1..{cap}, got {value!r}")
    return int(value)


def _check_bound(what: str, value: int, cap: int) -> None:
    if value > cap:
        raise ValueError(f"config.json {what} is {value}, above the cap of {cap}")


def _number(
    raw: dict[str, Any], key: str, default: float | None, low: float, high: float, open_low: bool = False
) -> float:
    """`raw[key]` (or `default`): a finite number in [low, high], or (low, high] when `open_low`."""
    value = raw.get(key, default)
    above = is_number(value) and (value > low if open_low else value >= low)
    if not (above and math.isfinite(value) and value <= high):
        allowed = f"{'(' if open_low else '['}{low}, {high}]"
        raise ValueError(f"config.json {key} must be a finite number in {allowed}, got {value!r}")
    return float(value)


def _rope(raw: dict[str, Any], max_pos: int) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older
    # checkpoints write `rope_theta` plus an optional `rope_scaling`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json rope_parameters (or rope_scaling) must be an object, got {params!r}")
    theta = _number(params if "rope_theta" in params else raw, "rope_theta", 10000.0, 0.0, math.inf, open_low=True)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=theta, type="default")
    factor = _number(params, "factor", None, 1.0, MAX_ROPE_FACTOR)
    if rope_type == "linear":
        return RopeConfig(theta=theta, type="linear", factor=factor)
    low = _number(params, "low_freq_factor", None, 0.0, MAX_ROPE_FACTOR, open_low=True)
    # llama3 interpolates between the two wavelengths, dividing by high - low.
    high = _number(params, "high_freq_factor", None, low, MAX_ROPE_FACTOR, open_low=True)
    original = _size({"original_max_position_embeddings": max_pos} | params, "original_max_position_embeddings")
    return RopeConfig(theta, "llama3", factor, low, high, original)


def _sliding_windows(raw: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * layers
    window = _size({"sliding_window": window}, "sliding_window")  # null (no window) was handled above
    types = raw.get("layer_types")
    if types is None:
        if model_type in ("mistral", "mixtral"):
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
