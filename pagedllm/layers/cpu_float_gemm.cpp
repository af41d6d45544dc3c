// y = x W^T (+ bias) in float32 for a weight packed once into panels of 16 output columns: panels[p, k, j] =
// W[16 p + j, k], so one k of a panel is one 64-byte line and a panel streams in order.
//
// Each output is one chain of fused multiply-adds over k in order, restarted from zero every KBLOCK = 1024 values
// of k and the blocks' sums added in order: y[m, n] = (...(s_0 + s_1) + s_2 ...) (+ bias), where
// s_b = fma(x[m, k_last], W[n, k_last], ... fma(x[m, k_first], W[n, k_first], 0)). That is the order oneDNN's float32
// inner product takes on AVX2 (its results equal these to the bit here, at every M and thread count:
// benchmarks/NOTES.md, session 31), so this kernel changes no output, only the time.
//
// Invariant: every y[m, n] is computed by that order whatever M is, however many rows and panels share a tile and
// however the threads split the work, so a row's bits never depend on the other rows of its step.
//
// Why it is faster than oneDNN at the rows a decode or verify step has (1-8): a tile holds up to 12 sums in
// registers (1 row x 4 panels, 2 x 3, 3 x 2, 6 x 1), each weight line is loaded once for all the tile's rows (a
// later tile of rows finds the same KSTEP lines in L1), and the panels stream in order, so one row reads the weights
// at the memory's rate.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FLOAT_GEMM_AVX2 1
#endif

namespace {

constexpr int64_t PANEL = 16;     // output columns a panel
constexpr int64_t KBLOCK = 1024;  // k values a chain runs before it restarts (the order above)
constexpr int64_t KSTEP = 256;    // k values a tile takes at a time (one panel's 16 KiB stays in L1 across tiles)

#ifdef FLOAT_GEMM_AVX2
// Sums of rows [0, ROWS) of x over k in [0, kb) against NP panels (`w` at the first k, panels `panel_stride` apart),
// continuing the chains in `acc` (ld_acc apart a row) unless `fresh`, stored back into `acc`.
template <int ROWS, int NP>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t panel_stride, int64_t kb, float* acc,
                 int64_t ld_acc, bool fresh) {
  __m256 sum[ROWS][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
        sum[r][p][h] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * ld_acc + p * PANEL + 8 * h);
  for (int64_t k = 0; k < kb; ++k) {
    __m256 line[NP][2];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) line[p][h] = _mm256_loadu_ps(w + p * panel_stride + k * PANEL + 8 * h);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) sum[r][p][h] = _mm256_fmadd_ps(xr, line[p][h], sum[r][p][h]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + r * ld_acc + p * PANEL + 8 * h, sum[r][p][h]);
}
#else
template <int ROWS, int NP>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t panel_stride, int64_t kb, float* acc,
                 int64_t ld_acc, bool fresh) {
  for (int r = 0; r < ROWS; ++r)
    for (int p = 0; p < NP; ++p)
      for (int j = 0; j < PANEL; ++j) {
        float sum = fresh ? 0.f : acc[r * ld_acc + p * PANEL + j];
        for (int64_t k = 0; k < kb; ++k) sum = std::fma(x[r * ldx + k], w[p * panel_stride + k * PANEL + j], sum);
        acc[r * ld_acc + p * PANEL + j] = sum;
      }
}
#endif

// Rows [0, M) against NP panels over k in [k0, k0 + kb): tiles of up to MAX_ROWS rows.
template <int MAX_ROWS, int NP>
void rows_against_panels(const float* x, int64_t M, int64_t K, const float* w, int64_t k0, int64_t kb, float* acc,
                         int64_t ld_acc, bool fresh) {
  const int64_t panel_stride = K * PANEL;
  for (int64_t m = 0; m < M; m += MAX_ROWS) {
    const float* xm = x + m * K + k0;
    const float* wk = w + k0 * PANEL;
    float* am = acc + m * ld_acc;
    switch (std::min<int64_t>(MAX_ROWS, M - m)) {
      // clang-format off
      case 6: if constexpr (MAX_ROWS >= 6) tile<6, NP>(xm, K, wk, panel_stride, kb, am, ld_acc, fresh); break;
      case 5: if constexpr (MAX_ROWS >= 5) tile<5, NP>(xm, K, wk, panel_stride, kb, am, ld_acc, fresh); break;
      case 4: if constexpr (MAX_ROWS >= 4) tile<4, NP>(xm, K, wk, panel_stride, kb, am, ld_acc, fresh); break;
      case 3: if constexpr (MAX_ROWS >= 3) tile<3, NP>(xm, K, wk, panel_stride, kb, am, ld_acc, fresh); break;
      case 2: if constexpr (MAX_ROWS >= 2) tile<2, NP>(xm, K, wk, panel_stride, kb, am, ld_acc, fresh); break;
      default: tile<1, NP>(xm, K, wk, panel_stride, kb, am, ld_acc, fresh); break;
      // clang-format on
    }
  }
}

