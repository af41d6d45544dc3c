// The CPU kernels' entry points (each registered as a torch op in its own file, under torch.ops.pagedllm_cpu), for
// C++ that calls them directly: the decode stack (models/cpu_decode_stack.cpp) runs a layer's kernels without
// going back to Python between them.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace pagedllm_cpu {

// layers/quantization/cpu_grouped_gemm.cpp: x float32 [M, K] times a weight kept in groups of 32 small integers.
at::Tensor grouped_int4_mm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales);
at::Tensor grouped_int8_mm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales);

// layers/cpu_float_gemm.cpp: x float32 [M, K] times a float32 weight packed into panels of 16 columns.
at::Tensor pack_float_panels(const at::Tensor& weight);
at::Tensor float_panels_mm(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias);

// layers/cpu_layer_ops.cpp: a layer's small operations.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rotate_qk_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, int64_t heads,
                int64_t kv_heads, int64_t head_dim, const std::optional<at::Tensor>& q_norm,
                const std::optional<at::Tensor>& k_norm, double eps);
void store_kv_(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_mapping);

// attention/cpu_paged_attention.cpp: decode and verify rows attended over the paged cache in place.
at::Tensor paged_attention_rows(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const std::optional<at::Tensor>& row_seqs,
                                const at::Tensor& visible, double scale, const std::optional<at::Tensor>& k_scale,
                                const std::optional<at::Tensor>& v_scale);

}  // namespace pagedllm_cpu
