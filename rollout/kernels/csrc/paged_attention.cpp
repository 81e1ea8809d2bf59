// Decode attention read straight from the paged KV pool, on the CPU.
//
// One query token per sequence attends to the keys and values its block
// table points at. The gather path (index_select of every row's pages, padded
// to the widest row, then SDPA) copies each page once and reads it twice; this
// kernel reads each key and value of each row's own context once, and nothing
// past its length. A work item is a whole sequence, streaming each token's
// keys (all KV heads side by side) in order; with fewer sequences than 4 per
// thread, items are (sequence, KV head) so every thread has work. Scores are
// kept for the whole context (two passes: softmax, then the weighted sum of
// values), so results do not depend on how the pool is split into pages.
//
// Two loops compute an item. The portable one (any dtype and head size) takes
// one dot product per (token, query head) and adds each value row into an
// accumulator in memory. On AVX-512 builds, float32 with head_dim 64 or 128
// takes a loop written with intrinsics: sixteen tokens' partial dot products
// are summed in one transposing reduction, and each KV head's query heads
// keep their accumulators in registers while its values stream past. The
// first query head's pass prefetches the item's whole key and value records,
// so the later heads and pass 2 read from cache while an item's records fit
// in it (with 4 KV heads of 64 floats, 1 KB of keys and 1 KB of values per
// token: a few hundred tokens in a 1 MB L2); and every block of pass 1 also
// prefetches a few tokens of the thread's next item (its first kLeadBytes), so
// DRAM streams the next sequence while this one computes (measured with
// scripts/bench_attention.py; figures in docs/benchmarks.md). AVX2 builds
// without AVX-512 (Zen 3, say) take the same loop in 256-bit registers:
// eight tokens per reduction, pass 2 a cache line of each value row at a time
// (16 registers hold no more accumulators), and the first query head loads
// the value records instead of prefetching them (see decode_avx2).
//
// The intrinsics loops beat the portable one at every batch shape measured,
// most of all with few rows or with the KV in cache (the AVX2 loop by only a
// few percent at 100+ rows with the KV in DRAM); all beat the gather path,
// which copies every page before SDPA reads it (figures in docs/benchmarks.md).
//
// Built at first use by rollout/kernels/build.py and registered as
// torch.ops.rollout.paged_decode.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// Where one call's keys and values lie, and how its rows are split into work items for the
// current number of threads.
struct Layout {
  int64_t rows, head_dim, group, page_size, page_stride, token_stride;
  int64_t head_blocks, block_heads, block_q;  // items per row, KV heads per item, query heads per item

  Layout(const at::Tensor& q, const at::Tensor& k_cache)
      : rows(q.size(0)),
        head_dim(q.size(2)),
        group(q.size(1) / k_cache.size(2)),
        page_size(k_cache.size(1)),
        page_stride(k_cache.size(1) * k_cache.size(2) * q.size(2)),
        token_stride(k_cache.size(2) * q.size(2)),
        // Few rows: split each row's KV heads across threads; many: whole rows stream their pages.
        head_blocks(q.size(0) >= 4 * at::get_num_threads() ? 1 : k_cache.size(2)),
        block_heads(k_cache.size(2) / head_blocks),
        block_q(block_heads * group) {}
};

// A work item's tokens: for each of `count`, the offset of that token's first key of the item
// in the key cache (the value cache shares the layout).
struct Tokens {
  const int64_t* offsets;
  int64_t count;
};

