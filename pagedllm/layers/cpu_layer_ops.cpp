// The small per-layer operations of a decoder on CPU, one call each in place of the 4-10 torch ops that compute them
// (a decode step of the default model spent more time dispatching those ops than in its matrix products):
//   rms_norm          y = weight * (x * rsqrt(mean(x^2) + eps))
//   add_rms_norm      residual' = x + residual, then rms_norm(residual'); returns (y, residual')
//   silu_and_mul      [gate | up] -> silu(gate) * up
//   rotate_qk_        q and k of a packed qkv rotated in place (neox halves), after their RMSNorms where given
//   store_kv_         each token's k and v rows copied into its cache slot (slot -1: not stored)
// Values are widened to float32 and every intermediate is rounded to the tensor's dtype where the torch expressions
// of layers/norm.py, activation.py and rotary.py round it, so the results are theirs up to the order of a sum (the
// norms' mean of squares) and the exponential's last ulps (SiLU); the rotation is theirs bit for bit.
//
// Invariant: a row (a token) is computed by the same instructions whatever the other rows are and however the
// threads split them, so a row's bits depend on that row alone.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "cpu_vector_math.h"

#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using namespace pagedllm_cpu;

constexpr int64_t VALUES_PER_TASK = 16384;  // rows are split among threads in runs of about this many values

template <typename T>
inline float widen(T value) {
  return static_cast<float>(value);
}

template <typename T>
inline float rounded(float value) {  // value rounded to T and back: what storing it in a T tensor keeps
  return static_cast<float>(static_cast<T>(value));
}

// at::parallel_for over rows, in runs of whole rows worth about VALUES_PER_TASK values: a decode step's few rows
// run on the calling thread, with no wake-up of the others.
template <typename Body>
inline void for_rows(int64_t rows, int64_t values_per_row, const Body& body) {
  const int64_t grain = std::max<int64_t>(1, VALUES_PER_TASK / std::max<int64_t>(1, values_per_row));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) body(row);
  });
}

// Eight lanes of squares, then the lanes, then the last n % 8: a fixed order for each n.
template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  Lanes total = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    Lanes values;
    for (int64_t lane = 0; lane < LANES; ++lane) values[lane] = widen(x[i + lane]);
    total += values * values;
  }
  float sum = sum_lanes(total);
  for (; i < n; ++i) sum += widen(x[i]) * widen(x[i]);
  return sum;
}

// out = weight * rounded(x * rsqrt(mean(x^2) + eps)), as layers/norm.py: statistics in float32, the weight applied
// in T. out may be x.
template <typename T>
inline void normalize(const T* x, const T* weight, float eps, int64_t n, T* out) {
  const float inverse = 1.f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(widen(weight[i]) * rounded<T>(widen(x[i]) * inverse));
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, ": contiguous [rows, hidden]");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              what, ": the weight is [hidden] in the input's dtype");
}

// silu(g) = g * sigmoid(g), the sigmoid from e^-|g| (never overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below.
inline float silu(float g) {
  const float e = exp_nonpositive(std::min(g, -g));
  return g * ((g >= 0.f ? 1.f : e) / (1.f + e));
}

}  // namespace

