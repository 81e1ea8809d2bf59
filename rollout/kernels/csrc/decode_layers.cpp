// The decoder layers of a pure-decode step as one op, float32 on the CPU.
//
// Model._fused_layers issues about 25 calls from Python per layer around its
// four GEMMs (projections, views, the fused elementwise ops, attention). This
// op makes the same calls in the same order from C++: the GEMMs through
// oneDNN's linear (the op `onednn_linear` calls), or with `skinny` (steps of
// at most two rows, on plain weights) through skinny_linear, the rest straight
// into this library's kernels. Its results equal the Python loop's bit for bit;
// what it saves is the interpreter's time between the calls, which at decode
// batch sizes is a visible share of a step. With `bf16` (Model's matmul_dtype
// bfloat16) each GEMM takes its input rounded to bfloat16 and bfloat16 weights
// and biases, and its bfloat16 output widens back to float32, as in
// Model._project; with `skinny` too, skinny_linear_bf16 does that rounding on
// the plain float32 weights.
//
// Layout of the lists, for L layers: `weights` holds per layer qkv and o, then
// gate_up and down for a dense layer, or the router, the experts' stacked
// gate_up and their down for a sparse one (`moe_index[i]` >= 0: its index among
// the sparse layers); the projections packed or plain, as the caller chooses.
// `biases` holds qkv and o per layer (None when absent), `norms` the input and
// post-attention RMSNorm weights per layer, `head_norms` qwen3's q and k norms
// per layer (empty when the model has none), and `windows` each layer's sliding
// window (0: none). A sparse layer runs `moe_block` (csrc/moe_block.cpp) and,
// with `routing` (the KV pool's routing pages), stores the experts each token
// went to at its KV slot, as KVPool.write_routing does.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

// oneDNN's matmul, as torch's own compiler emits it for CPU linears, in the
// calls `plan` lists as (rows, padded rows) pairs, in row order: padding rows
// are zeros and their outputs are dropped. rollout/model/linear.py's
// gemm_plan makes the plan, which bounds the shapes oneDNN builds and caches
// a primitive for; its onednn_linear runs the same calls.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::IntArrayRef plan) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  const auto call = [&](const at::Tensor& input) {
    return op.call(input, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  };
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  for (size_t i = 0; i + 1 < plan.size(); i += 2) {
    const int64_t rows = plan[i], padded = plan[i + 1];
    const at::Tensor part = x.narrow(0, start, rows);
    start += rows;
    if (padded == rows) {
      outs.push_back(call(part));
      continue;
    }
    at::Tensor input = at::empty({padded, x.size(1)}, x.options());
    input.narrow(0, 0, rows).copy_(part);
    input.narrow(0, rows, padded - rows).zero_();
    outs.push_back(call(input).narrow(0, 0, rows));
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs);
}

