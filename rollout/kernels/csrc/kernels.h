// Entry points of the CPU kernels that other kernels of the library call
// directly (decode_layers.cpp), besides registering them as torch ops.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace rollout_cpu {

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor out, double scale,
                  int64_t window);
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out);
void add_rms_norm_(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight, double eps, at::Tensor out);
void rope_and_cache_(at::Tensor q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                     const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& slots);
void silu_mul(const at::Tensor& gate_up, at::Tensor out);
void head_rms_norm_(at::Tensor x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> moe_block(const at::Tensor& x, const at::Tensor& router, const at::Tensor& gate_up,
                                             const at::Tensor& down, int64_t top_k, bool normalize);

// Rows that skinny_linear takes at most (rollout.model.linear.SKINNY_MAX_ROWS, the same number).
constexpr int64_t kSkinnyMaxRows = 2;
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
at::Tensor skinny_linear_bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

}  // namespace rollout_cpu
