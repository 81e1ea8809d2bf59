// Delta pushes on the host (rollout/engine/weight_delta.py): the trainer's
// compare of a push's tensors against its copy of the live weights, and the
// scatter of changed elements into a flat tensor.
//
// delta_compare(new, ref, mask, index, values, stop) -> k reads `new` and
// `ref` (1-d, contiguous, the same integer dtype of 2 or 4 bytes: the bit
// patterns of bf16/fp16 or fp32) once, side by side, and in that one pass
// writes the bitmask of the elements whose bits differ (uint8, element 0 in
// bit 0 of byte 0, numpy's packbits(bitorder="little")), the int32 flat
// positions of the first `index.numel()` changed elements, and their new
// values (the first `values.numel()` of them). It returns k, the number of
// changed elements, or stops as soon as k exceeds `stop` (the caller sends
// such a tensor whole) and returns the count so far (> stop). numpy's path
// took five passes and their temporaries (not_equal into a bool per element,
// count_nonzero, flatnonzero into int64, take, astype): about 6x the time.
// Each 64 elements' bits come from vector compares (AVX2: packs and a
// movemask); blocks without a change cost nothing more.
//
// delta_scatter(flat, where, values) writes `values` into `flat` (1-d,
// contiguous, the same 2- or 4-byte integer dtype) at `where`: int32 or
// int64 flat positions, or a uint8 bitmask as above (the k-th set bit takes
// values[k]). Positions are checked by the caller (weight_delta.changed_at
// on the receiving side; the trainer writes only what delta_compare found).
//
// Built with the other kernels into one library by rollout/kernels/build.py.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace rollout_cpu {
namespace {

// Bit j set when a[j] != b[j], for j in [0, 64).
template <typename T>
inline uint64_t diff_bits64(const T* a, const T* b) {
#if defined(__AVX2__)
  if constexpr (sizeof(T) == 2) {
    uint64_t eq = 0;
    for (int half = 0; half < 2; ++half) {
      const T* pa = a + half * 32;
      const T* pb = b + half * 32;
      __m256i e0 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i*)pa), _mm256_loadu_si256((const __m256i*)pb));
      __m256i e1 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i*)(pa + 16)),
                                      _mm256_loadu_si256((const __m256i*)(pb + 16)));
      // packs interleaves 128-bit lanes: [e0 lo, e1 lo, e0 hi, e1 hi]; the permute restores element order
      __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi16(e0, e1), 0xD8);
      eq |= uint64_t(uint32_t(_mm256_movemask_epi8(packed))) << (32 * half);
    }
    return ~eq;
  } else {
    uint64_t eq = 0;
    for (int part = 0; part < 8; ++part) {
      __m256i e = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i*)(a + 8 * part)),
                                     _mm256_loadu_si256((const __m256i*)(b + 8 * part)));
      eq |= uint64_t(uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(e)))) << (8 * part);
    }
    return ~eq;
  }
#else
  uint64_t bits = 0;
  for (int j = 0; j < 64; ++j) bits |= uint64_t(a[j] != b[j]) << j;
  return bits;
#endif
}

template <typename T>
int64_t compare(const T* a, const T* b, int64_t n, uint8_t* mask, int32_t* index, int64_t index_cap, T* values,
                int64_t values_cap, int64_t stop) {
  int64_t k = 0;
  const int64_t blocks = n / 64;
  for (int64_t blk = 0; blk <= blocks; ++blk) {
    const int64_t base = blk * 64;
    uint64_t bits;
    if (blk < blocks) {
      bits = diff_bits64(a + base, b + base);
      std::memcpy(mask + blk * 8, &bits, 8);  // little-endian: elements 8j..8j+7 in byte j, lowest first
    } else {
      const int64_t rest = n - base;
      if (rest == 0) break;
      bits = 0;
      for (int64_t j = 0; j < rest; ++j) bits |= uint64_t(a[base + j] != b[base + j]) << j;
      std::memcpy(mask + blk * 8, &bits, (rest + 7) / 8);
    }
    if (bits == 0) continue;
    const int64_t count = __builtin_popcountll(bits);
    if (k + count <= index_cap && k + count <= values_cap) {
      int64_t at = k;
      for (uint64_t rest = bits; rest; rest &= rest - 1) {
        const int64_t i = base + __builtin_ctzll(rest);
        index[at] = int32_t(i);
        values[at] = a[i];
        ++at;
      }
    } else {
      int64_t at = k;
      for (uint64_t rest = bits; rest; rest &= rest - 1, ++at) {
        const int64_t i = base + __builtin_ctzll(rest);
        if (at < index_cap) index[at] = int32_t(i);
        if (at < values_cap) values[at] = a[i];
      }
    }
    k += count;
    if (k > stop) return k;
  }
  return k;
}

template <typename T>
void scatter_mask(T* flat, int64_t n, const uint8_t* mask, const T* values) {
  int64_t k = 0;
  const int64_t words = (n + 63) / 64;
  const int64_t mask_bytes = (n + 7) / 8;
  for (int64_t w = 0; w < words; ++w) {
    uint64_t bits = 0;
    std::memcpy(&bits, mask + w * 8, std::min<int64_t>(8, mask_bytes - w * 8));
    for (; bits; bits &= bits - 1) flat[w * 64 + __builtin_ctzll(bits)] = values[k++];
  }
}

