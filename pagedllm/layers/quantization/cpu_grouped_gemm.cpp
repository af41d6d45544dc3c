// y = x W^T for a weight kept in groups of 32 values along K, each group with a scale and an offset:
// W[n, k] = value[n, k] * scale[n, g] + offset[n, g], g = k / 32, values 4-bit (0..15, two a byte: byte j of a
// group holds value j in its low nibble and value j + 16 in its high one, ggml's order) or 8-bit signed.
//
// Each row of x is rounded per group of 32 to int16 with a float step (x ~ q * step, step = max |x| / 32767), so a
// group's dot product is exact in integers (int8 steps, as llama.cpp takes, were faster from 4 rows but flipped the
// default model's answer to the README's question: benchmarks/NOTES.md, session 24):
//   y[m, n] = sum_g scale[n, g] step[m, g] dot(value[n, g], q[m, g]) + offset[n, g] step[m, g] sum(q[m, g]).
//
// Invariant: every y[m, n] is computed by the same instructions in the same order whatever M is, however many
// rows share a tile and however the threads split the work, so a row's bits never depend on the other rows of its
// step (batch composition, chunking and prefix caching leave greedy output unchanged).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "cpu_kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GROUPED_GEMM_AVX2 1
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t ROWS_PER_TILE = 4;         // rows of x sharing one load of a weight group
constexpr int64_t WEIGHT_ROWS_PER_TASK = 16;  // weight rows one thread takes at a time

constexpr float Q_MAX = 32767.f;

// x [M, K] -> q int16 [M, K], steps and step * sum(q) [M, K / 32] each: q = round(x / step), step = max|x| / Q_MAX.
void quantize_rows(const float* x, int64_t count_groups, int16_t* q, float* steps, float* step_sums) {
  for (int64_t i = 0; i < count_groups; ++i) {
    const float* xg = x + i * GROUP;
    float amax = 0.f;
    for (int64_t j = 0; j < GROUP; ++j) amax = std::fmax(amax, std::fabs(xg[j]));
    const float step = amax / Q_MAX;
    const float inverse = amax > 0.f ? Q_MAX / amax : 0.f;
    int32_t total = 0;
    for (int64_t j = 0; j < GROUP; ++j) {
      const int32_t value = static_cast<int32_t>(std::nearbyint(xg[j] * inverse));
      q[i * GROUP + j] = static_cast<int16_t>(value);
      total += value;
    }
    steps[i] = step;
    step_sums[i] = step * static_cast<float>(total);
  }
}

#ifdef GROUPED_GEMM_AVX2
inline float sum_lanes(__m256 v) {  // a fixed order
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

// sum_g offset[g] * step_sum[g] over one row's groups: 8 lanes, then the rest one by one.
inline float offset_dot(const float* offset, const float* step_sums, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(offset + g), _mm256_loadu_ps(step_sums + g), acc);
  }
  float total = sum_lanes(acc);
  for (; g < groups; ++g) total += offset[g] * step_sums[g];
  return total;
}

// A group's 32 values as two vectors of 16 int16 (values 0..15 and 16..31).
struct GroupValues {
  __m256i low, high;
};

template <int BITS>
inline GroupValues load_group(const uint8_t* row, int64_t g) {
  if constexpr (BITS == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * GROUP / 2));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    return {_mm256_cvtepu8_epi16(_mm_and_si128(packed, nibble)),
            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble))};
  } else {
    const __m128i* group = reinterpret_cast<const __m128i*>(row + g * GROUP);
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(group)), _mm256_cvtepi8_epi16(_mm_loadu_si128(group + 1))};
  }
}

// dot(value, q) of one group as 8 int32 lanes (their sum is the dot product; |lane| <= 4 x 128 x 32767).
inline __m256i group_dot(const GroupValues& weight, const int16_t* qg) {
  const __m256i low = _mm256_madd_epi16(weight.low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg)));
  const __m256i high = _mm256_madd_epi16(weight.high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 16)));
  return _mm256_add_epi32(low, high);
}

// ROWS rows of x (their q, steps, step sums), one weight row: y[r, n] for each r.
template <int BITS, int ROWS>
inline void tile(const int16_t* q, const float* steps, const float* step_sums, int64_t K, const uint8_t* weight_row,
                 const float* scale, const float* offset, float* y, int64_t N) {
  const int64_t groups = K / GROUP;
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const GroupValues weight = load_group<BITS>(weight_row, g);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(group_dot(weight, q + r * K + g * GROUP));
      const __m256 factor = _mm256_set1_ps(scale[g] * steps[r * groups + g]);
      acc[r] = _mm256_fmadd_ps(dot, factor, acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) y[r * N] = sum_lanes(acc[r]) + offset_dot(offset, step_sums + r * groups, groups);
}
#else
template <int BITS, int ROWS>
inline void tile(const int16_t* q, const float* steps, const float* step_sums, int64_t K, const uint8_t* weight_row,
                 const float* scale, const float* offset, float* y, int64_t N) {
  const int64_t groups = K / GROUP;
  for (int r = 0; r < ROWS; ++r) {
    float total = 0.f, offsets = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      const int16_t* qg = q + r * K + g * GROUP;
      for (int64_t j = 0; j < GROUP; ++j) {
        int32_t value;
        if constexpr (BITS == 4) {
          const uint8_t byte = weight_row[g * GROUP / 2 + (j % 16)];
          value = j < 16 ? (byte & 15) : (byte >> 4);
        } else {
          value = static_cast<int8_t>(weight_row[g * GROUP + j]);
        }
        dot += value * qg[j];
      }
      total += static_cast<float>(dot) * (scale[g] * steps[r * groups + g]);
      offsets += offset[g] * step_sums[r * groups + g];
    }
    y[r * N] = total + offsets;
  }
}
#endif

