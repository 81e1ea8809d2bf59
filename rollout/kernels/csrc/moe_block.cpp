// A whole sparse (mixture-of-experts) layer in one op, float32 on the CPU
// (rollout/model/moe.py): the router, softmax and top-k, the grouping of
// token-expert pairs by expert, every expert's gate/up projection with
// SiLU-times-up, its down projection scaled by the gate weight, and the sum of
// each token's pairs. One parallel region per layer, no gather of the rows and
// no torch op between the steps.
//
// At a decode step an expert gets few rows (about 16 in the benchmark's shape:
// 64 tokens x top 4 / 16 experts), where a BLAS GEMM runs at well under its
// large-matrix rate. The experts' weights stay in their checkpoint layout
// ([N, K] rows, so pushes of one expert need no repacking) and a register-
// blocked kernel takes 3 rows x 4 weight rows at a time: 12 accumulators of 8
// lanes, each weight row read once per 3 rows from L1, the rows read in place
// from x through their token's pointer. Work items are (expert, block of rows,
// block of output columns): every expert's weights are read once per step per
// row block, and the threads share items of a few microseconds each, so a step
// with 16 busy experts and one with 2 spread alike.
//
// Each output value is one dot product summed in a fixed order (8 lanes over
// K, then the lanes pairwise), and each token's pairs are added in ascending
// expert order from zero, as transformers' index_add_ loop does: the result
// does not depend on the thread count or on which thread ran what.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int kLanes = 8;
constexpr int kTileRows = 3, kTileCols = 4;  // 12 accumulators + 3 rows + 1 weight vector: 16 registers
constexpr int64_t kRowBlock = 48;            // rows of an item: 48 x K floats stay in L2 while its weights pass
// Output columns of an item: gate/up 32 (32 gate and 32 up weight rows, 64 KB at H = 512), down 64
// (48 KB at I = 192). Fewer, longer items start fewer weight streams cold (the first tile of an item
// is not prefetched); at the benchmark's decode shape 96 + 128 items still share 2 threads evenly.
constexpr int64_t kUpCols = 32, kDownCols = 64;

#if defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
// The lanes summed as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), one vector or four at once.
inline float vsum(Vec v) {
  __m128 s = _mm_hadd_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
inline void vsum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
#else
struct Vec {
  float v[kLanes];
};
inline Vec vzero() { return Vec{}; }
inline Vec vload(const float* p) {
  Vec r;
  for (int l = 0; l < kLanes; ++l) r.v[l] = p[l];
  return r;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int l = 0; l < kLanes; ++l) c.v[l] = madd(a.v[l], b.v[l], c.v[l]);
  return c;
}
inline float vsum(Vec v) {
  return ((v.v[0] + v.v[1]) + (v.v[2] + v.v[3])) + ((v.v[4] + v.v[5]) + (v.v[6] + v.v[7]));
}
inline void vsum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  out[0] = vsum(a), out[1] = vsum(b), out[2] = vsum(c), out[3] = vsum(d);
}
#endif

// out[m * ldo + n] = dot(x[m], w[n]) over k, for MR rows and NR weight rows.
template <int MR, int NR>
void tile(const float* const* x_rows, const float* const* w_rows, int64_t k, float* out, int64_t ldo) {
  const float* x[MR];
  const float* w[NR];
  for (int m = 0; m < MR; ++m) x[m] = x_rows[m];
  for (int n = 0; n < NR; ++n) w[n] = w_rows[n];
  Vec acc[MR][NR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) acc[m][n] = vzero();
  }
  const int64_t body = k - k % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    Vec xv[MR];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) xv[m] = vload(x[m] + i);
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) {
      const Vec wv = vload(w[n] + i);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) acc[m][n] = vfma(xv[m], wv, acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float* y = out + m * ldo;
    if constexpr (NR == 4) {
      vsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3], y);
    } else {
      for (int n = 0; n < NR; ++n) y[n] = vsum(acc[m][n]);
    }
    if (body < k) {
      for (int n = 0; n < NR; ++n) {
        float s = y[n];
        for (int64_t i = body; i < k; ++i) s = madd(x[m][i], w[n][i], s);
        y[n] = s;
      }
    }
  }
}

using TileFn = void (*)(const float* const*, const float* const*, int64_t, float*, int64_t);

template <int MR>
constexpr TileFn kTiles[kTileCols] = {tile<MR, 1>, tile<MR, 2>, tile<MR, 3>, tile<MR, 4>};

inline void prefetch(const float* p) {
#if defined(__AVX2__) && defined(__FMA__)
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#else
  (void)p;
#endif
}

