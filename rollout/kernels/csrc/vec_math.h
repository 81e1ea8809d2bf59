// Scalar math written so that loops calling it vectorise (std::exp runs one
// value at a time); shared by the CPU kernels.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

// a * b + c, fused where the target has FMA. The kernels build with
// -ffp-contract=off, so only the products written with madd are fused.
inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// exp(x) to about 1 ulp: Cody-Waite range reduction to 2^n * exp(r),
// |r| <= ln2/2, and Cephes' degree-6 polynomial. Below -87 the result is
// exactly 0 (float32 would reach only denormals there): a masked logit (-inf)
// or one e^87 times below a softmax's maximum weighs nothing, so a sampler
// never draws it. Above 88 it stays at exp(88), near float32's largest.
inline float vec_exp(float x) {
  const bool underflow = x < -87.f;
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = madd(n, -0.693359375f, x);
  r = madd(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = madd(p, r, 1.3981999507e-3f);
  p = madd(p, r, 8.3334519073e-3f);
  p = madd(p, r, 4.1665795894e-2f);
  p = madd(p, r, 1.6666665459e-1f);
  p = madd(p, r, 5.0000001201e-1f);
  p = madd(p * r, r, r + 1.f);
  const int32_t exponent = n == n ? static_cast<int32_t>(n) : 0;  // NaN in, NaN out (p), without a NaN cast
  return underflow ? 0.f : p * std::bit_cast<float>((exponent + 127) << 23);
}

// x rounded to the nearest bfloat16 (ties to even), kept as a float32: what
// torch's .to(torch.bfloat16) then .float() gives, with integer ops that loops
// vectorise. NaN stays NaN; values past bfloat16's largest round to infinity.
inline float round_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const float rounded = std::bit_cast<float>((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
  return x != x ? x : rounded;
}
