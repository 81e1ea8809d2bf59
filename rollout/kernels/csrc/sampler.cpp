// Sampling from float32 logits on the CPU: the fused form of
// rollout/engine/sampler.py's `sample`.
//
// Without filters the torch path runs about a dozen full passes over
// [rows, vocab] (a division, softmax, cumsum, two logsumexps, gathers), each
// a separate op with its own temporaries; at a large vocabulary that costs
// about as much as the LM head's GEMM. Here a row is read three times (max;
// exp and block sums; the walk inside one block) while it stays in cache. With
// top-k, top-p or min-p the torch path sorts the whole vocabulary; here only
// the candidates that can be kept are sorted (see filtered_row).
//
// Semantics are the torch path's: greedy rows (temperature 0) take the first
// maximum and report the raw logprob; other rows divide by the temperature,
// keep the tokens the filters keep, invert the CDF of the kept tokens'
// softmax(logits / T) in vocabulary order at the row's uniform u (the first
// token whose cumulative mass exceeds u times the total), and report the
// logprob of that token by the row's mode: 0 processed (the kept
// distribution), 1 raw (log_softmax(logits)), 2 scaled (log_softmax(logits /
// T)). The exp is vec_math.h's (about 1 ulp, like torch's) and the draw's sums
// run in double and in another order, so a logprob differs from the torch
// path's by float32 rounding, and a token only within rounding of a CDF step.
// The kept set is computed by one rule on both paths (filtered_row): the torch
// path sums the same float32 weights in double in the same order, so the edge
// of the set moves only where the two exps' last bits carry a sum across
// top_p or a weight across min_p. Ties in the filters' order keep the lower
// token id first, as the torch path's stable sort does. A token of zero
// probability is never drawn.
//
// Built with the other kernels into one library by rollout/kernels/build.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
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

// Per-thread scratch of one row: scaled logits or weights, block sums, candidate keys.
struct Scratch {
  explicit Scratch(int64_t n) : values(n), block_sums(n / kBlock + 1) { keys.reserve(n); }
  std::vector<float> values;
  std::vector<double> block_sums;
  std::vector<uint64_t> keys;  // candidates of a filtered row, see sort_key
};

// A key whose ascending order is s descending, then token id ascending: the float's bits made
// monotone as unsigned, inverted, above the id. -0 becomes +0 first, as the two are equal to
// the torch path's comparisons, so they tie by id there too. Plain integers sort faster than
// an indirect comparator over s, which matters where most of a row is a candidate (top_k near
// the vocabulary, top_p 0.999999, a flat row): there this op and the torch path both sort
// about everything, and neither has an edge.
inline uint64_t sort_key(float s, int64_t id) {
  uint32_t bits = std::bit_cast<uint32_t>(s);
  if (bits == 0x80000000u) bits = 0;
  const uint32_t ascending = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
  return static_cast<uint64_t>(~ascending) << 32 | static_cast<uint32_t>(id);
}
inline int64_t key_id(uint64_t key) { return static_cast<int64_t>(key & 0xffffffffu); }

// A row whose weights hold a NaN (a NaN or +inf logit): the first NaN, else the first
// maximum, as torch.argmax picks, with a NaN logprob, as the torch path reports.
Draw nan_draw(const float* x, int64_t n, float top) {
  const float* nan = std::find_if(x, x + n, [](float v) { return std::isnan(v); });
  const int64_t token = nan != x + n ? nan - x : std::find(x, x + n, top) - x;
  return {token < n ? token : 0, std::numeric_limits<float>::quiet_NaN()};
}

struct Filters {
  int64_t top_k;  // 0 = off
  float top_p;    // 1 = off
  float min_p;    // 0 = off
};

// The first maximum, as torch.argmax (the first NaN, if any), and its raw logprob.
Draw greedy_row(const float* x, int64_t n) {
  const float top = row_max(x, n);
  int any_nan = 0;
#pragma omp simd reduction(| : any_nan)
  for (int64_t i = 0; i < n; ++i) any_nan |= x[i] != x[i];
  if (any_nan) return nan_draw(x, n, top);
  const int64_t token = std::find(x, x + n, top) - x;
  return {token, x[token] - log_sum_exp(x, n, top)};
}

