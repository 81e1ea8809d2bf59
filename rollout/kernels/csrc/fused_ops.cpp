// Fused float32 elementwise steps of a decoder layer, on the CPU.
//
// At decode batch sizes each of these tensors is a few hundred KB, so the
// torch versions cost more in per-op dispatch and temporaries than in
// arithmetic: RMSNorm is 7 ops, rotary embedding plus the KV write 14. The
// library is built with -ffp-contract=off, so only products written with
// madd (vec_math.h) are fused: the rotary embedding and the residual add
// match the torch path bit for bit; RMSNorm (summation order) and SiLU (its
// exp) differ from it by float32 rounding.
//
// Built with the other kernels into one library by rollout/kernels/build.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels.h"
#include "vec_math.h"

namespace {

void check_rows(const at::Tensor& t, const char* name, int64_t width) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.size(1) == width && t.stride(1) == 1, name, " must be [rows, ", width,
              "] with contiguous rows, got ", t.sizes());
}

// y = w * (x * rsqrt(mean(x^2) + eps)) over one row; y may be x.
inline void norm_row(const float* x, const float* w, int64_t width, float eps, float* y) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < width; ++i) sum = madd(x[i], x[i], sum);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) y[i] = w[i] * (x[i] * inv);
}

// out = weight * (h * rsqrt(mean(h^2) + eps)), row by row; with `delta`, h += delta first (in place).
void rms_norm_rows(at::Tensor& h, const at::Tensor* delta, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = h.size(0), width = h.size(1);
  check_rows(h, "h", width);
  check_rows(out, "out", width);
  if (delta) {
    check_rows(*delta, "delta", width);
    TORCH_CHECK(delta->size(0) == rows, "delta has ", delta->size(0), " rows, h ", rows);
  }
  TORCH_CHECK(out.size(0) == rows, "out has ", out.size(0), " rows, h ", rows);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == width &&
                  weight.is_contiguous(),
              "weight must be a contiguous float32 [", width, "]");
  float* hp = h.data_ptr<float>();
  const float* dp = delta ? delta->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t hs = h.stride(0), ds = delta ? delta->stride(0) : 0, os = out.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = hp + r * hs;
      if (dp) {
        const float* d = dp + r * ds;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) x[i] = x[i] + d[i];
      }
      norm_row(x, wp, width, feps, op + r * os);
    }
  });
}

inline void silu_mul_row(const float* __restrict g, const float* __restrict u, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] / (1.f + vec_exp(-g[i])) * u[i];
}

// rope_and_cache_'s loop over checked inputs, for a pool of cache_t.
template <typename cache_t>
void rope_and_store(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* pos, const at::Tensor& cos,
                    const at::Tensor& sin, cache_t* kc, cache_t* vc, const int64_t* slot) {
  const int64_t tokens = q.size(0), hq = q.size(1), hkv = k.size(1), dim = q.size(2), half = dim / 2;
  float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), slot_stride = hkv * dim;

  auto rotate = [&](const float* x, const float* c, const float* s, auto* y) {
    float rotated[1024];  // rope_and_cache_ checks head_dim <= 1024
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      rotated[i] = x[i] * c[i] + (-x[i + half]) * s[i];
      rotated[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
    }
    for (int64_t i = 0; i < dim; ++i) y[i] = static_cast<std::remove_pointer_t<decltype(y)>>(rotated[i]);
  };
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * dim;
      const float* s = sp + pos[t] * dim;
      for (int64_t h = 0; h < hq; ++h) {
        float* x = qp + t * qs0 + h * qs1;
        rotate(x, c, s, x);
      }
      for (int64_t h = 0; h < hkv; ++h) {
        rotate(kp + t * ks0 + h * ks1, c, s, kc + slot[t] * slot_stride + h * dim);
        const float* src = vp + t * vs0 + h * vs1;
        cache_t* dst = vc + slot[t] * slot_stride + h * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<cache_t>(src[i]);
      }
    }
  });
}

}  // namespace