// Runs `item(row, head0, tokens, next, scratch)` for every work item, split across threads: its
// row, its first KV head, its tokens, and the tokens of the item the same thread runs next
// (count 0 after its last), which a loop may prefetch while it computes this one. `scratch` is
// the thread's to reuse.
template <typename Item>
void for_each_item(const Layout& layout, const at::Tensor& block_tables, const at::Tensor& context_lens,
                   int64_t window, const Item& item) {
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t table_row = block_tables.stride(0);
  const auto fill = [&](int64_t index, std::vector<int64_t>& offsets) {
    const int64_t row = index / layout.head_blocks, head0 = (index % layout.head_blocks) * layout.block_heads;
    const int64_t len = lens[row], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t* table = tables + row * table_row;
    offsets.resize(len - first);
    for (int64_t t = first; t < len;) {
      const int64_t page = t / layout.page_size, stop = std::min(len, (page + 1) * layout.page_size);
      int64_t offset = table[page] * layout.page_stride + (t - page * layout.page_size) * layout.token_stride +
                       head0 * layout.head_dim;
      for (; t < stop; ++t, offset += layout.token_stride) offsets[t - first] = offset;
    }
  };
  at::parallel_for(0, layout.rows * layout.head_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> offsets, next;
    std::vector<float> scratch;
    fill(begin, next);
    for (int64_t index = begin; index < end; ++index) {
      offsets.swap(next);
      if (index + 1 < end) fill(index + 1, next);
      else next.clear();
      item(index / layout.head_blocks, (index % layout.head_blocks) * layout.block_heads,
           Tokens{offsets.data(), static_cast<int64_t>(offsets.size())},
           Tokens{next.data(), static_cast<int64_t>(next.size())}, scratch);
    }
  });
}

// Softmax over each of `heads` rows of `count` scores, in place and unnormalised; the
// reciprocal of each row's sum goes to inv_sum.
void softmax_rows(float* scores, int64_t heads, int64_t count, float* inv_sum) {
  for (int64_t j = 0; j < heads; ++j) {
    float* row_scores = scores + j * count;
    float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < count; ++i) top = std::max(top, row_scores[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < count; ++i) {
      row_scores[i] = vec_exp(row_scores[i] - top);
      sum += row_scores[i];
    }
    inv_sum[j] = 1.f / sum;
  }
}

// Dot product of a float query with one key row; D known at compile time unrolls it fully.
template <int64_t D, typename scalar_t>
inline float dot(const float* __restrict q, const scalar_t* __restrict k, int64_t n) {
  const int64_t len = D > 0 ? D : n;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < len; ++d) s = madd(q[d], static_cast<float>(k[d]), s);
  return s;
}

template <int64_t D, typename scalar_t>
inline void axpy(float p, const scalar_t* __restrict v, float* __restrict acc, int64_t n) {
  const int64_t len = D > 0 ? D : n;
#pragma omp simd
  for (int64_t d = 0; d < len; ++d) acc[d] = madd(p, static_cast<float>(v[d]), acc[d]);
}

// The portable loop: any dtype (accumulating in float32) and head size; the cache may hold
// bfloat16 under float32 queries.
template <int64_t D, typename scalar_t, typename cache_t>
void decode_portable(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out, float scale,
                     int64_t window) {
  const Layout layout(q, k_cache);
  const int64_t head_dim = layout.head_dim, group = layout.group, block_q = layout.block_q;
  const int64_t q_row = q.stride(0), q_head = q.stride(1), out_row = out.stride(0), out_head = out.stride(1);
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const cache_t* k_data = k_cache.data_ptr<cache_t>();
  const cache_t* v_data = v_cache.data_ptr<cache_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  const int64_t block_values = layout.block_heads * head_dim, line_values = 64 / sizeof(cache_t);

  for_each_item(layout, block_tables, context_lens, window, [&](int64_t row, int64_t head0, Tokens tokens, Tokens,
                                                                std::vector<float>& scratch) {
    const int64_t* offsets = tokens.offsets;
    const int64_t count = tokens.count;
    scratch.resize(block_q * (2 * head_dim + 1 + count));
    float* query = scratch.data();
    float* acc = query + block_q * head_dim;
    float* inv_sum = acc + block_q * head_dim;
    float* score = inv_sum + block_q;
    for (int64_t j = 0; j < block_q; ++j) {
      const scalar_t* src = q_data + row * q_row + (head0 * group + j) * q_head;
      for (int64_t d = 0; d < head_dim; ++d) query[j * head_dim + d] = static_cast<float>(src[d]) * scale;
    }

    // Pass 1: every query head of the item against every key. Each token's values are
    // prefetched meanwhile for pass 2, so two streams are in flight: that hides part of the
    // DRAM latency when KV pages lie strided or scattered, as a busy pool leaves them.
    for (int64_t i = 0; i < count; ++i) {
      const cache_t* key = k_data + offsets[i];
      for (int64_t o = 0; o < block_values; o += line_values) __builtin_prefetch(v_data + offsets[i] + o, 0, 2);
      for (int64_t j = 0; j < block_q; ++j)
        score[j * count + i] = dot<D>(query + j * head_dim, key + (j / group) * head_dim, head_dim);
    }
    softmax_rows(score, block_q, count, inv_sum);

    // Pass 2: the probability-weighted sum of values.
    std::fill(acc, acc + block_q * head_dim, 0.f);
    for (int64_t i = 0; i < count; ++i) {
      const cache_t* value = v_data + offsets[i];
      for (int64_t j = 0; j < block_q; ++j)
        axpy<D>(score[j * count + i], value + (j / group) * head_dim, acc + j * head_dim, head_dim);
    }
    for (int64_t j = 0; j < block_q; ++j) {
      scalar_t* dst = out_data + row * out_row + (head0 * group + j) * out_head;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[j * head_dim + d] * inv_sum[j]);
    }
  });
}

