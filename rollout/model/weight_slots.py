"""Where each checkpoint tensor lives in the model: q/k/v and gate/up are
fused into one parameter each, so a checkpoint name maps onto rows of a
parameter (`WeightSlot`). The loader and weight updates both use the map.
Experts are stacked along rows too (`moe.py`), so one expert is a row range
and transformers' fused `[experts, ...]` tensors are the whole parameter
seen with their own shape (`dims`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .decoder import Model


@dataclass(frozen=True, slots=True)
class WeightSlot:
    """Where one checkpoint tensor lives: rows `[start, start + rows)` of `param`."""

    param_name: str  # name of the (possibly fused) live parameter
    param: torch.Tensor  # the live parameter
    start: int  # first row along dim 0
    rows: int  # number of rows along dim 0
    dims: tuple[int, ...] | None = None  # the checkpoint tensor's shape when not (rows, *param.shape[1:])

    @property
    def shape(self) -> tuple[int, ...]:
        return self.dims or (self.rows, *self.param.shape[1:])

    def view(self, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """This slot's rows of `tensor` (default: the live parameter), in the checkpoint's shape."""
        target = self.param if tensor is None else tensor
        rows = target.narrow(0, self.start, self.rows)
        return rows if self.dims is None else rows.view(self.dims)

    def as_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor of this slot laid out as the parameter's rows (a view when contiguous)."""
        return tensor if self.dims is None else tensor.reshape(self.rows, *self.param.shape[1:])


def weight_slots(model: Model) -> dict[str, WeightSlot]:
    """Checkpoint (Hugging Face) tensor name -> where it lives in `model`.

    With tied embeddings `lm_head.weight` maps onto the embedding too,
    so a full `state_dict()` of the reference model is accepted.
    """
    from .moe import expert_slots  # moe.py builds slots itself

    cfg = model.cfg
    slots: dict[str, WeightSlot] = {}

    def add(name: str, pname: str, param, start: int = 0, rows: int | None = None) -> None:
        slots[name] = WeightSlot(pname, param, start, param.shape[0] if rows is None else rows)

    add("model.embed_tokens.weight", "embed", model.embed)
    add("model.norm.weight", "norm", model.norm)
    tied = model.lm_head is None
    add("lm_head.weight", "embed" if tied else "lm_head", model.embed if tied else model.lm_head)
    qkv_rows = {"q": (0, cfg.q_size), "k": (cfg.q_size, cfg.kv_size), "v": (cfg.q_size + cfg.kv_size, cfg.kv_size)}
    inter = cfg.intermediate_size
    for i, layer in enumerate(model.layers):
        p, lp = f"model.layers.{i}.", f"layers.{i}."
        add(p + "input_layernorm.weight", lp + "input_norm", layer.input_norm)
        add(p + "post_attention_layernorm.weight", lp + "post_norm", layer.post_norm)
        add(p + "self_attn.o_proj.weight", lp + "o_proj", layer.o_proj)
        if layer.o_bias is not None:
            add(p + "self_attn.o_proj.bias", lp + "o_bias", layer.o_bias)
        for proj, (start, rows) in qkv_rows.items():
            add(p + f"self_attn.{proj}_proj.weight", lp + "qkv", layer.qkv, start, rows)
            if layer.qkv_bias is not None:
                add(p + f"self_attn.{proj}_proj.bias", lp + "qkv_bias", layer.qkv_bias, start, rows)
        if layer.q_norm is not None:
            add(p + "self_attn.q_norm.weight", lp + "q_norm", layer.q_norm)
            add(p + "self_attn.k_norm.weight", lp + "k_norm", layer.k_norm)
        if layer.mlp is not None:
            slots.update(expert_slots(cfg, i, layer.mlp))
            continue
        add(p + "mlp.down_proj.weight", lp + "down", layer.down)
        add(p + "mlp.gate_proj.weight", lp + "gate_up", layer.gate_up, 0, inter)
        add(p + "mlp.up_proj.weight", lp + "gate_up", layer.gate_up, inter, inter)
    return slots
