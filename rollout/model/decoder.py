"""The Llama-family decoder (llama, qwen2, qwen3, mistral) on paged KV, and
its mixture-of-experts variants (qwen3_moe, mixtral), whose sparse layers
(`moe.py`) take the place of the dense MLP.

q/k/v and gate/up projections are fused into one matrix each; `weight_slots`
(`weight_slots.py`) maps every checkpoint tensor name onto its rows of a
fused parameter. The GEMM backends and packed weights are in `linear.py`.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from workspace import KVPool

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .linear import SKINNY_MAX_ROWS, PackedWeights, gemm_plan, onednn_bf16, onednn_linear, pick_linear
from .moe import SparseMLP, sparse_mlp
from .rope import RotaryTable
from .weight_slots import WeightSlot, weight_slots


def _empty(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as the reference: normalise in float32, cast
    # back, then scale, so low-precision dtypes round identically.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, sparse: bool = False) -> None:
        super().__init__()
        h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
        self.input_norm = _empty(h, dtype=dtype, device=device)
        self.qkv = _empty(qkv, h, dtype=dtype, device=device)
        self.qkv_bias = _empty(qkv, dtype=dtype, device=device) if cfg.attention_bias else None
        self.q_norm = _empty(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = _empty(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.o_proj = _empty(h, cfg.q_size, dtype=dtype, device=device)
        self.o_bias = _empty(h, dtype=dtype, device=device) if cfg.o_bias else None
        self.post_norm = _empty(h, dtype=dtype, device=device)
        # A sparse layer's router and experts (`moe.py`) replace the dense gate/up and down.
        self.mlp = SparseMLP(cfg, dtype, device) if sparse else None
        self.gate_up = None if sparse else _empty(2 * cfg.intermediate_size, h, dtype=dtype, device=device)
        self.down = None if sparse else _empty(h, cfg.intermediate_size, dtype=dtype, device=device)


class Model(nn.Module):
    """Decoder weights plus the forward pass of one flattened step.

    With `kernels` (`rollout.kernels.layer_ops`) whose elementwise ops apply to
    the weights' dtype, RMSNorm (fused with the residual add), the q/k norms and
    rotary embedding with the KV write, and SiLU-times-up each run as one op.
    The compiled CPU kernels apply to float32 weights; projections then run on
    oneDNN where torch has it (`pick_linear`, named by `self.gemm`), and a
    pure-decode step runs all its layers in one op (`decode_layers`), the same
    kernels without the interpreter between them. The Triton kernels apply to
    every dtype and keep torch's GEMMs. Otherwise the torch ops run, whose
    bf16/fp16 rounding steps the reference shares.

    `matmul_dtype` bfloat16 under float32 weights: the layers' projections
    (qkv, o, gate/up, down) multiply bfloat16 copies of their weights (and
    biases) by their inputs rounded to bfloat16, accumulating in float32, and
    their outputs, rounded to bfloat16 as the GEMM writes them, widen back to
    float32. Everything else stays float32: embeddings, norms, the residual
    stream, rotary, attention, and the LM head, whose logits a bfloat16 output
    would round by up to 1/32 at magnitudes near 10. On CPUs with bfloat16
    instructions oneDNN runs those GEMMs faster than float32 ones (figures in
    docs/benchmarks.md).
    """

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device, max_positions: int, kernels=None, matmul_dtype=None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self._ops = kernels if kernels is not None and kernels.fuses(dtype, device) else None
        self._cpu = self._ops.lib if self._ops is not None else None  # the compiled CPU library, for the GEMMs
        self._matmul_dtype = dtype if matmul_dtype is None else matmul_dtype
        self._narrow = self._matmul_dtype != dtype  # bfloat16 projections under float32 weights
        self.gemm, self._linear = "torch", F.linear
        if self._cpu is not None:
            self.gemm, self._linear = pick_linear(cfg.hidden_size)
        self.embed = _empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        sparse = cfg.moe.sparse_layers if cfg.moe is not None else (False,) * cfg.num_layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, s) for s in sparse)
        self.norm = _empty(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            None if cfg.tie_word_embeddings else _empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, max_positions, dtype, device)
        self.scale = cfg.head_dim**-0.5
        # (name, parameter) of each layer's projections: qkv, o_proj, then gate_up, down in a dense
        # layer; and of the LM head. Commits rebind the parameters' data, never the parameters.
        kinds = ("qkv", "o_proj", "gate_up", "down")
        self._projections = [
            tuple((f"layers.{i}.{k}", getattr(layer, k)) for k in kinds if getattr(layer, k) is not None)
            for i, layer in enumerate(self.layers)
        ]
        self._head = ("embed", self.embed) if self.lm_head is None else ("lm_head", self.lm_head)
        # bfloat16 projections on oneDNN where it multiplies bfloat16 here, else on torch's F.linear
        self._narrow_onednn = self._narrow and self.gemm == "onednn" and onednn_bf16()
        self.packed = self._gemm_copies(pack=self.gemm == "onednn")
        # Pure-decode steps run all layers in one op (`decode_layers`) when every kernel it calls applies.
        self._one_op = self._cpu is not None and self.gemm == "onednn"
        self._one_op &= self._narrow_onednn or not self._narrow
        self._biases = [b for layer in self.layers for b in (layer.qkv_bias, layer.o_bias)]
        self._norms = [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)]
        self._head_norms = [n for layer in self.layers for n in (layer.q_norm, layer.k_norm)] if cfg.qk_norm else []
        self._experts = [
            [] if (m := layer.mlp) is None else [m.router, m.experts_gate_up, m.experts_down] for layer in self.layers
        ]
        moe = cfg.moe
        self._moe_args = (
            ([-1] * cfg.num_layers, 1, False)
            if moe is None
            else ([-1 if i is None else i for i in moe.moe_index], moe.top_k, moe.norm_topk_prob)
        )
        self._windows = [w or 0 for w in cfg.sliding_windows]

    def pack_weights(self) -> None:
        """After loading: packs the first weight now, which proves oneDNN's reorder
        works here (without it every projection stays on its plain weight, with a
        warning); the first steps pack the rest, `per_step` each
        (`PackedWeights.start_step`), so start-up does not wait for them."""
        if self.packed is None:
            return
        try:
            self.packed.start_step()
        except RuntimeError as exc:
            message = f"packing weights for oneDNN failed ({exc}); projections use plain weights"
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            self._narrow_onednn = False
            self._one_op &= not self._narrow
            self.packed = self._gemm_copies(pack=False)

    def weights_changed(self, names=None) -> None:
        """The parameters `names` (all when None) were given new values; call under the engine's guard."""
        if self.packed is not None:
            self.packed.changed(names)

    def _gemm_copies(self, pack: bool) -> PackedWeights | None:
        """The copies the GEMMs multiply by: under a bfloat16 `matmul_dtype`, the
        projections in bfloat16; with `pack`, oneDNN's blocked copies of the LM
        head and of the projections (the bfloat16 ones only where oneDNN
        multiplies them). None when there are none: the GEMMs take the live weights."""
        projections = dict(p for layer in self._projections for p in layer)
        narrow = frozenset(projections) if self._narrow else frozenset()
        packed = {self._head[0]} if pack else set()
        if pack and (self._narrow_onednn or not self._narrow):
            packed.update(projections)
        params = {name: w for name, w in [*projections.items(), self._head] if name in packed | narrow}
        return PackedWeights(params, frozenset(packed), narrow, self._matmul_dtype) if params else None

    def _weight(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The tensor a GEMM multiplies by for the parameter `name` (`weight`): its
        packed (or bfloat16) copy when there is one."""
        return weight if self.packed is None or name not in self.packed.names else self.packed.weight(name)

    def _project(self, x: torch.Tensor, name: str, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if self._narrow and name != self._head[0]:  # bfloat16 in, float32 accumulation, bfloat16 out
            if self._skinny(x.shape[0]):  # rounds the plain float32 weight as it reads it
                return self._cpu.skinny_linear_bf16(x, weight, bias)
            dt, linear = self._matmul_dtype, onednn_linear if self._narrow_onednn else F.linear
            bias = None if bias is None else bias.to(dt)
            return linear(x.to(dt), self._weight(name, weight), bias).to(x.dtype)
        if self._skinny(x.shape[0]):
            return self._cpu.skinny_linear(x, weight, bias)
        return self._linear(x, self._weight(name, weight), bias)

    def _skinny(self, rows: int) -> bool:
        """Whether a step of `rows` rows projects with `skinny_linear` (`skinny_linear_bf16` for
        bfloat16 projections), on the plain float32 weights."""
        return self._cpu is not None and 0 < rows <= SKINNY_MAX_ROWS  # 0: a step that samples nothing

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVPool,
        sample_rows: torch.Tensor,
    ) -> torch.Tensor:
        """float32 logits `[R, vocab]` of the token rows `sample_rows` `[R]`.

        `input_ids`, `positions`: `[T]`, the step's flattened tokens.
        """
        return self.logits(self.hidden(input_ids, positions, meta, kv).index_select(0, sample_rows))

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVPool):
        """The last layer's hidden states `[T, hidden]` of the step's tokens, before the final norm."""
        h = F.embedding(input_ids, self.embed)
        eps = self.cfg.rms_norm_eps
        if self.packed is not None:
            self.packed.start_step()
        if self._ops is not None:
            h = self._fused_layers(h, positions, meta, kv)
        else:
            for i, layer in enumerate(self.layers):
                h = h + self._attention(i, layer, rms_norm(h, layer.input_norm, eps), positions, meta, kv)
                h = h + self._mlp(i, layer, rms_norm(h, layer.post_norm, eps), kv, meta.slot_mapping)
        return h

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits `[R, vocab]` of hidden states `h` `[R, hidden]` (from `hidden`)."""
        return self._project(self._norm(h, self.norm), *self._head).float()

    @torch.inference_mode()
    def head_slices(self, h: torch.Tensor, size: int):
        """`logits(h)` a slice of the vocabulary at a time: (first token id, float32
        logits `[R, size]`, the last slice shorter) pairs, in id order. Each is the
        GEMM of the normed rows with a view of the head's rows (oneDNN takes a plain
        weight without the packed copy), so no `[R, vocab]` logits exist at once."""
        x, weight = self._norm(h, self.norm), self._head[1]
        for first in range(0, weight.shape[0], size):
            yield first, self._linear(x, weight[first : first + size]).float()

    def _fused_layers(self, h, positions, meta, kv) -> torch.Tensor:
        """The layers with each residual add folded into the next RMSNorm; `h` is updated in place."""
        eps, ops = self.cfg.rms_norm_eps, self._ops
        x = torch.empty_like(h)
        if self._one_op and not meta.prefills and meta.decode_kernel is not None:
            return self._decode_layers(h, x, positions, meta, kv)
        ops.rms_norm(h, self.layers[0].input_norm, eps, x)
        for i, layer in enumerate(self.layers):
            ops.add_rms_norm_(h, self._attention(i, layer, x, positions, meta, kv), layer.post_norm, eps, x)
            mlp = self._mlp(i, layer, x, kv, meta.slot_mapping)
            if i + 1 < len(self.layers):
                ops.add_rms_norm_(h, mlp, self.layers[i + 1].input_norm, eps, x)
            else:
                h += mlp
        return h

    def _decode_layers(self, h, x, positions, meta, kv) -> torch.Tensor:
        """`_fused_layers` for a pure-decode step, all in one op (`csrc/decode_layers.cpp`): the same
        kernels in the same order, without the interpreter between them; `h` is updated in place."""
        skinny = self._skinny(h.shape[0])
        weights = [
            w
            for layer, experts in zip(self._projections, self._experts, strict=True)
            for w in (*(param if skinny else self._weight(name, param) for name, param in layer), *experts)
        ]
        cfg, rotary = self.cfg, self.rotary
        self._cpu.decode_layers(
            *(h, x, weights, self._biases, self._norms, self._head_norms, *self._moe_args, kv.routing),
            *(cfg.rms_norm_eps, positions, rotary.cos, rotary.sin),
            *(kv.k, kv.v, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens),
            *(self._windows, self.scale, cfg.num_heads, skinny, self._narrow),
            [n for piece in gemm_plan(h.shape[0]) for n in piece],
        )
        return h

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._ops is None:
            return rms_norm(x, weight, self.cfg.rms_norm_eps)
        out = torch.empty_like(x)
        self._ops.rms_norm(x, weight, self.cfg.rms_norm_eps, out)
        return out

    def _attention(self, i, layer, x, positions, meta, kv) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        qkv_proj, o_proj = self._projections[i][:2]
        qkv = self._project(x, *qkv_proj, layer.qkv_bias)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        if self._ops is not None:  # q/k norms, rotary, and the write of k and v to the pool
            rotary = self.rotary
            q = self._ops.norm_rope_and_cache_(
                *(q, k, v, layer.q_norm, layer.k_norm, cfg.rms_norm_eps, positions, rotary.cos, rotary.sin),
                *(kv.k[i], kv.v[i], meta.slot_mapping),
            )
        else:
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            q, k = self.rotary.apply(q, k, positions)
            kv.write(i, meta.slot_mapping, k, v)
        o = paged_attention(q, i, kv, meta, self.scale, cfg.sliding_windows[i])
        return self._project(o.reshape(t, cfg.q_size), *o_proj, layer.o_bias)

    def _mlp(self, i, layer, x, kv, slots) -> torch.Tensor:
        if layer.mlp is not None:  # the experts chosen go to the pool with the tokens' KV
            moe = self.cfg.moe
            out, experts = sparse_mlp(x, layer.mlp, moe, self._ops)
            if kv.routing is not None:
                kv.write_routing(moe.moe_index[i], slots, experts)
            return out
        _, _, gate_up_proj, down_proj = self._projections[i]
        gate_up = self._project(x, *gate_up_proj)
        if self._ops is not None:
            act = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            self._ops.silu_mul(gate_up, act)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self._project(act, *down_proj)

    def weight_slots(self) -> dict[str, WeightSlot]:
        """Checkpoint tensor name -> where it lives here (see `weight_slots.py`)."""
        return weight_slots(self)
