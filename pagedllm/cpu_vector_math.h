// What the CPU path's C++ kernels share (cpu_kernels.py builds them into one library): an exponential that
// vectorizes, eight-lane vectors summed in a fixed order, and the dispatch on a tensor's float dtype.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagedllm_cpu {

inline float float_from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// e^x for x <= 0, within ~2 ulp: e^x = 2^n e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by its Taylor
// polynomial of degree 7 in Horner form. Branch-free, so a loop of it vectorizes (given -fno-trapping-math, which
// lets the compiler inline std::floor and select between values; cpu_kernels.py passes it). Below -87 it is 0:
// e^-87 (~1.6e-38) weighs nothing beside the row's largest probability (1), and its products with values would be
// subnormal, which the core computes far slower.
inline float exp_nonpositive(float x) {
  constexpr float LOG2E = 1.44269504f, LN2_HIGH = 0.693359375f, LN2_LOW = -2.12194440e-4f;
  const bool negligible = x < -87.f;
  x = std::max(x, -87.f);
  const float n = std::floor(x * LOG2E + 0.5f);
  const float r = (x - n * LN2_HIGH) - n * LN2_LOW;
  float poly = 1.f / 5040;
  poly = poly * r + 1.f / 720;
  poly = poly * r + 1.f / 120;
  poly = poly * r + 1.f / 24;
  poly = poly * r + 1.f / 6;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.f;
  poly = poly * r + 1.f;
  return negligible ? 0.f : poly * float_from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// Eight floats that the compiler keeps in a vector register (GCC's and Clang's vector extensions: AVX, SSE or NEON
// instructions, whichever the build targets). An OpenMP simd reduction kept its sum in memory instead.
typedef float Lanes __attribute__((vector_size(32)));
constexpr int64_t LANES = 8;

inline Lanes load_lanes(const float* at) {
  Lanes lanes;
  std::memcpy(&lanes, at, sizeof lanes);
  return lanes;
}

inline float sum_lanes(Lanes v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// a * b + c, rounded once where the build has FMA instructions (the kernels build with -ffp-contract=off, so a plain
// a * b + c stays two roundings), else twice.
inline Lanes fma_lanes(Lanes a, Lanes b, Lanes c) {
#if defined(__FMA__)
  return __builtin_ia32_vfmaddps256(a, b, c);
#else
  return a * b + c;
#endif
}

inline Lanes broadcast_lanes(float value) { return Lanes{value, value, value, value, value, value, value, value}; }

typedef float Quad __attribute__((vector_size(16)));

// Each of four vectors' lanes summed, in a fixed order (pairs, then the two halves): {sum(v0), ..., sum(v3)}.
inline Quad sum_lanes4(Lanes v0, Lanes v1, Lanes v2, Lanes v3) {
  const Lanes a = __builtin_shufflevector(v0, v1, 0, 2, 8, 10, 4, 6, 12, 14) +
                  __builtin_shufflevector(v0, v1, 1, 3, 9, 11, 5, 7, 13, 15);  // v0, v1 in pairs
  const Lanes b = __builtin_shufflevector(v2, v3, 0, 2, 8, 10, 4, 6, 12, 14) +
                  __builtin_shufflevector(v2, v3, 1, 3, 9, 11, 5, 7, 13, 15);
  const Lanes c = __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
                  __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);  // {v0..v3 low half, v0..v3 high half}
  return __builtin_shufflevector(c, c, 0, 1, 2, 3) + __builtin_shufflevector(c, c, 4, 5, 6, 7);
}

// Calls body(T{}) with T the C++ type of a float32, bfloat16 or float16 tensor; other dtypes are refused, naming
// `what`.
template <typename Body>
inline void with_float_type(c10::ScalarType type, const char* what, const Body& body) {
  if (type == c10::ScalarType::Float) {
    body(float{});
  } else if (type == c10::ScalarType::BFloat16) {
    body(c10::BFloat16{});
  } else if (type == c10::ScalarType::Half) {
    body(c10::Half{});
  } else {
    TORCH_CHECK(false, what, " takes float32, bfloat16 or float16 tensors, got ", type);
  }
}

}  // namespace pagedllm_cpu