#if defined(__AVX512F__)
// Sixteen cache values as float32: bfloat16 is the high half of a float32's bits.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Lane i of the result is the sum of the sixteen lanes of v[i].
inline __m512 transpose_sum16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2k], v[2k+1]
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit block: that block's sums of v[4k..4k+3]
    const __m512d a = _mm512_castps_pd(pairs[2 * k]), b = _mm512_castps_pd(pairs[2 * k + 1]);
    quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const auto fold = [](__m512 a, __m512 b) {  // [a0+a1, a2+a3, b0+b1, b2+b3] in 128-bit blocks
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return fold(fold(quads[0], quads[1]), fold(quads[2], quads[3]));
}

// One query head (DV vectors, already scaled) times one key row, summed lane by lane.
template <int DV, typename cache_t>
inline __m512 dot_lanes(const __m512* query, const cache_t* key) {
  __m512 s = _mm512_mul_ps(query[0], load16(key));
  for (int d = 1; d < DV; ++d) s = _mm512_fmadd_ps(query[d], load16(key + 16 * d), s);
  return s;
}

// Pass 2 for `heads` (at most NH) query heads that share one KV head: their accumulators stay
// in registers while the values stream past. probs holds each head's row of `count` probabilities.
template <int DV, int NH, typename cache_t>
inline void weighted_values(int64_t heads, const cache_t* values, const int64_t* offsets, int64_t count,
                            const float* probs, const float* inv_sum, float* dst, int64_t dst_head) {
  if constexpr (NH > 1) {  // the accumulators are registers: their count is fixed at compile time
    if (heads < NH)
      return weighted_values<DV, NH - 1, cache_t>(heads, values, offsets, count, probs, inv_sum, dst, dst_head);
  }
  __m512 acc[NH][DV];
  for (int h = 0; h < NH; ++h)
    for (int d = 0; d < DV; ++d) acc[h][d] = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    __m512 value[DV];
    for (int d = 0; d < DV; ++d) value[d] = load16(values + offsets[i] + 16 * d);
    for (int h = 0; h < NH; ++h) {
      const __m512 p = _mm512_set1_ps(probs[h * count + i]);
      for (int d = 0; d < DV; ++d) acc[h][d] = _mm512_fmadd_ps(p, value[d], acc[h][d]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m512 inv = _mm512_set1_ps(inv_sum[h]);
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(dst + h * dst_head + 16 * d, _mm512_mul_ps(acc[h][d], inv));
  }
}

// How many bytes of the next item's keys and values an item prefetches while it computes.
constexpr int64_t kLeadBytes = 256 * 1024;

// The intrinsics loop: float32 queries, a float32 or bfloat16 cache, head_dim D = 16 * DV.
template <int64_t D, typename cache_t>
void decode_avx512(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out, float scale,
                   int64_t window) {
  constexpr int DV = D / 16, kMaxHeads = 16 / DV;  // pass 2 keeps at most 16 accumulator registers
  const Layout layout(q, k_cache);
  const int64_t group = layout.group, block_q = layout.block_q, block_values = layout.block_heads * D;
  const int64_t q_row = q.stride(0), q_head = q.stride(1), out_row = out.stride(0), out_head = out.stride(1);
  const float* q_data = q.data_ptr<float>();
  const cache_t* k_data = k_cache.data_ptr<cache_t>();
  const cache_t* v_data = v_cache.data_ptr<cache_t>();
  float* out_data = out.data_ptr<float>();
  constexpr int64_t line_values = 64 / sizeof(cache_t);

  for_each_item(layout, block_tables, context_lens, window, [&](int64_t row, int64_t head0, Tokens tokens, Tokens next,
                                                                std::vector<float>& scratch) {
    const int64_t* offsets = tokens.offsets;
    const int64_t count = tokens.count;
    scratch.resize(block_q * (1 + count));
    float* inv_sum = scratch.data();
    float* score = inv_sum + block_q;

    // The next item's leading tokens, prefetched a few per block of pass 1 (see kLeadBytes).
    const int64_t lead = std::min<int64_t>(next.count, kLeadBytes / (2 * block_values * sizeof(cache_t)));
    const int64_t blocks = block_q * ((count + 15) / 16), per_block = (lead + blocks - 1) / blocks;
    int64_t fetched = 0;

    // Pass 1, one query head at a time; the first prefetches the item's key and value records.
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < block_q; ++j) {
      const float* src = q_data + row * q_row + (head0 * group + j) * q_head;
      __m512 query[DV];
      for (int d = 0; d < DV; ++d) query[d] = _mm512_mul_ps(_mm512_loadu_ps(src + 16 * d), scale_v);
      const cache_t* keys = k_data + (j / group) * D;
      float* scores = score + j * count;
      __m512 lanes[16];
      for (int64_t i = 0; i < count; i += 16) {
        const int64_t n = std::min<int64_t>(16, count - i);
        if (j == 0) {
          for (int64_t u = i; u < i + n; ++u)
            for (int64_t o = 0; o < block_values; o += line_values) {
              __builtin_prefetch(k_data + offsets[u] + o, 0, 2);
              __builtin_prefetch(v_data + offsets[u] + o, 0, 2);
            }
        }
        for (const int64_t stop = std::min(lead, fetched + per_block); fetched < stop; ++fetched)
          for (int64_t o = 0; o < block_values; o += line_values) {
            __builtin_prefetch(k_data + next.offsets[fetched] + o, 0, 2);
            __builtin_prefetch(v_data + next.offsets[fetched] + o, 0, 2);
          }
        if (n == 16) {
          for (int u = 0; u < 16; ++u) lanes[u] = dot_lanes<DV>(query, keys + offsets[i + u]);
          _mm512_storeu_ps(scores + i, transpose_sum16(lanes));
        } else {
          for (int u = 0; u < 16; ++u)
            lanes[u] = u < n ? dot_lanes<DV>(query, keys + offsets[i + u]) : _mm512_setzero_ps();
          _mm512_mask_storeu_ps(scores + i, static_cast<__mmask16>((1u << n) - 1), transpose_sum16(lanes));
        }
      }
    }
    softmax_rows(score, block_q, count, inv_sum);

    // Pass 2, per KV head, its query heads in chunks of at most kMaxHeads; a chunk never
    // crosses into the next KV head's query heads, so the chunks are the same for whole-row
    // and per-KV-head items.
    for (int64_t j = 0, heads = 0; j < block_q; j += heads) {
      heads = std::min<int64_t>(kMaxHeads, group - j % group);
      const cache_t* values = v_data + (j / group) * D;
      float* dst = out_data + row * out_row + (head0 * group + j) * out_head;
      const float* probs = score + j * count;
      weighted_values<DV, kMaxHeads>(heads, values, offsets, count, probs, inv_sum + j, dst, out_head);
    }
  });
}
#elif defined(__AVX2__) && defined(__FMA__)
// Eight cache values as float32: bfloat16 is the high half of a float32's bits.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Lane i of the result is the sum of the eight lanes of v[i].
inline __m256 transpose_sum8(const __m256* v) {
  __m256 pairs[4], quads[2];
  for (int k = 0; k < 4; ++k)  // per 128-bit half: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2k], v[2k+1]
    pairs[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 2; ++k) {  // per 128-bit half: that half's sums of v[4k..4k+3]
    const __m256d a = _mm256_castps_pd(pairs[2 * k]), b = _mm256_castps_pd(pairs[2 * k + 1]);
    quads[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),   // [low halves of quads]
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));  // + [high halves]
}