// The logprob of `token` by mode: 1 raw (log_softmax(x)), 2 scaled (log_softmax(x / T)),
// 0 processed (the kept tokens' distribution; all of them without filters). `total` and
// `kept` are the weights exp(x / T - top / T) of all and of the kept tokens.
float logprob_of(const float* x, int64_t n, float top, int64_t token, float temperature, int64_t mode, double total,
                 double kept) {
  if (mode == 1 && temperature != 1.f) return x[token] - log_sum_exp(x, n, top);
  const float scaled = x[token] / temperature - top / temperature;  // at T = 1, raw is scaled
  return scaled - static_cast<float>(std::log(mode == 0 ? kept : total));
}

// A row without filters. Sums run in double, as torch's cumsum accumulates: float sums over
// a 152k vocabulary drift by 1e-6, enough to move a token past its neighbours.
Draw sample_row(const float* x, int64_t n, float temperature, int64_t mode, float u, Scratch& scratch) {
  float* weights = scratch.values.data();
  double* block_sums = scratch.block_sums.data();
  const float top = row_max(x, n);
  const float scaled_top = top / temperature;  // division is monotone: the maximum of x / T
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  double total = 0.;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * kBlock, stop = std::min(n, start + kBlock);
    double sum = 0.;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = start; i < stop; ++i) {
      weights[i] = vec_exp(x[i] / temperature - scaled_top);
      sum += weights[i];
    }
    block_sums[b] = sum;
    total += sum;
  }
  if (std::isnan(total)) return nan_draw(x, n, top);
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
  return {token, logprob_of(x, n, top, token, temperature, mode, total, total)};
}