// out[m * ldo + n] = dot(x[m], w[n]) for m < rows, n < cols. The weight rows of a
// tile stay in L1 while every block of rows passes, and the next tile's weight
// rows are fetched meanwhile, a share before each block of rows: at a decode
// step's few rows the weights stream from memory, and the hardware's
// prefetchers start too late on rows this short.
void dots(const float* const* x, int64_t rows, const float* const* w, int64_t cols, int64_t k, float* out,
          int64_t ldo) {
  static constexpr const TileFn* by_rows[kTileRows] = {kTiles<1>, kTiles<2>, kTiles<3>};
  constexpr int64_t kLineFloats = 16;
  const int64_t lines = (k + kLineFloats - 1) / kLineFloats, row_tiles = (rows + kTileRows - 1) / kTileRows;
  for (int64_t n = 0; n < cols; n += kTileCols) {
    const int64_t nr = std::min<int64_t>(kTileCols, cols - n);
    const int64_t ahead = std::min<int64_t>(kTileCols, std::max<int64_t>(0, cols - n - kTileCols));
    const float* const* next = w + n + kTileCols;
    for (int64_t m = 0, t = 0; m < rows; m += kTileRows, ++t) {
      for (int64_t l = ahead * lines * t / row_tiles; l < ahead * lines * (t + 1) / row_tiles; ++l) {
        prefetch(next[l / lines] + l % lines * kLineFloats);
      }
      const int64_t mr = std::min<int64_t>(kTileRows, rows - m);
      by_rows[mr - 1][nr - 1](x + m, w + n, k, out + m * ldo + n, ldo);
    }
  }
}

struct Item {
  int64_t expert, start, rows, col;  // pairs [start, start + rows) of the grouped order, columns from col
};

// Items over each expert's pairs: blocks of kRowBlock rows x `block` columns of `width`.
std::vector<Item> items(const std::vector<int64_t>& counts, int64_t width, int64_t block) {
  std::vector<Item> out;
  int64_t start = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); start += counts[e], ++e) {
    for (int64_t r = 0; r < counts[e]; r += kRowBlock) {
      for (int64_t c = 0; c < width; c += block) {
        out.push_back({e, start + r, std::min(kRowBlock, counts[e] - r), c});
      }
    }
  }
  return out;
}

// The router's softmax over one token's logits (in place) and its top k: experts
// in descending probability (lower id first on ties), weights renormalised when
// `normalize`.
void route(float* p, int64_t experts, int64_t top_k, bool normalize, int64_t* chosen, float* weights) {
  float peak = p[0];
  for (int64_t e = 1; e < experts; ++e) peak = std::max(peak, p[e]);
  float sum = 0.f;
  for (int64_t e = 0; e < experts; ++e) sum += (p[e] = std::exp(p[e] - peak));
  for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
  float total = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e) {
      const bool taken = std::find(chosen, chosen + j, e) != chosen + j;
      if (!taken && (best < 0 || p[e] > p[best])) best = e;
    }
    chosen[j] = best;
    weights[j] = p[best];
    total += p[best];
  }
  if (normalize) {
    for (int64_t j = 0; j < top_k; ++j) weights[j] /= total;
  }
}

}  // namespace

