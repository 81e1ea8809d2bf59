// Sampling from float32 logits on the CPU, for batches without top-k, top-p
// or min-p: the fused form of rollout/sampler.py's `sample` for them.
//
// The torch path runs about a dozen full passes over [rows, vocab] (a
// division, softmax, cumsum, two logsumexps, gathers), each a separate op
// with its own temporaries; at a 152k vocabulary that took 49-118 ms per
// decode step of 64 rows on 2 cores, about as long as the LM head's GEMM,
// and this op 7-9 ms. Here a row is read three times (max; exp and block
// sums; the walk inside one block) while it stays in cache.
//
// Semantics are the torch path's: greedy rows (temperature 0) take the first
// maximum and report the raw logprob; other rows divide by the temperature,
// invert the CDF of softmax(logits / T) in vocabulary order at the row's
// uniform u (the first token whose cumulative mass exceeds u times the
// total), and report the logprob of that token by the row's mode: 1 raw
// (log_softmax(logits)), otherwise scaled (log_softmax(logits / T)), which
// is also "processed" when no filter applies. The exp is vec_math.h's (about
// 1 ulp, like torch's) and sums run in another order, so a logprob differs
// from the torch path's by float32 rounding, and a token only where u falls
// within rounding of a CDF step. A token of zero probability is never drawn.
//
// Built with the other kernels into one library by rollout/cpu_kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kBlock = 256;  // tokens per partial sum: the walk reads at most one block twice

// The largest logit, NaN ignored.
float row_max(const float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

// vec_exp(z), except exactly 0 below its clamp at -87 (where it returns 1.6e-38 rather than
// less): a masked token (-inf) or one e^87 times less likely than the top must weigh nothing,
// or a uniform of exactly 0 would draw it.
inline float weight(float z) { return z < -87.f ? 0.f : vec_exp(z); }

// log(sum(exp(x - top))) + top, summed in double like the sampling pass.
float log_sum_exp(const float* x, int64_t n, float top) {
  double total = 0.;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += vec_exp(x[i] - top);
  return top + static_cast<float>(std::log(total));
}

struct Draw {
  int64_t token;
  float logprob;
};

Draw greedy_row(const float* x, int64_t n) {
  const float top = row_max(x, n);
  // The first maximum, as torch.argmax; like it, the first NaN if there is one.
  int any_nan = 0;
#pragma omp simd reduction(| : any_nan)
  for (int64_t i = 0; i < n; ++i) any_nan |= x[i] != x[i];
  const int64_t token = any_nan ? std::find_if(x, x + n, [](float v) { return std::isnan(v); }) - x
                                : std::find(x, x + n, top) - x;
  return {token, x[token] - log_sum_exp(x, n, top)};
}

// `weights` is scratch for n floats, `block_sums` for n / kBlock + 1. Sums run in double, as
// torch's cumsum accumulates: float sums over a 152k vocabulary drift by 1e-6, enough to move
// a token past its neighbours.
Draw sample_row(const float* x, int64_t n, float temperature, int64_t mode, float u, float* weights,
                double* block_sums) {
  const float top = row_max(x, n);
  const float scaled_top = top / temperature;  // division is monotone: the maximum of x / T
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  double total = 0.;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * kBlock, stop = std::min(n, start + kBlock);
    double sum = 0.;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = start; i < stop; ++i) {
      weights[i] = weight(x[i] / temperature - scaled_top);
      sum += weights[i];
    }
    block_sums[b] = sum;
    total += sum;
  }
  // The first token whose running mass exceeds the target; a token of zero weight never
  // raises the mass, so it is never picked. If rounding leaves the target unreached, the
  // last token of positive weight is.
  const double target = u * total;
  int64_t token = -1;
  double mass = 0.;
  for (int64_t b = 0; b < blocks && token < 0; ++b) {
    if (mass + block_sums[b] <= target) {
      mass += block_sums[b];
      continue;
    }
    const int64_t start = b * kBlock, stop = std::min(n, start + kBlock);
    for (int64_t i = start; i < stop; ++i) {
      mass += weights[i];
      if (mass > target) {
        token = i;
        break;
      }
    }
  }
  if (token < 0) {
    token = n - 1;
    while (token > 0 && weights[token] == 0.f) --token;
  }
  // At temperature 1, x / T is x: the raw logprob is the scaled one.
  const float logprob = mode == 1 && temperature != 1.f ? x[token] - log_sum_exp(x, n, top)
                                                        : x[token] / temperature - (scaled_top + static_cast<float>(std::log(total)));
  return {token, logprob};
}

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == rows &&
                  t.is_contiguous(),
              name, " must be a contiguous ", dtype, " CPU tensor of ", rows, " rows, got ", t.scalar_type(), " ",
              t.sizes());
}

// Draws one token per row of `logits` [R, V] into out_tokens [R] (int64) and its
// logprob into out_logprobs [R] (float32). temperature [R] float32 (0 = greedy),
// mode [R] int64 (0 processed, 1 raw, 2 scaled), uniform [R] float32 in [0, 1).
void sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& mode,
                 const at::Tensor& uniform, at::Tensor out_tokens, at::Tensor out_logprobs) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.size(1) > 0 && logits.stride(1) == 1,
              "logits must be a float32 CPU tensor [rows, vocab] with contiguous rows, got ", logits.scalar_type(),
              " ", logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_vector(temperature, "temperature", at::kFloat, rows);
  check_vector(mode, "mode", at::kLong, rows);
  check_vector(uniform, "uniform", at::kFloat, rows);
  check_vector(out_tokens, "out_tokens", at::kLong, rows);
  check_vector(out_logprobs, "out_logprobs", at::kFloat, rows);
  const float* temps = temperature.data_ptr<float>();
  const int64_t* modes = mode.data_ptr<int64_t>();
  const float* us = uniform.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(temps[r] >= 0.f && std::isfinite(temps[r]), "temperature[", r, "] = ", temps[r],
                " must be finite and >= 0");
    TORCH_CHECK(modes[r] >= 0 && modes[r] <= 2, "mode[", r, "] = ", modes[r], " must be 0, 1 or 2");
    TORCH_CHECK(us[r] >= 0.f && us[r] < 1.f, "uniform[", r, "] = ", us[r], " must be in [0, 1)");
  }
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  int64_t* tokens = out_tokens.data_ptr<int64_t>();
  float* logprobs = out_logprobs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(vocab);
    std::vector<double> block_sums(vocab / kBlock + 1);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
      const Draw draw = temps[r] == 0.f ? greedy_row(row, vocab)
                                        : sample_row(row, vocab, temps[r], modes[r], us[r], weights.data(),
                                                     block_sums.data());
      tokens[r] = draw.token;
      logprobs[r] = draw.logprob;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout, m) {
  m.def(
      "sample_rows(Tensor logits, Tensor temperature, Tensor mode, Tensor uniform, Tensor(a!) out_tokens, "
      "Tensor(b!) out_logprobs) -> ()");
}

TORCH_LIBRARY_IMPL(rollout, CPU, m) { m.impl("sample_rows", &sample_rows); }