// A row with top-k, top-p or min-p, as rollout/engine/sampler.py's `_apply_filters`: in the
// order of s = x / T, descending (ties: lower token id first), the kept tokens are the longest
// prefix of at most top_k tokens (at least one) in which every token has less than top_p of
// the top-k set's mass before it and a probability at least min_p times the top one's. The
// mass is the float32 weights exp(s - top) summed in double in that order; the total is
// summed in another order, which moves it by double rounding only. `_apply_filters` computes
// the same sums, so both paths put the edge at the same token. The token is then drawn from
// the kept ones in vocabulary order, as on the unfiltered path.
//
// Sorting the whole vocabulary is what makes the torch path slow. Here only candidates are
// sorted: the tokens above the first depth below the top at which one filter is sure to end
// (top-k: k tokens above it; top-p: their mass reaches top_p of the whole; min-p: it lies
// below log(min_p)), found with a histogram of depths; every token when none ends sooner.
Draw filtered_row(const float* x, int64_t n, float temperature, Filters f, int64_t mode, float u, Scratch& scratch) {
  float* s = scratch.values.data();
  const float top = row_max(x, n);
  const float scaled_top = top / temperature;
  double total = 0.;  // sum of all weights: the scaled distribution's normaliser
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    s[i] = x[i] / temperature;
    total += vec_exp(s[i] - scaled_top);
  }
  if (std::isnan(total)) return nan_draw(x, n, top);
  const bool use_k = f.top_k > 0 && f.top_k < n;
  // Histogram of how far below the top each token lies, with its weight: walking bins down
  // from the top finds the first depth at which one filter is sure to end.
  constexpr int kBins = 512;
  constexpr float kDepth = 88.f;  // weights are 0 deeper than 87: below, only the order is left
  constexpr float kWidth = kDepth / kBins;
  int64_t counts[kBins] = {};
  double masses[kBins] = {};
  const bool by_mass = !use_k && f.top_p < 1.f;  // min-p alone needs no histogram: its depth is known
  if (use_k || by_mass) {
    for (int64_t i = 0; i < n; ++i) {
      const float depth = scaled_top - s[i];
      if (depth < kDepth) {  // false for NaN and -inf
        const int bin = std::min(kBins - 1, static_cast<int>(depth / kWidth));
        ++counts[bin];
        if (by_mass) masses[bin] += vec_exp(-depth);
      }
    }
  }
  const float min_p_depth = f.min_p > 0.f ? -std::log(f.min_p) : std::numeric_limits<float>::infinity();
  float cut = -std::numeric_limits<float>::infinity();  // every token, unless a filter ends sooner
  int64_t count = 0;
  double above = 0.;  // the weight of bins 0..bin
  for (int bin = 0; bin < kBins; ++bin) {
    count += counts[bin];
    above += masses[bin];
    const float deepest = (bin + 1) * kWidth;
    const bool enough = use_k ? count >= f.top_k
                              : (by_mass && above >= f.top_p * total * (1. + 1e-9)) || deepest > min_p_depth;
    if (enough) {
      cut = scaled_top - deepest - kWidth;  // one bin of margin for the rounding of `depth / kWidth`
      break;
    }
  }
  std::vector<uint64_t>& keys = scratch.keys;
  keys.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (s[i] >= cut) keys.push_back(sort_key(s[i], i));
  }
  const int64_t limit = use_k ? std::min<int64_t>(f.top_k, keys.size()) : static_cast<int64_t>(keys.size());
  if (limit < static_cast<int64_t>(keys.size())) std::nth_element(keys.begin(), keys.begin() + limit, keys.end());
  std::sort(keys.begin(), keys.begin() + limit);
  auto weight_of = [&](uint64_t key) { return vec_exp(s[key_id(key)] - scaled_top); };
  double norm = 0.;  // the mass of the top-k set (of everything without top-k)
  if (use_k) {
    for (int64_t j = 0; j < limit; ++j) norm += weight_of(keys[j]);
  } else {
    norm = total;
  }
  int64_t keep = 0;
  double prefix = 0.;
  for (int64_t j = 0; j < limit; ++j) {
    const float w = weight_of(keys[j]);
    if (j > 0 && ((f.top_p < 1.f && prefix >= f.top_p * norm) || (f.min_p > 0.f && w < f.min_p))) break;
    keep = j + 1;
    prefix += w;
  }
  // Draw from the kept tokens in vocabulary order.
  std::sort(keys.begin(), keys.begin() + keep, [](uint64_t a, uint64_t b) { return key_id(a) < key_id(b); });
  double kept = 0.;
  for (int64_t j = 0; j < keep; ++j) kept += weight_of(keys[j]);
  const double target = u * kept;
  int64_t token = -1;
  double mass = 0.;
  for (int64_t j = 0; j < keep && token < 0; ++j) {
    mass += weight_of(keys[j]);
    if (mass > target) token = key_id(keys[j]);
  }
  for (int64_t j = keep - 1; token < 0 && j >= 0; --j) {  // rounding left the target unreached
    if (weight_of(keys[j]) > 0.f || j == 0) token = key_id(keys[j]);
  }
  return {token, logprob_of(x, n, top, token, temperature, mode, total, kept)};
}

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == rows &&
                  t.is_contiguous(),
              name, " must be a contiguous ", dtype, " CPU tensor of ", rows, " rows, got ", t.scalar_type(), " ",
              t.sizes());
}

// PCG-RXS-M-XS on 32 bits: rollout/engine/sampler.py's _mix32, whose int64 ops wrap like these.
inline uint32_t mix32(uint32_t x) {
  const uint32_t state = x * 747796405u + 2891336453u;
  const uint32_t word = ((state >> ((state >> 28) + 4)) ^ state) * 277803737u;
  return (word >> 22) ^ word;
}

// rollout/engine/sampler.py's counter_uniform, bit for bit, into out [R] float32: one op
// instead of about 45 small ones per step (the hash of int64 seed, stream and counter per row).
void counter_uniform(const at::Tensor& seed, const at::Tensor& stream, const at::Tensor& counter, at::Tensor out) {
  const int64_t rows = out.numel();
  check_vector(seed, "seed", at::kLong, rows);
  check_vector(stream, "stream", at::kLong, rows);
  check_vector(counter, "counter", at::kLong, rows);
  check_vector(out, "out", at::kFloat, rows);
  const int64_t* seeds = seed.data_ptr<int64_t>();
  const int64_t* streams = stream.data_ptr<int64_t>();
  const int64_t* counters = counter.data_ptr<int64_t>();
  float* us = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t s = static_cast<uint64_t>(seeds[r]);
    uint32_t h = mix32(static_cast<uint32_t>(counters[r]));
    h = mix32(h ^ static_cast<uint32_t>(streams[r]));
    h = mix32(h ^ static_cast<uint32_t>(s));
    h = mix32(h ^ static_cast<uint32_t>(s >> 32));
    us[r] = static_cast<float>(h >> 8) * (1.f / 16777216.f);
  }
}

