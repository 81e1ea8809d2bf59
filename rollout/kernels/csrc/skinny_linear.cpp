// x @ w.T (+ bias) for one or two rows of x, float32 on the CPU.
//
// With so few rows a projection is a pass over its weight, so its speed is how
// fast the weight streams (cycled out of cache, as in a decode step), and this
// kernel streams it faster than oneDNN does at these row counts (figures in
// docs/benchmarks.md). It reads each weight row once, in plain [N, K]
// layout, and multiplies it with every row of x, which stays in L1. At three
// rows and more oneDNN is faster, so `Model` sends only steps of at most
// SKINNY_MAX_ROWS rows here (batch-1 latency, and the last sequences of a
// batch). Each dot product sums 32 lanes, then halves them pairwise: a fixed
// order, so results do not depend on the thread count.
//
// skinny_linear_bf16 computes what oneDNN's bfloat16 GEMM does for Model's
// matmul_dtype bfloat16 from the same float32 weights: x, the weight and the
// bias rounded to bfloat16 (nearest even; the weight as it streams past, so
// the kernel reads the live float32 weight and needs no copy), products of
// bfloat16 values exact in float32, float32 accumulation, and the output
// rounded to bfloat16 (returned as float32 values).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

#include "kernels.h"
#include "vec_math.h"

namespace {

constexpr int64_t kLanes = 32;

template <int Rows, bool Narrow>
void skinny_block(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t k_size, int64_t n_begin,
                  int64_t n_end, const float* __restrict bias, float* __restrict out, int64_t ldo) {
  const int64_t body = k_size - k_size % kLanes;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float* __restrict wn = w + n * k_size;
    float acc[Rows][kLanes] = {};
    for (int64_t k = 0; k < body; k += kLanes) {
      for (int r = 0; r < Rows; ++r) {
        const float* __restrict xr = x + r * ldx + k;
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) {
          acc[r][l] = madd(xr[l], Narrow ? round_bf16(wn[k + l]) : wn[k + l], acc[r][l]);
        }
      }
    }
    for (int r = 0; r < Rows; ++r) {
      float tail = 0.f;
      for (int64_t k = body; k < k_size; ++k) tail = madd(x[r * ldx + k], Narrow ? round_bf16(wn[k]) : wn[k], tail);
      for (int64_t width = kLanes / 2; width >= 1; width /= 2) {
        for (int64_t l = 0; l < width; ++l) acc[r][l] += acc[r][l + width];
      }
      const float y = acc[r][0] + tail + (bias != nullptr ? bias[n] : 0.f);
      out[r * ldo + n] = Narrow ? round_bf16(y) : y;
    }
  }
}

template <bool Narrow>
at::Tensor skinny(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "skinny_linear takes x [rows, K] and ",
              "weight [N, K], got ", x.sizes(), " and ", weight.sizes());
  const int64_t rows = x.size(0), k_size = x.size(1), n_size = weight.size(0);
  constexpr int64_t max_rows = rollout_cpu::kSkinnyMaxRows;
  TORCH_CHECK(rows >= 1 && rows <= max_rows, "skinny_linear takes 1 to ", max_rows, " rows, got ", rows);
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && x.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat,
              "skinny_linear takes float32 CPU tensors");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "x must be contiguous in K and weight contiguous");
  std::optional<at::Tensor> b = bias;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_size && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat && bias->device().is_cpu(),
                "bias must be a contiguous float32 CPU tensor [", n_size, "], got ", bias->sizes());
    if (Narrow) b = bias->to(at::kBFloat16).to(at::kFloat);
  }
  const float* bias_data = b.has_value() ? b->data_ptr<float>() : nullptr;
  const at::Tensor xs = Narrow ? x.to(at::kBFloat16).to(at::kFloat) : x;  // x's rows stay in L1 either way
  at::Tensor out = at::empty({rows, n_size}, x.options());
  const float* xp = xs.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = xs.stride(0);
  // Work items of 16 weight rows: a thread streams a contiguous span of the weight.
  at::parallel_for(0, n_size, 16, [&](int64_t begin, int64_t end) {
    if (rows == 1) {
      skinny_block<1, Narrow>(xp, ldx, wp, k_size, begin, end, bias_data, op, n_size);
    } else {
      skinny_block<2, Narrow>(xp, ldx, wp, k_size, begin, end, bias_data, op, n_size);
    }
  });
  return out;
}

}  // namespace

namespace rollout_cpu {

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return skinny<false>(x, weight, bias);
}

at::Tensor skinny_linear_bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return skinny<true>(x, weight, bias);
}

}  // namespace rollout_cpu

TORCH_LIBRARY_FRAGMENT(rollout, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("skinny_linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

// CPU only: the dispatcher refuses a oneDNN-packed weight (MkldnnCPU), whose layout is not [N, K].
TORCH_LIBRARY_IMPL(rollout, CPU, m) {
  m.impl("skinny_linear", &rollout_cpu::skinny_linear);
  m.impl("skinny_linear_bf16", &rollout_cpu::skinny_linear_bf16);
}
