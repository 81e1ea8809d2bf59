// Teacher-forced logprobs of given tokens on the CPU, one block of the
// vocabulary at a time: the fused form of rollout/engine/scoring.py's
// unfiltered case (log_softmax(logits / T) gathered at each row's token, and
// the row's k most likely tokens).
//
// The caller projects a block of rows through one slice of the LM head at a
// time ([rows, block] float32 logits, small enough to stay in cache) and calls
// score_block on it; the op folds the block into each row's running state: the
// maximum m of x / T so far, the sum s of exp(x / T - m) in double (rescaled by
// exp(m_old - m_new) when the maximum grows: an online logsumexp), the row's
// token's x / T once its block passes, and the k largest x / T so far with their
// ids. After the last block, logsumexp = m + log(s). torch's path instead writes
// [rows, vocab] logits and runs a max, a subtraction, an exp and a sum over
// them, each a pass from memory with its own temporary; at a 49k vocabulary that
// costs about a fifth of the head's GEMM per scored row, and the GEMM itself runs
// faster on vocabulary slices whose output stays in cache.
//
// Per row: `divisor` float32 > 0, the temperature to divide by (1 for the raw
// distribution: greedy rows and logprobs_mode "raw"; the caller decides). The
// top k are kept best first, ties by lower token id (blocks arrive in id order,
// so an equal value later never displaces one kept); empty slots have id -1. A
// NaN logit makes the row's sum NaN, so its logprobs come out NaN as torch's do.
//
// Built with the other kernels into one library by rollout/kernels/build.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "vec_math.h"

namespace {

constexpr int64_t kSpan = 64;  // logits per span whose maximum decides whether it can enter the top k
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float span_max(const float* x, int64_t n) {
  float top = kNegInf;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

// sum(exp(x / T - top)) in double; at T = 1 without the division (x / 1 is x).
double sum_exp(const float* x, int64_t n, float divisor, float top) {
  double total = 0.;
  if (divisor == 1.f) {
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) total += vec_exp(x[i] - top);
  } else {
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) total += vec_exp(x[i] / divisor - top);
  }
  return total;
}

// Inserts (v, id) into the k best (values descending, ids -1 where empty) if it beats the k-th.
void offer(float* values, int64_t* ids, int64_t k, float v, int64_t id) {
  if (ids[k - 1] >= 0 && !(v > values[k - 1])) return;
  int64_t at = k - 1;
  while (at > 0 && (ids[at - 1] < 0 || v > values[at - 1])) {
    values[at] = values[at - 1];
    ids[at] = ids[at - 1];
    --at;
  }
  values[at] = v;
  ids[at] = id;
}

// The block's entries that beat the row's current k-th (x / T), span by span: a span enters
// only when its maximum does.
void pick_top(const float* x, int64_t n, int64_t first, float divisor, float* values, int64_t* ids, int64_t k) {
  for (int64_t start = 0; start < n; start += kSpan) {
    const int64_t stop = std::min(n, start + kSpan);
    if (ids[k - 1] >= 0 && !(span_max(x + start, stop - start) / divisor > values[k - 1])) continue;
    for (int64_t i = start; i < stop; ++i) offer(values, ids, k, x[i] / divisor, first + i);
  }
}

void check_state(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows, int64_t width) {
  const bool shaped =
      width < 0 ? t.dim() == 1 && t.size(0) == rows : t.dim() == 2 && t.size(0) == rows && t.size(1) == width;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && shaped && t.is_contiguous(), name,
              " must be a contiguous CPU ", dtype, " tensor with ", rows, " rows", width < 0 ? "" : " of k", ", got ",
              t.scalar_type(), " ", t.sizes());
}

// logits [R, n] float32 (rows contiguous): the logits of token ids first .. first + n - 1.
// targets [R] int64, divisor [R] float32 > 0. The state, updated in place: top [R] float32
// (the running maximum of x / T, -inf before the first block), total [R] float64 (the sum
// of exp(x / T - top), 0 before), picked [R] float32 (x / T of the row's target, once its
// block passed), top_values [R, k] float32 and top_ids [R, k] int64 (ids -1 before).
void score_block(const at::Tensor& logits, int64_t first, const at::Tensor& targets, const at::Tensor& divisor,
                 at::Tensor top, at::Tensor total, at::Tensor picked, at::Tensor top_values, at::Tensor top_ids) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.size(1) > 0 && logits.stride(1) == 1,
              "logits must be a float32 CPU tensor [rows, block] with contiguous rows, got ", logits.scalar_type(),
              " ", logits.sizes());
  const int64_t rows = logits.size(0), n = logits.size(1), k = top_ids.dim() == 2 ? top_ids.size(1) : -1;
  TORCH_CHECK(first >= 0, "first must be >= 0, got ", first);
  check_state(targets, "targets", at::kLong, rows, -1);
  check_state(divisor, "divisor", at::kFloat, rows, -1);
  check_state(top, "top", at::kFloat, rows, -1);
  check_state(total, "total", at::kDouble, rows, -1);
  check_state(picked, "picked", at::kFloat, rows, -1);
  check_state(top_ids, "top_ids", at::kLong, rows, k);
  check_state(top_values, "top_values", at::kFloat, rows, k);
  const int64_t* ts = targets.data_ptr<int64_t>();
  const float* ds = divisor.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ds[r] > 0.f && std::isfinite(ds[r]), "divisor[", r, "] = ", ds[r], " must be finite and > 0");
  }
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  float* tops = top.data_ptr<float>();
  double* totals = total.data_ptr<double>();
  float* picks = picked.data_ptr<float>();
  float* values = top_values.data_ptr<float>();
  int64_t* ids = top_ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
      const float d = ds[r];
      const float block_top = span_max(row, n) / d;  // division is monotone: the maximum of x / T
      const float old = tops[r], now = std::max(old, block_top);
      if (now != kNegInf) {  // a row of -inf so far adds nothing
        const double rescale = old == kNegInf ? 0. : std::exp(static_cast<double>(old) - now);
        totals[r] = totals[r] * rescale + sum_exp(row, n, d, now);
        tops[r] = now;
      } else if (block_top != block_top) {  // NaN block: poison the row
        totals[r] = std::numeric_limits<double>::quiet_NaN();
      }
      if (ts[r] >= first && ts[r] < first + n) picks[r] = row[ts[r] - first] / d;
      if (k > 0) pick_top(row, n, first, d, values + r * k, ids + r * k, k);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout, m) {
  m.def(
      "score_block(Tensor logits, int first, Tensor targets, Tensor divisor, Tensor(a!) top, Tensor(b!) total, "
      "Tensor(c!) picked, Tensor(d!) top_values, Tensor(e!) top_ids) -> ()");
}

TORCH_LIBRARY_IMPL(rollout, CPU, m) { m.impl("score_block", &score_block); }
