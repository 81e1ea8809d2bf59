"""`MoeConfig`: the mixture-of-experts part of a `config.json` (qwen3_moe,
mixtral), validated: how many experts, how many route each token, which
layers are sparse, and how the gate weights are normalised."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checks import is_int

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
# Expert ids are returned as int16 above 256 experts (`routed_dtype`), so at most 2**15.
MAX_EXPERTS = 2**15


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int  # experts per sparse layer
    top_k: int  # experts each token is routed to (`num_experts_per_tok`)
    intermediate_size: int  # of one expert (qwen3_moe `moe_intermediate_size`, mixtral `intermediate_size`)
    norm_topk_prob: bool  # the top-k gate weights are renormalised to sum to 1 (always for mixtral)
    sparse_layers: tuple[bool, ...]  # per layer: True = experts, False = a dense MLP
    # qwen3_moe casts the gate weights to the model's dtype before scaling the
    # experts' outputs; mixtral scales in float32 and rounds the product.
    weights_in_model_dtype: bool

    @property
    def num_moe_layers(self) -> int:
        return sum(self.sparse_layers)

    @property
    def moe_index(self) -> tuple[int | None, ...]:
        """Per layer, its index among the sparse layers (None for a dense one)."""
        out, n = [], 0
        for sparse in self.sparse_layers:
            out.append(n if sparse else None)
            n += sparse
        return tuple(out)


def moe_config(raw: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig | None:
    """The `MoeConfig` of a qwen3_moe or mixtral `config.json` (None for a dense
    family); raises `ValueError` naming the field on a bad value."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    # transformers >= 5 writes qwen3_moe's `num_experts` as `num_local_experts`.
    key = "num_local_experts" if model_type == "mixtral" or "num_experts" not in raw else "num_experts"
    experts = _int(raw, key, None, 1, MAX_EXPERTS)
    top_k = _int(raw, "num_experts_per_tok", 2, 1, experts)
    if model_type == "mixtral":
        inter = _int(raw, "intermediate_size", None, 1, 2**18)
        return MoeConfig(experts, top_k, inter, True, (True,) * num_layers, False)
    inter = _int(raw, "moe_intermediate_size", None, 1, 2**18)
    step = _int(raw, "decoder_sparse_step", 1, 1, num_layers)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(is_int(i) and 0 <= i < num_layers for i in dense):
        raise ValueError(f"config.json mlp_only_layers must be a list of layer indices in 0..{num_layers - 1}")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if not any(sparse):
        raise ValueError("config.json mlp_only_layers and decoder_sparse_step leave no sparse (expert) layer")
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"config.json norm_topk_prob must be true or false, got {norm!r}")
    return MoeConfig(experts, top_k, inter, norm, sparse, True)


def _int(raw: dict[str, Any], key: str, default: int | None, low: int, high: int) -> int:
    value = raw.get(key, default)
    if not is_int(value) or not low <= value <= high:
        raise ValueError(f"config.json {key} must be an integer in {low}..{high}, got {value!r}")
    return int(value)