void decode_layers(at::Tensor h, at::Tensor x, at::TensorList weights,
                   const c10::List<std::optional<at::Tensor>>& biases, at::TensorList norms,
                   at::TensorList head_norms, at::IntArrayRef moe_index, int64_t top_k, bool normalize,
                   const std::optional<at::Tensor>& routing, double eps, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, at::IntArrayRef windows,
                   double scale, int64_t num_heads, bool skinny, bool bf16, at::IntArrayRef gemm_plan) {
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(layers >= 1, "decode_layers needs at least one layer");
  TORCH_CHECK(static_cast<int64_t>(moe_index.size()) == layers, "moe_index must have one entry per layer (",
              layers, "), got ", moe_index.size());
  std::vector<int64_t> first(layers + 1);  // each layer's first entry in `weights`
  for (int64_t i = 0; i < layers; ++i) first[i + 1] = first[i] + (moe_index[i] >= 0 ? 5 : 4);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == first[layers] &&
                  static_cast<int64_t>(biases.size()) == 2 * layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers &&
                  (head_norms.empty() || static_cast<int64_t>(head_norms.size()) == 2 * layers),
              "decode_layers takes 4 weights (5 for a sparse layer), 2 biases, 2 norms and 0 or 2 head norms per "
              "layer for ", layers, " layers; got ", weights.size(), ", ", biases.size(), ", ", norms.size(), " and ",
              head_norms.size());
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == layers, "k_cache must be [", layers,
              ", pages, page_size, kv_heads, head_dim], got ", k_cache.sizes());
  TORCH_CHECK(h.dim() == 2 && x.sizes() == h.sizes(), "h and x must be [rows, hidden] alike, got ", h.sizes(), " and ",
              x.sizes());
  TORCH_CHECK(!routing.has_value() || (routing->dim() == 4 && routing->size(3) == top_k),
              "routing must be [sparse layers, pages, page_size, ", top_k, "]");
  int64_t planned = 0;
  bool plan_ok = gemm_plan.size() % 2 == 0 && !gemm_plan.empty();
  for (size_t i = 0; plan_ok && i < gemm_plan.size(); i += 2) {
    plan_ok = gemm_plan[i] >= 0 && gemm_plan[i + 1] >= gemm_plan[i];
    planned += gemm_plan[i];
  }
  TORCH_CHECK(plan_ok && planned == h.size(0), "gemm_plan must be (rows, padded rows) pairs covering the ", h.size(0),
              " rows, got ", gemm_plan);
  const int64_t rows = h.size(0), kv_heads = k_cache.size(3), head_dim = k_cache.size(4);
  const int64_t q_size = num_heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(weights[0].size(0) == q_size + 2 * kv_size, "the qkv weight has ", weights[0].size(0), " rows, not ",
              q_size + 2 * kv_size, " (", num_heads, " query and ", kv_heads, " KV heads of ", head_dim, ")");

  const auto linear = [skinny, bf16, gemm_plan](const at::Tensor& input, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& bias) {
    if (skinny && bf16) return rollout_cpu::skinny_linear_bf16(input, weight, bias);
    if (bf16) {
      const std::optional<at::Tensor> narrow_bias =
          bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kBFloat16)) : std::nullopt;
      return onednn_linear(input.to(at::kBFloat16), weight, narrow_bias, gemm_plan).to(at::kFloat);
    }
    return skinny ? rollout_cpu::skinny_linear(input, weight, bias) : onednn_linear(input, weight, bias, gemm_plan);
  };
  rollout_cpu::rms_norm(h, norms[0], eps, x);
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + first[i];
    const at::Tensor qkv = linear(x, w[0], biases.get(2 * i));
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
    if (!head_norms.empty()) {
      rollout_cpu::head_rms_norm_(q, head_norms[2 * i], eps);
      rollout_cpu::head_rms_norm_(k, head_norms[2 * i + 1], eps);
    }
    const at::Tensor k_layer = k_cache.select(0, i), v_layer = v_cache.select(0, i);
    rollout_cpu::rope_and_cache_(q, k, v, positions, cos, sin, k_layer, v_layer, slots);
    at::Tensor attn = at::empty({rows, num_heads, head_dim}, x.options());
    rollout_cpu::paged_decode(q, k_layer, v_layer, block_tables, context_lens, attn, scale, windows[i]);
    const at::Tensor o = linear(attn.view({rows, q_size}), w[1], biases.get(2 * i + 1));
    rollout_cpu::add_rms_norm_(h, o, norms[2 * i + 1], eps, x);
    at::Tensor mlp;
    if (moe_index[i] >= 0) {
      at::Tensor experts;
      std::tie(mlp, experts) = rollout_cpu::moe_block(x, w[2], w[3], w[4], top_k, normalize);
      if (routing.has_value()) {
        routing->select(0, moe_index[i]).view({-1, top_k}).index_copy_(0, slots, experts.to(routing->scalar_type()));
      }
    } else {
      const at::Tensor gate_up = linear(x, w[2], std::nullopt);
      at::Tensor act = at::empty({rows, gate_up.size(1) / 2}, x.options());
      rollout_cpu::silu_mul(gate_up, act);
      mlp = linear(act, w[3], std::nullopt);
    }
    if (i + 1 < layers) {
      rollout_cpu::add_rms_norm_(h, mlp, norms[2 * i + 2], eps, x);
    } else {
      h.add_(mlp);
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout, m) {
  m.def(
      "decode_layers(Tensor(a!) h, Tensor(b!) x, Tensor[] weights, Tensor?[] biases, Tensor[] norms, "
      "Tensor[] head_norms, int[] moe_index, int top_k, bool normalize, Tensor(e!)? routing, float eps, "
      "Tensor positions, Tensor cos, Tensor sin, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slots, "
      "Tensor block_tables, Tensor context_lens, int[] windows, float scale, int num_heads, bool skinny, "
      "bool bf16, int[] gemm_plan) -> ()");
}

// Packed weights are oneDNN tensors, which dispatch on MkldnnCPU rather than CPU.
TORCH_LIBRARY_IMPL(rollout, CPU, m) { m.impl("decode_layers", &decode_layers); }
TORCH_LIBRARY_IMPL(rollout, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