namespace rollout_cpu {

// x [T, heads, D] (any strides but the last) normalised in place over D, head by head:
// qwen3's q and k norms, on views of the fused qkv projection's output.
void head_rms_norm_(at::Tensor x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "head_rms_norm_ takes a float32 CPU tensor [T, heads, D] contiguous in D, got ", x.sizes());
  const int64_t heads = x.size(1), width = x.size(2);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == width &&
                  weight.is_contiguous(),
              "weight must be a contiguous float32 [", width, "]");
  float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, x.size(0) * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = xp + r / heads * s0 + r % heads * s1;
      norm_row(row, wp, width, feps, row);
    }
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  at::Tensor h = x;  // not written: no delta
  rms_norm_rows(h, nullptr, weight, eps, out);
}

void add_rms_norm_(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight, double eps, at::Tensor out) {
  rms_norm_rows(h, &delta, weight, eps, out);
}

// Rotates q in place and writes rotated k and plain v to the KV pool at `slots`:
// x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]. A bfloat16 pool
// stores each value rounded to nearest even, as torch's conversion does.
void rope_and_cache_(at::Tensor q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                     const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& slots) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q must be [T, Hq, D], k and v [T, Hkv, D]");
  const int64_t tokens = q.size(0), hkv = k.size(1), dim = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == dim && dim % 2 == 0, "k ", k.sizes(), " does not fit q ",
              q.sizes());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, "rope_and_cache_ takes float32 CPU tensors");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "k_cache and v_cache must be float32 or bfloat16 CPU tensors alike, got ", k_cache.scalar_type(),
              " and ", v_cache.scalar_type());
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k and v must be contiguous in D");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dim && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous(),
              "cos and sin must be contiguous [positions, ", dim, "]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4 && k_cache.size(2) == hkv && k_cache.size(3) == dim,
              "k_cache and v_cache must be contiguous [pages, page_size, ", hkv, ", ", dim, "]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.dim() == 1 &&
                  slots.dim() == 1 && positions.size(0) == tokens && slots.size(0) == tokens &&
                  positions.is_contiguous() && slots.is_contiguous(),
              "positions and slots must be contiguous int64 [", tokens, "]");
  TORCH_CHECK(dim <= 1024, "head_dim must be at most 1024, got ", dim);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_positions = cos.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < num_positions, "positions[", t, "] = ", pos[t], " is outside the table (0..",
                num_positions - 1, ")");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slots[", t, "] = ", slot[t], " is outside the pool (0..",
                num_slots - 1, ")");
  }
  if (k_cache.scalar_type() == at::kBFloat16) {
    rope_and_store(q, k, v, pos, cos, sin, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), slot);
  } else {
    rope_and_store(q, k, v, pos, cos, sin, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slot);
  }
}

// out = silu(gate) * up for gate_up = [gate | up] along the last dimension.
void silu_mul(const at::Tensor& gate_up, at::Tensor out) {
  const int64_t rows = gate_up.size(0), width = out.size(1);
  check_rows(gate_up, "gate_up", 2 * width);
  check_rows(out, "out", width);
  TORCH_CHECK(out.size(0) == rows, "out has ", out.size(0), " rows, gate_up ", rows);
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(gp + r * gs, gp + r * gs + width, op + r * os, width);
  });
}

}  // namespace rollout_cpu

TORCH_LIBRARY_FRAGMENT(rollout, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor delta, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def(
      "rope_and_cache_(Tensor(a!) q, Tensor k, Tensor v, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("head_rms_norm_(Tensor(a!) x, Tensor weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(rollout, CPU, m) {
  m.impl("rms_norm", &rollout_cpu::rms_norm);
  m.impl("add_rms_norm_", &rollout_cpu::add_rms_norm_);
  m.impl("rope_and_cache_", &rollout_cpu::rope_and_cache_);
  m.impl("silu_mul", &rollout_cpu::silu_mul);
  m.impl("head_rms_norm_", &rollout_cpu::head_rms_norm_);
}
