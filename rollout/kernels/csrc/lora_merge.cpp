// A LoRA adapter push's merge on the host (rollout/engine/weight_lora.py):
//
//   out = round(base + scaling * (B @ A))
//
// lora_merge(out, base, b, a, scaling) -> bool. `out` and `base` are (rows,
// cols), contiguous, one dtype (bfloat16 or float32; `out` may be `base`);
// `a` (r, cols) and `b` (rows, r) are contiguous float32. The scaling goes
// into a copy of A first (A' = scaling * A, rounded to float32: r x cols
// values, as torch's float32 `addmm(base, B, A, alpha=scaling)` applies its
// alpha on the host). Per block of 4 rows and 16 columns the r products are
// then accumulated in float32 registers, k = 0 to r - 1, each step one fused
// multiply-add (acc = fma(B[i, k], A'[k, j], acc), acc starting at 0); the
// base is added (base + acc, in float32) and the sum rounded once to `out`'s
// dtype: to nearest, ties to even, as torch's `.to(torch.bfloat16)` rounds.
// That is the order of operations of oneDNN's kernel for torch's host
// `addmm`; the bits may still differ from torch's path, whose blocking and
// kernel choice vary with the shape and the host. Scalar tails (the last columns) use std::fma in the same order,
// so every element gets the same bits whatever its position. One read of
// the base and one write of `out`; no float32 copy of the tensor. Groups of
// rows run in parallel on torch's pool, each one panel of A' at a time.
//
// Returns whether every element of `out` is finite (a merge can overflow the
// dtype even from finite inputs; the caller then refuses the push).
//
// Built with the other kernels into one library by rollout/kernels/build.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace rollout_cpu {
namespace {

constexpr int64_t kRows = 4;  // rows of one register block
constexpr int64_t kCols = 16;  // columns of one register block (two AVX2 vectors)
constexpr int64_t kPanelBytes = 128 << 10;  // of A' kept in the second-level cache while a group of rows passes
constexpr int64_t kGroup = 8;  // rows per unit of parallel work (a multiple of kRows): few streams of the base

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest, ties to even, as c10::BFloat16 does (vec_math.h's round_bf16).
inline uint16_t float_to_bf16(float f) { return uint16_t(std::bit_cast<uint32_t>(round_bf16(f)) >> 16); }

template <typename T>
inline float load_one(const T* p) {
  if constexpr (sizeof(T) == 2) {
    return bf16_to_float(*reinterpret_cast<const uint16_t*>(p));
  } else {
    return *p;
  }
}

// Stores `v` rounded to T; returns whether the stored value is finite.
template <typename T>
inline bool store_one(T* p, float v) {
  if constexpr (sizeof(T) == 2) {
    const uint16_t h = float_to_bf16(v);
    *reinterpret_cast<uint16_t*>(p) = h;
    return (h & 0x7F80u) != 0x7F80u;
  } else {
    *p = v;
    return std::isfinite(v);
  }
}

// One element the scalar way: the same operations, in the same order, as a vector lane.
template <typename T>
inline float merge_one(const T* base, const float* b_row, const float* a, int64_t r, int64_t cols, int64_t j) {
  float acc = 0.f;
  for (int64_t k = 0; k < r; ++k) acc = std::fma(b_row[k], a[k * cols + j], acc);
  return load_one(base + j) + acc;
}

#if defined(__AVX2__)
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (sizeof(T) == 2) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  } else {
    return _mm256_loadu_ps(p);
  }
}

// Stores `v` rounded to T; returns the lanes whose stored value is inf or NaN (all exponent bits set).
template <typename T>
inline __m256i store8(T* p, __m256 v) {
  if constexpr (sizeof(T) == 2) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    u = _mm256_srli_epi32(u, 16);  // each lane < 2^16: the unsigned pack below keeps it
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
    const __m256i exponent = _mm256_set1_epi32(0x7F80);
    return _mm256_cmpeq_epi32(_mm256_and_si256(u, exponent), exponent);
  } else {
    _mm256_storeu_ps(p, v);
    const __m256i exponent = _mm256_set1_epi32(0x7F800000);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent), exponent);
  }
}

// Rows [i, i + M) by columns [j, j + 16): M x 2 accumulators in registers.
template <typename T, int M>
inline bool block(T* out, const T* base, const float* b, const float* a, int64_t r, int64_t cols, int64_t i,
                  int64_t j) {
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < r; ++k) {
    const __m256 a0 = _mm256_loadu_ps(a + k * cols + j);
    const __m256 a1 = _mm256_loadu_ps(a + k * cols + j + 8);
    for (int m = 0; m < M; ++m) {
      const __m256 bk = _mm256_broadcast_ss(b + (i + m) * r + k);
      acc[m][0] = _mm256_fmadd_ps(bk, a0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(bk, a1, acc[m][1]);
    }
  }
  __m256i bad = _mm256_setzero_si256();
  for (int m = 0; m < M; ++m) {
    for (int h = 0; h < 2; ++h) {
      const int64_t at = (i + m) * cols + j + 8 * h;
      bad = _mm256_or_si256(bad, store8(out + at, _mm256_add_ps(load8(base + at), acc[m][h])));
    }
  }
  return _mm256_testz_si256(bad, bad);
}
#endif