namespace rollout_cpu {

// x [T, H]; router [E, H]; gate_up [E * 2I, H] (expert e's gate rows at e * 2I, its up rows
// after them); down [E * H, I]. Returns the layer's output [T, H] and the experts each token
// went to, [T, top_k] int64 in descending gate order.
std::tuple<at::Tensor, at::Tensor> moe_block(const at::Tensor& x, const at::Tensor& router, const at::Tensor& gate_up,
                                             const at::Tensor& down, int64_t top_k, bool normalize) {
  for (const auto* t : {&x, &router, &gate_up, &down}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2,
                "moe_block takes contiguous 2-D float32 CPU tensors");
  }
  const int64_t tokens = x.size(0), h = x.size(1), experts = router.size(0), inter = down.size(1);
  TORCH_CHECK(router.size(1) == h && gate_up.size(0) == experts * 2 * inter && gate_up.size(1) == h &&
                  down.size(0) == experts * h,
              "moe_block: router must be [E, H], gate_up [E * 2I, H] and down [E * H, I], got ", router.sizes(), ", ",
              gate_up.sizes(), " and ", down.sizes(), " for H = ", h);
  TORCH_CHECK(top_k >= 1 && top_k <= std::min<int64_t>(experts, 64), "moe_block: top_k must be in 1..",
              std::min<int64_t>(experts, 64), ", got ", top_k);
  at::Tensor out = at::empty({tokens, h}, x.options());
  at::Tensor chosen = at::empty({tokens, top_k}, x.options().dtype(at::kLong));
  if (tokens == 0) return {out, chosen};
  const int64_t pairs = tokens * top_k;
  std::vector<float> logits(tokens * experts), token_weights(pairs), pair_weights(pairs);
  std::vector<int64_t> position(pairs), counts(experts);
  std::vector<const float*> x_rows(tokens), pair_rows(pairs), act_rows(pairs);
  at::Tensor act = at::empty({pairs, inter}, x.options());
  at::Tensor scaled = at::empty({pairs, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = router.data_ptr<float>();
  const float* gp = gate_up.data_ptr<float>();
  const float* dp = down.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  float* sp = scaled.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t* cp = chosen.data_ptr<int64_t>();
  std::vector<const float*> router_rows(experts);
  for (int64_t e = 0; e < experts; ++e) router_rows[e] = rp + e * h;
  for (int64_t t = 0; t < tokens; ++t) x_rows[t] = xp + t * h;
  for (int64_t j = 0; j < pairs; ++j) act_rows[j] = ap + j * inter;
  std::vector<Item> up_items, down_items;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tokens * experts));

#pragma omp parallel num_threads(threads)
  {
    // The router's logits and each token's experts, a block of tokens per thread.
#pragma omp for schedule(static)
    for (int64_t t0 = 0; t0 < tokens; t0 += kTileRows) {
      const int64_t n = std::min<int64_t>(kTileRows, tokens - t0);
      dots(x_rows.data() + t0, n, router_rows.data(), experts, h, logits.data() + t0 * experts, experts);
      for (int64_t t = t0; t < t0 + n; ++t) {
        route(logits.data() + t * experts, experts, top_k, normalize, cp + t * top_k, token_weights.data() + t * top_k);
      }
    }
    // Pairs grouped by expert, tokens in order within an expert (a stable counting sort).
#pragma omp single
    {
      for (int64_t j = 0; j < pairs; ++j) ++counts[cp[j]];
      std::vector<int64_t> next(experts);
      for (int64_t e = 1; e < experts; ++e) next[e] = next[e - 1] + counts[e - 1];
      for (int64_t j = 0; j < pairs; ++j) {
        const int64_t p = next[cp[j]]++;
        position[j] = p;
        pair_rows[p] = x_rows[j / top_k];
        pair_weights[p] = token_weights[j];
      }
      up_items = items(counts, inter, kUpCols);
      down_items = items(counts, h, kDownCols);
    }
    // Gate/up projections and SiLU-times-up: act[pair] for a block of columns.
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < up_items.size(); ++i) {
      const Item& it = up_items[i];
      const int64_t cols = std::min(kUpCols, inter - it.col);
      const float* w[2 * kUpCols];
      for (int64_t c = 0; c < cols; ++c) {
        w[c] = gp + (it.expert * 2 * inter + it.col + c) * h;
        w[cols + c] = gp + (it.expert * 2 * inter + inter + it.col + c) * h;
      }
      float gu[kRowBlock * 2 * kUpCols];
      dots(pair_rows.data() + it.start, it.rows, w, 2 * cols, h, gu, 2 * cols);
      for (int64_t m = 0; m < it.rows; ++m) {
        const float* g = gu + m * 2 * cols;
        float* y = ap + (it.start + m) * inter + it.col;
        for (int64_t c = 0; c < cols; ++c) y[c] = g[c] / (1.f + vec_exp(-g[c])) * g[cols + c];
      }
    }
    // Down projections, each pair's row scaled by its gate weight.
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < down_items.size(); ++i) {
      const Item& it = down_items[i];
      const int64_t cols = std::min(kDownCols, h - it.col);
      const float* w[kDownCols];
      for (int64_t c = 0; c < cols; ++c) w[c] = dp + (it.expert * h + it.col + c) * inter;
      float* y = sp + it.start * h + it.col;
      dots(act_rows.data() + it.start, it.rows, w, cols, inter, y, h);
      for (int64_t m = 0; m < it.rows; ++m) {
        const float weight = pair_weights[it.start + m];
        for (int64_t c = 0; c < cols; ++c) y[m * h + c] *= weight;
      }
    }
    // Each token's pairs summed in ascending expert order, as index_add_ over the experts does.
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      int64_t order[64];  // top_k <= 64 (checked above)
      int64_t n = 0;
      for (int64_t j = 0; j < top_k; ++j) {
        int64_t a = n++;
        for (; a > 0 && cp[t * top_k + order[a - 1]] > cp[t * top_k + j]; --a) order[a] = order[a - 1];
        order[a] = j;
      }
      float* y = op + t * h;
      std::fill(y, y + h, 0.f);
      for (int64_t a = 0; a < top_k; ++a) {
        const float* s = sp + position[t * top_k + order[a]] * h;
#pragma omp simd
        for (int64_t c = 0; c < h; ++c) y[c] += s[c];
      }
    }
  }
  return {out, chosen};
}

}  // namespace rollout_cpu

TORCH_LIBRARY_FRAGMENT(rollout, m) {
  m.def("moe_block(Tensor x, Tensor router, Tensor gate_up, Tensor down, int top_k, bool normalize) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rollout, CPU, m) { m.impl("moe_block", &rollout_cpu::moe_block); }