// One query head (D floats, already scaled) times eight key rows, summed lane by lane. The
// query is read 64 floats at a time: those 8 vectors and the 8 sums fill the 16 ymm registers.
template <int D, typename cache_t>
inline void dot_lanes8(const float* query, const cache_t* const* keys, __m256* lanes) {
  for (int c = 0; c < D; c += 64) {
    __m256 q[8];
    for (int d = 0; d < 8; ++d) q[d] = _mm256_loadu_ps(query + c + 8 * d);
    for (int u = 0; u < 8; ++u) {
      const cache_t* key = keys[u] + c;
      __m256 s = c == 0 ? _mm256_mul_ps(q[0], load8(key)) : _mm256_fmadd_ps(q[0], load8(key), lanes[u]);
      for (int d = 1; d < 8; ++d) s = _mm256_fmadd_ps(q[d], load8(key + 8 * d), s);
      lanes[u] = s;
    }
  }
}

// Pass 2 for `heads` (at most NH) query heads that share one KV head, over DV vectors of their
// columns: the accumulators stay in registers while the values stream past. probs holds each
// head's row of `count` probabilities.
template <int DV, int NH, typename cache_t>
inline void weighted_values8(int64_t heads, const cache_t* values, const int64_t* offsets, int64_t count,
                             const float* probs, const float* inv_sum, float* dst, int64_t dst_head) {
  if constexpr (NH > 1) {  // the accumulators are registers: their count is fixed at compile time
    if (heads < NH)
      return weighted_values8<DV, NH - 1, cache_t>(heads, values, offsets, count, probs, inv_sum, dst, dst_head);
  }
  __m256 acc[NH][DV];
  for (int h = 0; h < NH; ++h)
    for (int d = 0; d < DV; ++d) acc[h][d] = _mm256_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    __m256 value[DV];
    for (int d = 0; d < DV; ++d) value[d] = load8(values + offsets[i] + 8 * d);
    for (int h = 0; h < NH; ++h) {
      const __m256 p = _mm256_broadcast_ss(probs + h * count + i);
      for (int d = 0; d < DV; ++d) acc[h][d] = _mm256_fmadd_ps(p, value[d], acc[h][d]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m256 inv = _mm256_set1_ps(inv_sum[h]);
    for (int d = 0; d < DV; ++d) _mm256_storeu_ps(dst + h * dst_head + 8 * d, _mm256_mul_ps(acc[h][d], inv));
  }
}

// The AVX2 loop, for builds without AVX-512: float32 queries, a float32 or bfloat16 cache,
// head_dim D of 64 or 128. It does not prefetch the next item as the AVX-512 loop does: that
// is not measured yet on an AVX2 host, whose L2 (512 KB on Zen 3) holds half as much.
template <int64_t D, typename cache_t>
void decode_avx2(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out, float scale,
                 int64_t window) {
  // Pass 2 takes 16 columns (one cache line of each value row) of as many query heads as the
  // 16 ymm registers hold beside those columns and a probability: 6, in 12 accumulators.
  // Whole rows of one head at a time (8 accumulators) were as fast with the values in DRAM and
  // slower with them in cache.
  constexpr int DV = 2, kMaxHeads = (16 - DV - 1) / DV;
  const Layout layout(q, k_cache);
  const int64_t group = layout.group, block_q = layout.block_q, block_values = layout.block_heads * D;
  const int64_t q_row = q.stride(0), q_head = q.stride(1), out_row = out.stride(0), out_head = out.stride(1);
  const float* q_data = q.data_ptr<float>();
  const cache_t* k_data = k_cache.data_ptr<cache_t>();
  const cache_t* v_data = v_cache.data_ptr<cache_t>();
  float* out_data = out.data_ptr<float>();
  constexpr int64_t line_values = 64 / sizeof(cache_t);

  for_each_item(layout, block_tables, context_lens, window, [&](int64_t row, int64_t head0, Tokens tokens, Tokens,
                                                                std::vector<float>& scratch) {
    const int64_t* offsets = tokens.offsets;
    const int64_t count = tokens.count;
    scratch.resize(block_q * (1 + count));
    float* inv_sum = scratch.data();
    float* score = inv_sum + block_q;

    // Pass 1, one query head at a time; the first prefetches the item's key records and reads
    // a float of each line of its value records. With the KV in DRAM, prefetching the values
    // too left most of them out of cache by pass 2 on Zen 3 (the loop ran 40% slower than the
    // portable one); a load does bring its line in, and nothing depends on it.
    const __m256 scale_v = _mm256_set1_ps(scale);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t j = 0; j < block_q; ++j) {
      const float* src = q_data + row * q_row + (head0 * group + j) * q_head;
      alignas(32) float query[D];
      for (int d = 0; d < D; d += 8) _mm256_store_ps(query + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), scale_v));
      const cache_t* keys = k_data + (j / group) * D;
      float* scores = score + j * count;
      for (int64_t i = 0; i < count; i += 8) {
        const int64_t n = std::min<int64_t>(8, count - i);
        if (j == 0) {
          for (int64_t u = i; u < i + n; ++u)
            for (int64_t o = 0; o < block_values; o += line_values) {
              __builtin_prefetch(k_data + offsets[u] + o, 0, 2);
              static_cast<void>(*reinterpret_cast<const volatile char*>(v_data + offsets[u] + o));
            }
        }
        const cache_t* key[8];  // a short last block repeats its last token, whose sums are not stored
        for (int u = 0; u < 8; ++u) key[u] = keys + offsets[i + std::min<int64_t>(u, n - 1)];
        __m256 lanes[8];
        dot_lanes8<D>(query, key, lanes);
        if (n == 8)
          _mm256_storeu_ps(scores + i, transpose_sum8(lanes));
        else
          _mm256_maskstore_ps(scores + i, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane), transpose_sum8(lanes));
      }
    }
    softmax_rows(score, block_q, count, inv_sum);

    // Pass 2, per KV head, its query heads in chunks of at most kMaxHeads (a chunk never
    // crosses into the next KV head's query heads), each chunk 16 columns at a time.
    for (int64_t j = 0, heads = 0; j < block_q; j += heads) {
      heads = std::min<int64_t>(kMaxHeads, group - j % group);
      const cache_t* values = v_data + (j / group) * D;
      float* dst = out_data + row * out_row + (head0 * group + j) * out_head;
      const float* probs = score + j * count;
      for (int64_t c = 0; c < D; c += 8 * DV)
        weighted_values8<DV, kMaxHeads>(heads, values + c, offsets, count, probs, inv_sum + j, dst + c, out_head);
    }
  });
}
#endif