// Rows [i, i + M) by columns [j0, j1): full register blocks, then the scalar tail of columns.
template <typename T, int M>
bool rows(T* out, const T* base, const float* b, const float* a, int64_t r, int64_t cols, int64_t i, int64_t j0,
          int64_t j1) {
  bool ok = true;
  int64_t j = j0;
#if defined(__AVX2__)
  for (; j + kCols <= j1; j += kCols) ok &= block<T, M>(out, base, b, a, r, cols, i, j);
#endif
  for (int64_t m = 0; m < M; ++m) {
    const int64_t row = (i + m) * cols;
    for (int64_t jj = j; jj < j1; ++jj) {
      ok &= store_one(out + row + jj, merge_one(base + row, b + (i + m) * r, a, r, cols, jj));
    }
  }
  return ok;
}

// Rows [begin, end) one panel of columns at a time, so the panel of A' (r x panel, kPanelBytes) stays in
// cache while every row of the group passes over it.
template <typename T>
bool group(T* out, const T* base, const float* b, const float* a, int64_t r, int64_t cols, int64_t begin,
           int64_t end) {
  bool ok = true;
  const int64_t panel = std::max(kCols, kPanelBytes / (4 * r) / kCols * kCols);
  for (int64_t j0 = 0; j0 < cols; j0 += panel) {
    const int64_t j1 = std::min(cols, j0 + panel);
    for (int64_t i = begin; i < end; i += kRows) {
      switch (std::min(kRows, end - i)) {
        case 4: ok &= rows<T, 4>(out, base, b, a, r, cols, i, j0, j1); break;
        case 3: ok &= rows<T, 3>(out, base, b, a, r, cols, i, j0, j1); break;
        case 2: ok &= rows<T, 2>(out, base, b, a, r, cols, i, j0, j1); break;
        default: ok &= rows<T, 1>(out, base, b, a, r, cols, i, j0, j1); break;
      }
    }
  }
  return ok;
}

template <typename T>
bool merge_typed(at::Tensor& out, const at::Tensor& base, const at::Tensor& b, const at::Tensor& a) {
  T* o = out.data_ptr<T>();
  const T* x = base.data_ptr<T>();
  const float* pb = b.data_ptr<float>();
  const float* pa = a.data_ptr<float>();
  const int64_t n_rows = out.size(0), cols = out.size(1), r = a.size(0);
  std::atomic<bool> all_finite{true};
  const int64_t groups = (n_rows + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    const bool ok = group<T>(o, x, pb, pa, r, cols, begin * kGroup, std::min(n_rows, end * kGroup));
    if (!ok) all_finite.store(false, std::memory_order_relaxed);
  });
  return all_finite.load();
}

bool lora_merge(at::Tensor out, const at::Tensor& base, const at::Tensor& b, const at::Tensor& a, double scaling) {
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&out), &base, &b, &a}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->is_contiguous(),
                "lora_merge: out, base, b and a must be 2-d contiguous CPU tensors");
  }
  const auto dtype = out.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "lora_merge: out must be bfloat16 or float32");
  TORCH_CHECK(base.scalar_type() == dtype, "lora_merge: base must have out's dtype");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat, "lora_merge: a and b must be float32");
  TORCH_CHECK(base.sizes() == out.sizes(), "lora_merge: base must have out's shape");
  TORCH_CHECK(b.size(0) == out.size(0) && a.size(1) == out.size(1) && b.size(1) == a.size(0),
              "lora_merge: b must be (rows, r) and a (r, cols) for an out of (rows, cols)");
  if (out.numel() == 0) return true;
  const at::Tensor scaled = a.mul(scaling);  // A' = scaling * A in float32 (r x cols: small)
  if (dtype == at::kBFloat16) return merge_typed<at::BFloat16>(out, base, b, scaled);
  return merge_typed<float>(out, base, b, scaled);
}

}  // namespace
}  // namespace rollout_cpu

TORCH_LIBRARY_FRAGMENT(rollout, m) { m.def("lora_merge(Tensor(a!) out, Tensor base, Tensor b, Tensor a, float scaling) -> bool"); }

TORCH_LIBRARY_IMPL(rollout, CPU, m) { m.impl("lora_merge", &rollout_cpu::lora_merge); }