// Draws one token per row of `logits` [R, V] into out_tokens [R] (int64) and its
// logprob into out_logprobs [R] (float32). Per row: temperature float32 (0 = greedy),
// top_k int64 (0 = off), top_p float32 in (0, 1] (1 = off), min_p float32 in [0, 1]
// (0 = off), mode int64 (0 processed, 1 raw, 2 scaled), uniform float32 in [0, 1).
void sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                 const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& mode, const at::Tensor& uniform,
                 at::Tensor out_tokens, at::Tensor out_logprobs) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.size(1) > 0 && logits.size(1) <= std::numeric_limits<int32_t>::max() &&
                  logits.stride(1) == 1,
              "logits must be a float32 CPU tensor [rows, vocab] with contiguous rows, got ", logits.scalar_type(),
              " ", logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_vector(temperature, "temperature", at::kFloat, rows);
  check_vector(top_k, "top_k", at::kLong, rows);
  check_vector(top_p, "top_p", at::kFloat, rows);
  check_vector(min_p, "min_p", at::kFloat, rows);
  check_vector(mode, "mode", at::kLong, rows);
  check_vector(uniform, "uniform", at::kFloat, rows);
  check_vector(out_tokens, "out_tokens", at::kLong, rows);
  check_vector(out_logprobs, "out_logprobs", at::kFloat, rows);
  const float* temps = temperature.data_ptr<float>();
  const int64_t* ks = top_k.data_ptr<int64_t>();
  const float* ps = top_p.data_ptr<float>();
  const float* min_ps = min_p.data_ptr<float>();
  const int64_t* modes = mode.data_ptr<int64_t>();
  const float* us = uniform.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(temps[r] >= 0.f && std::isfinite(temps[r]), "temperature[", r, "] = ", temps[r],
                " must be finite and >= 0");
    TORCH_CHECK(ks[r] >= 0, "top_k[", r, "] = ", ks[r], " must be >= 0 (0 = off)");
    TORCH_CHECK(ps[r] > 0.f && ps[r] <= 1.f, "top_p[", r, "] = ", ps[r], " must be in (0, 1]");
    TORCH_CHECK(min_ps[r] >= 0.f && min_ps[r] <= 1.f, "min_p[", r, "] = ", min_ps[r], " must be in [0, 1]");
    TORCH_CHECK(modes[r] >= 0 && modes[r] <= 2, "mode[", r, "] = ", modes[r], " must be 0, 1 or 2");
    TORCH_CHECK(us[r] >= 0.f && us[r] < 1.f, "uniform[", r, "] = ", us[r], " must be in [0, 1)");
  }
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  int64_t* tokens = out_tokens.data_ptr<int64_t>();
  float* logprobs = out_logprobs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(vocab);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
      const Filters f{ks[r], ps[r], min_ps[r]};
      Draw draw;
      if (temps[r] == 0.f) {
        draw = greedy_row(row, vocab);
      } else if ((f.top_k > 0 && f.top_k < vocab) || f.top_p < 1.f || f.min_p > 0.f) {
        draw = filtered_row(row, vocab, temps[r], f, modes[r], us[r], scratch);
      } else {
        draw = sample_row(row, vocab, temps[r], modes[r], us[r], scratch);
      }
      tokens[r] = draw.token;
      logprobs[r] = draw.logprob;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout, m) {
  m.def(
      "sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor mode, "
      "Tensor uniform, Tensor(a!) out_tokens, Tensor(b!) out_logprobs) -> ()");
  m.def("counter_uniform(Tensor seed, Tensor stream, Tensor counter, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(rollout, CPU, m) {
  m.impl("sample_rows", &sample_rows);
  m.impl("counter_uniform", &counter_uniform);
}
