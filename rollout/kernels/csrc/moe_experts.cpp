// The experts of one sparse (mixture-of-experts) layer in one op, float32 on
// the CPU (rollout/model/moe.py).
//
// The token-expert pairs come grouped by expert (`tokens`: each pair's token,
// `counts`: pairs per expert). Each expert gathers its tokens' rows, multiplies
// them by its gate/up projection, applies SiLU-times-up (as `silu_mul` does),
// multiplies by its down projection and scales each row by its pair's gate
// weight, writing the pair's row of the output. The threads share the
// experts, not the GEMMs: at a decode step an expert gets about
// rows x top_k / experts rows (16 in the benchmark's shape), and a GEMM that
// small split over threads spends much of its time forking and joining. So
// every expert's GEMMs run on one thread (BLAS inside a parallel region runs
// single-threaded), experts are taken largest first, and an expert with many
// rows is cut into row chunks (`kChunkRows`). Each pair's row depends only on
// its expert's weights, its token and its chunk, so the result does not
// depend on the thread count or on which thread ran what.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <vector>

#include "vec_math.h"

namespace {

// An expert's rows are cut into chunks of at most this many, which threads
// take one at a time: enough rows for a GEMM near its full rate, and a
// prefill's few busy experts still spread over the threads. The cut does not
// depend on the thread count, so neither does the result.
constexpr int64_t kChunkRows = 128;

struct Chunk {
  int64_t expert, start, rows;  // pairs [start, start + rows) of the grouped order, all routed to `expert`
};

void run_chunk(const Chunk& c, const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
               const int64_t* tokens, const float* weights, at::Tensor& out) {
  const int64_t h = x.size(1), inter = down.size(1), n = c.rows;
  at::Tensor rows = at::empty({n, h}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = rows.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j) std::memcpy(rp + j * h, xp + tokens[c.start + j] * h, h * sizeof(float));
  const at::Tensor gu = at::mm(rows, gate_up.narrow(0, c.expert * 2 * inter, 2 * inter).t());
  at::Tensor act = at::empty({n, inter}, x.options());
  const float* gp = gu.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j) {
    const float* g = gp + j * 2 * inter;
    const float* u = g + inter;
    float* y = ap + j * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) y[i] = g[i] / (1.f + vec_exp(-g[i])) * u[i];
  }
  at::Tensor dst = out.narrow(0, c.start, n);
  at::mm_out(dst, act, down.narrow(0, c.expert * h, h).t());
  float* dp = dst.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j) {
    const float w = weights[c.start + j];
    float* y = dp + j * h;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) y[i] *= w;
  }
}

}  // namespace

namespace rollout_cpu {

// x [T, H]; gate_up [E * 2I, H] (expert e's gate then up rows at e * 2I); down [E * H, I];
// tokens [P] int64 and weights [P] float32 per pair, grouped by expert; counts [E] int64.
// Returns [P, H]: each pair's expert output times its gate weight.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                       const at::Tensor& tokens, const at::Tensor& counts, const at::Tensor& weights) {
  for (const auto* t : {&x, &gate_up, &down, &weights}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "moe_experts takes contiguous float32 CPU tensors");
  }
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 2 && down.dim() == 2, "moe_experts: x, gate_up, down must be 2-D");
  const int64_t h = x.size(1), experts = counts.numel(), inter = down.size(1), pairs = tokens.numel();
  TORCH_CHECK(gate_up.size(0) == experts * 2 * inter && gate_up.size(1) == h && down.size(0) == experts * h,
              "moe_experts: gate_up must be [E * 2I, H] and down [E * H, I], got ", gate_up.sizes(), " and ",
              down.sizes(), " for ", experts, " experts and H = ", h);
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() && counts.scalar_type() == at::kLong &&
                  counts.is_contiguous() && weights.numel() == pairs,
              "moe_experts: tokens and counts must be contiguous int64, weights one per pair");
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  TORCH_CHECK(std::accumulate(cp, cp + experts, int64_t{0}) == pairs, "moe_experts: counts must sum to the pairs");
  for (int64_t j = 0; j < pairs; ++j) {
    TORCH_CHECK(tp[j] >= 0 && tp[j] < x.size(0), "moe_experts: token ", tp[j], " outside x's ", x.size(0), " rows");
  }
  at::Tensor out = at::empty({pairs, h}, x.options());
  if (pairs == 0) return out;
  const int64_t threads = at::get_num_threads();
  std::vector<Chunk> chunks;
  for (int64_t e = 0, start = 0; e < experts; start += cp[e], ++e) {
    for (int64_t a = 0; a < cp[e]; a += kChunkRows) {
      chunks.push_back({e, start + a, std::min(kChunkRows, cp[e] - a)});
    }
  }
  std::stable_sort(chunks.begin(), chunks.end(), [](const Chunk& a, const Chunk& b) { return a.rows > b.rows; });
  const float* wp = weights.data_ptr<float>();
  const int64_t count = static_cast<int64_t>(chunks.size());
  // The caller's thread-local state (inference mode above all: `out` is an inference
  // tensor inside the engine's steps) goes with the work to every thread, and an
  // error in one is raised here, after the region, not inside it.
  const at::ThreadLocalState state;
  std::exception_ptr error;
  std::mutex error_lock;
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::min(threads, count))
  for (int64_t i = 0; i < count; ++i) {
    try {
      at::ThreadLocalStateGuard guard(state);
      run_chunk(chunks[i], x, gate_up, down, tp, wp, out);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_lock);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  return out;
}

}  // namespace rollout_cpu

TORCH_LIBRARY_FRAGMENT(rollout, m) {
  m.def("moe_experts(Tensor x, Tensor gate_up, Tensor down, Tensor tokens, Tensor counts, Tensor weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollout, CPU, m) { m.impl("moe_experts", &rollout_cpu::moe_experts); }