template <typename T, typename I>
void scatter_index(T* flat, int64_t n, const I* where, int64_t k, const T* values) {
  bool outside = false;
  for (int64_t j = 0; j < k; ++j) {
    if (uint64_t(where[j]) < uint64_t(n)) {
      flat[where[j]] = values[j];
    } else {
      outside = true;
    }
  }
  TORCH_CHECK(!outside, "delta_scatter: a position is outside the tensor");
}

void check_bits(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.is_contiguous(), what, " must be a 1-d contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kShort || t.scalar_type() == at::kInt, what, " must be int16 or int32 bits");
}

int64_t delta_compare(const at::Tensor& fresh, const at::Tensor& ref, at::Tensor mask, at::Tensor index,
                      at::Tensor values, int64_t stop) {
  check_bits(fresh, "new");
  check_bits(ref, "ref");
  check_bits(values, "values");
  TORCH_CHECK(ref.scalar_type() == fresh.scalar_type() && values.scalar_type() == fresh.scalar_type(),
              "new, ref and values must share a dtype");
  const int64_t n = fresh.numel();
  TORCH_CHECK(ref.numel() == n, "ref must have as many elements as new");
  TORCH_CHECK(n < (int64_t(1) << 31), "delta_compare takes fewer than 2**31 elements");
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.is_contiguous() && mask.numel() >= (n + 7) / 8,
              "mask must be contiguous uint8 of at least ceil(n / 8) bytes");
  TORCH_CHECK(index.scalar_type() == at::kInt && index.is_contiguous(), "index must be contiguous int32");
  auto* m = mask.data_ptr<uint8_t>();
  auto* ix = index.data_ptr<int32_t>();
  if (fresh.scalar_type() == at::kShort) {
    return compare<int16_t>(fresh.data_ptr<int16_t>(), ref.data_ptr<int16_t>(), n, m, ix, index.numel(),
                            values.data_ptr<int16_t>(), values.numel(), stop);
  }
  return compare<int32_t>(fresh.data_ptr<int32_t>(), ref.data_ptr<int32_t>(), n, m, ix, index.numel(),
                          values.data_ptr<int32_t>(), values.numel(), stop);
}

template <typename T>
void scatter_typed(at::Tensor& flat, const at::Tensor& where, const at::Tensor& values) {
  T* dst = flat.data_ptr<T>();
  const T* v = values.data_ptr<T>();
  const int64_t n = flat.numel();
  if (where.scalar_type() == at::kByte) {
    const uint8_t* m = where.data_ptr<uint8_t>();
    int64_t set = 0;
    for (int64_t i = 0; i < where.numel(); ++i) set += __builtin_popcount(m[i]);
    const bool past_end = n % 8 && (m[where.numel() - 1] >> (n % 8));
    TORCH_CHECK(set == values.numel() && !past_end, "delta_scatter: the mask's set bits must match the values");
    scatter_mask<T>(dst, n, m, v);
  } else if (where.scalar_type() == at::kInt) {
    scatter_index<T, int32_t>(dst, n, where.data_ptr<int32_t>(), values.numel(), v);
  } else {
    scatter_index<T, int64_t>(dst, n, where.data_ptr<int64_t>(), values.numel(), v);
  }
}

void delta_scatter(at::Tensor flat, const at::Tensor& where, const at::Tensor& values) {
  check_bits(flat, "flat");
  check_bits(values, "values");
  TORCH_CHECK(values.scalar_type() == flat.scalar_type(), "flat and values must share a dtype");
  TORCH_CHECK(where.dim() == 1 && where.is_contiguous(), "where must be 1-d and contiguous");
  const auto wt = where.scalar_type();
  TORCH_CHECK(wt == at::kByte || wt == at::kInt || wt == at::kLong, "where must be a uint8 mask or int32/int64 positions");
  if (wt == at::kByte) {
    TORCH_CHECK(where.numel() == (flat.numel() + 7) / 8, "a mask must have ceil(n / 8) bytes");
  } else {
    TORCH_CHECK(where.numel() == values.numel(), "where and values must have as many elements");
  }
  if (flat.scalar_type() == at::kShort) {
    scatter_typed<int16_t>(flat, where, values);
  } else {
    scatter_typed<int32_t>(flat, where, values);
  }
}

}  // namespace
}  // namespace rollout_cpu

TORCH_LIBRARY_FRAGMENT(rollout, m) {
  m.def("delta_compare(Tensor new, Tensor ref, Tensor(a!) mask, Tensor(b!) index, Tensor(c!) values, int stop) -> int");
  m.def("delta_scatter(Tensor(a!) flat, Tensor where, Tensor values) -> ()");
}

TORCH_LIBRARY_IMPL(rollout, CPU, m) {
  m.impl("delta_compare", &rollout_cpu::delta_compare);
  m.impl("delta_scatter", &rollout_cpu::delta_scatter);
}