namespace pagedllm_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  at::Tensor out = at::empty_like(x);
  const int64_t hidden = x.size(1);
  with_float_type(x.scalar_type(), "rms_norm", [&](auto type) {
    using T = decltype(type);
    const T *in = x.data_ptr<T>(), *w = weight.data_ptr<T>();
    T* o = out.data_ptr<T>();
    for_rows(x.size(0), hidden, [&](int64_t row) {
      normalize(in + row * hidden, w, static_cast<float>(eps), hidden, o + row * hidden);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, double eps) {
  check_rows(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: the residual is contiguous, of x's shape and dtype");
  at::Tensor out = at::empty_like(x), summed = at::empty_like(x);
  const int64_t hidden = x.size(1);
  with_float_type(x.scalar_type(), "add_rms_norm", [&](auto type) {
    using T = decltype(type);
    const T *in = x.data_ptr<T>(), *res = residual.data_ptr<T>(), *w = weight.data_ptr<T>();
    T *o = out.data_ptr<T>(), *s = summed.data_ptr<T>();
    for_rows(x.size(0), hidden, [&](int64_t row) {
      const int64_t at = row * hidden;
      for (int64_t i = 0; i < hidden; ++i) s[at + i] = static_cast<T>(widen(in[at + i]) + widen(res[at + i]));
      normalize(s + at, w, static_cast<float>(eps), hidden, o + at);
    });
  });
  return {out, summed};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: contiguous [rows, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  with_float_type(gate_up.scalar_type(), "silu_and_mul", [&](auto type) {
    using T = decltype(type);
    const T* in = gate_up.data_ptr<T>();
    T* o = out.data_ptr<T>();
    for_rows(rows, 2 * width, [&](int64_t row) {
      const T *gate = in + row * 2 * width, *up = gate + width;
      T* out_row = o + row * width;
      thread_local std::vector<float> activated;  // the row's silu(gate), in float32: a loop of floats vectorizes
      activated.resize(width);
      float* a = activated.data();
      for (int64_t i = 0; i < width; ++i) a[i] = widen(gate[i]);
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) a[i] = silu(a[i]);
      for (int64_t i = 0; i < width; ++i) out_row[i] = static_cast<T>(rounded<T>(a[i]) * widen(up[i]));
    });
  });
  return out;
}

// In place in qkv [tokens, width] (q heads, then k heads, then v, each head_dim wide): the first heads + kv_heads
// heads of token t, each normalized by q_norm / k_norm where given, then rotated by position positions[t]:
//   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin  (x1, x2 the head's halves; cos_sin row: cos half | sin half).
void rotate_qk_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, int64_t heads,
                int64_t kv_heads, int64_t head_dim, const std::optional<at::Tensor>& q_norm,
                const std::optional<at::Tensor>& k_norm, double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) >= (heads + kv_heads) * head_dim,
              "rotate_qk_: qkv is contiguous [tokens, width], q and k heads first");
  TORCH_CHECK(head_dim % 2 == 0, "rotate_qk_: head_dim is even");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                  positions.numel() == qkv.size(0),
              "rotate_qk_: positions are int64 [tokens]");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 && cos_sin.is_contiguous() &&
                  cos_sin.size(1) == head_dim,
              "rotate_qk_: cos_sin is float32 [max_position, head_dim]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "rotate_qk_: q_norm and k_norm come together");
  const int64_t tokens = qkv.size(0), width = qkv.size(1), half = head_dim / 2, max_position = cos_sin.size(0);
  const int64_t* position = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(position[t] >= 0 && position[t] < max_position, "rotate_qk_: position ", position[t],
                " is outside the rotary table's ", max_position);
  }
  const float* table = cos_sin.data_ptr<float>();
  with_float_type(qkv.scalar_type(), "rotate_qk_", [&](auto type) {
    using T = decltype(type);
    const T *q_weight = nullptr, *k_weight = nullptr;
    if (q_norm) {
      for (const at::Tensor* weight : {&*q_norm, &*k_norm}) {
        TORCH_CHECK(weight->numel() == head_dim && weight->is_contiguous() && weight->scalar_type() == qkv.scalar_type(),
                    "rotate_qk_: the norms' weights are contiguous [head_dim] in qkv's dtype");
      }
      q_weight = q_norm->data_ptr<T>();
      k_weight = k_norm->data_ptr<T>();
    }
    T* data = qkv.data_ptr<T>();
    for_rows(tokens, (heads + kv_heads) * head_dim, [&](int64_t t) {
      const float *cos = table + position[t] * head_dim, *sin = cos + half;
      for (int64_t head = 0; head < heads + kv_heads; ++head) {
        T* x = data + t * width + head * head_dim;
        if (q_weight) normalize(x, head < heads ? q_weight : k_weight, static_cast<float>(eps), head_dim, x);
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = widen(x[i]), x2 = widen(x[i + half]);
          x[i] = static_cast<T>(x1 * cos[i] - x2 * sin[i]);
          x[i + half] = static_cast<T>(x2 * cos[i] + x1 * sin[i]);
        }
      }
    });
  });
}

// k_cache.view(-1, kv_heads * head_dim)[slot_mapping[t]] = key[t] (and v likewise) for each t with a slot >= 0.
// key and value may be views into qkv: each token's heads contiguous, tokens strided.
void store_kv_(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "store_kv_: caches are contiguous [num_blocks, block_size, kv_heads, head_dim], K and V alike");
  const int64_t row_values = k_cache.size(2) * k_cache.size(3), slots = k_cache.size(0) * k_cache.size(1);
  const int64_t tokens = slot_mapping.numel();
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "store_kv_: slot_mapping is contiguous int64");
  for (const at::Tensor* rows : {&key, &value}) {
    TORCH_CHECK(rows->dim() == 3 && rows->size(0) == tokens && rows->size(1) * rows->size(2) == row_values &&
                    rows->stride(2) == 1 && rows->stride(1) == rows->size(2) &&
                    rows->scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                "store_kv_: key and value are [tokens, kv_heads, head_dim] in the cache's dtype, each token's heads "
                "contiguous");
  }
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < slots, "store_kv_: slot ", slot[t], " of token ", t,
                " is outside the cache's ", slots);
  }
  const int64_t row_bytes = row_values * k_cache.element_size();
  auto copy_rows = [&](const at::Tensor& rows, at::Tensor& cache) {
    const char* source = static_cast<const char*>(rows.data_ptr());
    char* target = static_cast<char*>(cache.data_ptr());
    const int64_t token_stride = rows.stride(0) * rows.element_size();
    for (int64_t t = 0; t < tokens; ++t) {
      if (slot[t] >= 0) std::memcpy(target + slot[t] * row_bytes, source + t * token_stride, row_bytes);
    }
  };
  copy_rows(key, k_cache);
  copy_rows(value, v_cache);
}

}  // namespace pagedllm_cpu

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rotate_qk_(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, int heads, int kv_heads, int head_dim, "
      "Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.0) -> ()");
  m.def("store_kv_(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("rms_norm", &pagedllm_cpu::rms_norm);
  m.impl("add_rms_norm", &pagedllm_cpu::add_rms_norm);
  m.impl("silu_and_mul", &pagedllm_cpu::silu_and_mul);
  m.impl("rotate_qk_", &pagedllm_cpu::rotate_qk_);
  m.impl("store_kv_", &pagedllm_cpu::store_kv_);
}