// All of y's columns of NP panels starting at panel p0 (y [M, N] row-major, ld N).
template <int MAX_ROWS, int NP>
void panels_product(const float* x, int64_t M, int64_t K, const float* panels, int64_t p0, float* y, int64_t N) {
  const float* w = panels + p0 * K * PANEL;
  float* out = y + p0 * PANEL;
  std::vector<float> block;  // a later KBLOCK's sums, before they are added to the earlier blocks'
  for (int64_t b0 = 0; b0 < K; b0 += KBLOCK) {
    float* acc = out;
    int64_t ld_acc = N;
    if (b0 > 0) {
      block.resize(M * NP * PANEL);
      acc = block.data();
      ld_acc = NP * PANEL;
    }
    const int64_t b1 = std::min(K, b0 + KBLOCK);
    for (int64_t k0 = b0; k0 < b1; k0 += KSTEP)
      rows_against_panels<MAX_ROWS, NP>(x, M, K, w, k0, std::min(KSTEP, b1 - k0), acc, ld_acc, k0 == b0);
    if (b0 > 0)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < NP * PANEL; ++j) out[m * N + j] += block[m * NP * PANEL + j];
  }
}

// Many rows (a prompt's): blocks of rows small enough that their x (rows x min(K, KBLOCK) floats) stays in L2 while
// every panel of [p0, p1) passes over it. All rows at once, as panels_product alone takes them, stream x from
// memory once a panel: at a 6,500-row prompt step (x 15-40 MB) that ran at 55-65% of the rate from L2. The rows'
// order changes, each output's sums do not.
constexpr int64_t L2_FLOATS = 48 * 1024;  // 192 KiB of x a block: less than half of a Zen 3 core's L2
constexpr int64_t BLOCKED_MIN_ROWS = 17;  // fewer rows: several panels a tile (below)

void blocked_product(const float* x, int64_t M, int64_t K, const float* panels, int64_t p0, int64_t p1, float* y,
                     int64_t N) {
  const int64_t block_rows = std::max<int64_t>(6, L2_FLOATS / std::min(K, KBLOCK) / 6 * 6);
  for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
    const int64_t rows = std::min(block_rows, M - m0);
    for (int64_t p = p0; p < p1; ++p) panels_product<6, 1>(x + m0 * K, rows, K, panels, p, y + m0 * N, N);
  }
}

}  // namespace

namespace pagedllm_cpu {

at::Tensor pack_float_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight: float32 [N, K]");
  TORCH_CHECK(weight.size(0) % PANEL == 0, "weight: N must be a multiple of ", PANEL, ", got ", weight.size(0));
  return weight.view({weight.size(0) / PANEL, PANEL, weight.size(1)}).transpose(1, 2).contiguous();
}

at::Tensor float_panels_mm(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(2) == PANEL && panels.size(1) == x.size(1),
              "panels: contiguous float32 [N / 16, K, 16] (pack_float_panels), K = x's columns");
  const at::Tensor rows = x.contiguous();
  const int64_t M = rows.size(0), K = rows.size(1), count = panels.size(0), N = count * PANEL;
  at::Tensor y = at::empty({M, N}, rows.options());
  if (M == 0) return y;
  const float* xp = rows.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Few rows: several panels a tile, so that up to 12 chains are in flight and the weights stream as 2-4 lines
  // at once (up to 16 rows: two panels, 3 rows a tile, 1.1x one panel of 6 rows at 8 rows; NOTES, session 31);
  // more rows: one panel, 6 rows a tile, in blocks of rows that stay in L2 (blocked_product), each thread over its
  // own range of panels.
  if (M >= BLOCKED_MIN_ROWS) {
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) { blocked_product(xp, M, K, wp, begin, end, yp, N); });
  } else {
    const int64_t np = M == 1 ? 4 : M == 2 ? 3 : 2;
    const int64_t tasks = (count + np - 1) / np;
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        int64_t p = task * np;
        const int64_t last = std::min(count, p + np);
        for (; p + np <= last; p += np) {
          if (np == 4) panels_product<1, 4>(xp, M, K, wp, p, yp, N);
          if (np == 3) panels_product<2, 3>(xp, M, K, wp, p, yp, N);
          if (np == 2) panels_product<3, 2>(xp, M, K, wp, p, yp, N);
        }
        for (; p < last; ++p) panels_product<6, 1>(xp, M, K, wp, p, yp, N);
      }
    });
  }
  if (bias) y.add_(*bias);
  return y;
}

}  // namespace pagedllm_cpu

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("pack_float_panels(Tensor weight) -> Tensor");
  m.def("float_panels_mm(Tensor x, Tensor panels, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("pack_float_panels", &pagedllm_cpu::pack_float_panels);
  m.impl("float_panels_mm", &pagedllm_cpu::float_panels_mm);
}