// tile<BITS, rows> for rows in 1..ROWS.
template <int BITS, int ROWS, typename Args>
inline void tile_of(int64_t rows, const Args& args) {
  if (rows == ROWS) {
    std::apply(tile<BITS, ROWS>, args);
  } else if constexpr (ROWS > 1) {
    tile_of<BITS, ROWS - 1>(rows, args);
  }
}

template <int BITS>
at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = values.size(0), groups = K / GROUP;
  TORCH_CHECK(K % GROUP == 0, "K must be a multiple of 32");
  TORCH_CHECK(values.is_contiguous() && values.element_size() == 1 && values.dim() == 2 &&
                  values.size(1) == K * BITS / 8,
              "values: contiguous bytes [N, K * bits / 8]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == N && scales.size(1) == 2 && scales.size(2) == groups,
              "scales: contiguous float32 [N, 2, K / 32] (scales, then offsets)");
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kShort));
  at::Tensor steps = at::empty({2, M, groups}, x.options());
  int16_t* qp = q.data_ptr<int16_t>();
  float* step_p = steps.data_ptr<float>();
  float* step_sum_p = step_p + M * groups;
  quantize_rows(x.data_ptr<float>(), M * groups, qp, step_p, step_sum_p);
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(values.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = K * BITS / 8;
  const int64_t tasks = (N + WEIGHT_ROWS_PER_TASK - 1) / WEIGHT_ROWS_PER_TASK;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task * WEIGHT_ROWS_PER_TASK, n1 = std::min(N, n0 + WEIGHT_ROWS_PER_TASK);
      for (int64_t m = 0; m < M; m += ROWS_PER_TILE) {
        const int64_t rows = std::min<int64_t>(ROWS_PER_TILE, M - m);
        for (int64_t n = n0; n < n1; ++n) {
          const float* scale = sp + n * 2 * groups;
          const int64_t at = m * groups;
          const auto args = std::make_tuple(qp + m * K, step_p + at, step_sum_p + at, K, wp + n * row_bytes, scale,
                                            scale + groups, yp + m * N + n, N);
          tile_of<BITS, ROWS_PER_TILE>(rows, args);
        }
      }
    }
  });
  return y;
}

}  // namespace

namespace pagedllm_cpu {

// The float32 weight [N, K] the groups stand for: value x scale + offset, rounded as IntGroups.dequantize rounds it
// (a product, then a sum), for products that take the weight in float (a step's prompt rows, gguf.py).
at::Tensor dequantize_groups(const at::Tensor& values, const at::Tensor& scales, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  TORCH_CHECK(values.is_contiguous() && values.element_size() == 1 && values.dim() == 2,
              "values: contiguous bytes [N, K * bits / 8]");
  const int64_t N = values.size(0), K = values.size(1) * 8 / bits, groups = K / GROUP;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == N && scales.size(1) == 2 && scales.size(2) == groups,
              "scales: contiguous float32 [N, 2, K / 32] (scales, then offsets)");
  at::Tensor weight = at::empty({N, K}, scales.options());
  const uint8_t* vp = reinterpret_cast<const uint8_t*>(values.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* wp = weight.data_ptr<float>();
  const int64_t row_bytes = K * bits / 8;
  at::parallel_for(0, N, WEIGHT_ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        const float scale = sp[(n * 2) * groups + g], offset = sp[(n * 2 + 1) * groups + g];
        const uint8_t* group = vp + n * row_bytes + g * GROUP * bits / 8;
        float* out = wp + n * K + g * GROUP;
        for (int64_t j = 0; j < GROUP; ++j) {
          const float value = bits == 4 ? static_cast<float>(j < 16 ? (group[j] & 15) : (group[j - 16] >> 4))
                                        : static_cast<float>(static_cast<int8_t>(group[j]));
          out[j] = value * scale + offset;
        }
      }
    }
  });
  return weight;
}

at::Tensor grouped_int4_mm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales) {
  return grouped_mm<4>(x, values, scales);
}

at::Tensor grouped_int8_mm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales) {
  return grouped_mm<8>(x, values, scales);
}

}  // namespace pagedllm_cpu

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("grouped_int4_mm(Tensor x, Tensor values, Tensor scales) -> Tensor");
  m.def("grouped_int8_mm(Tensor x, Tensor values, Tensor scales) -> Tensor");
  m.def("dequantize_groups(Tensor values, Tensor scales, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("grouped_int4_mm", &pagedllm_cpu::grouped_int4_mm);
  m.impl("grouped_int8_mm", &pagedllm_cpu::grouped_int8_mm);
  m.impl("dequantize_groups", &pagedllm_cpu::dequantize_groups);
}