template <typename scalar_t, typename cache_t>
void decode_any_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out, float scale,
                    int64_t window) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    switch (q.size(2)) {
      case 64:
        return decode_avx512<64, cache_t>(q, k_cache, v_cache, block_tables, context_lens, out, scale, window);
      case 128:
        return decode_avx512<128, cache_t>(q, k_cache, v_cache, block_tables, context_lens, out, scale, window);
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    switch (q.size(2)) {
      case 64:
        return decode_avx2<64, cache_t>(q, k_cache, v_cache, block_tables, context_lens, out, scale, window);
      case 128:
        return decode_avx2<128, cache_t>(q, k_cache, v_cache, block_tables, context_lens, out, scale, window);
    }
  }
#endif
  switch (q.size(2)) {
    case 64:
      return decode_portable<64, scalar_t, cache_t>(q, k_cache, v_cache, block_tables, context_lens, out, scale,
                                                    window);
    case 128:
      return decode_portable<128, scalar_t, cache_t>(q, k_cache, v_cache, block_tables, context_lens, out, scale,
                                                     window);
    default:
      return decode_portable<0, scalar_t, cache_t>(q, k_cache, v_cache, block_tables, context_lens, out, scale,
                                                   window);
  }
}

// Checks everything the loop relies on before any output is written.
void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode runs on CPU tensors, got q on ", q.device());
  TORCH_CHECK(q.dim() == 3, "q must be [rows, q_heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [pages, page_size, kv_heads, head_dim], got ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache ", v_cache.sizes(), " must match k_cache ",
              k_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == q.scalar_type() ||
                   (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)),
              "q and out must share one dtype, and k_cache and v_cache either that dtype or bfloat16 under float32 "
              "queries; got q ",
              q.scalar_type(), ", out ", out.scalar_type(), ", k_cache ", k_cache.scalar_type(), ", v_cache ",
              v_cache.scalar_type());
  TORCH_CHECK(out.sizes() == q.sizes(), "out ", out.sizes(), " must match q ", q.sizes());
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out must be contiguous in head_dim");
  TORCH_CHECK(k_cache.size(1) > 0 && k_cache.size(2) > 0 && k_cache.size(3) > 0,
              "k_cache needs a page_size, kv_heads and head_dim of at least 1, got ", k_cache.sizes());
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q head_dim ", q.size(2), " != k_cache head_dim ", k_cache.size(3));
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "q_heads ", q.size(1), " must be a multiple of kv_heads ",
              k_cache.size(2));
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && block_tables.stride(1) == 1,
              "block_tables must be [rows, pages] with contiguous rows, got ", block_tables.sizes());
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0) && context_lens.is_contiguous(),
              "context_lens must be [rows], got ", context_lens.sizes());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t page_size = k_cache.size(1), num_pages = k_cache.size(0), width = block_tables.size(1);
  for (int64_t row = 0; row < q.size(0); ++row) {
    const int64_t len = lens[row];
    TORCH_CHECK(len >= 1 && len <= width * page_size, "context_lens[", row, "] = ", len, " must be in [1, ",
                width * page_size, "] (block table width ", width, " x page_size ", page_size, ")");
    for (int64_t p = 0; p < (len + page_size - 1) / page_size; ++p) {
      const int64_t page = tables[row * block_tables.stride(0) + p];
      TORCH_CHECK(page >= 0 && page < num_pages, "block_tables[", row, ", ", p, "] = ", page,
                  " is not a page of the pool (0..", num_pages - 1, ")");
    }
  }
}

}  // namespace

void rollout_cpu::paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor out,
                               double scale, int64_t window) {
  check_inputs(q, k_cache, v_cache, block_tables, context_lens, out);
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat:
      if (k_cache.scalar_type() == at::kBFloat16)
        return decode_any_dim<float, at::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, s, window);
      return decode_any_dim<float, float>(q, k_cache, v_cache, block_tables, context_lens, out, s, window);
    case at::kBFloat16:
      return decode_any_dim<at::BFloat16, at::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, s,
                                                        window);
    case at::kHalf:
      return decode_any_dim<at::Half, at::Half>(q, k_cache, v_cache, block_tables, context_lens, out, s, window);
    default:
      TORCH_CHECK(false, "paged_decode supports float32, bfloat16 and float16, got ", q.scalar_type());
  }
}

TORCH_LIBRARY(rollout, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
      "Tensor(a!) out, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(rollout, CPU, m) { m.impl("paged_decode", &rollout_cpu::paged_decode); }
