// The decoder layers of a Llama-family model (models/llama.py) for a CPU step whose rows all decode (decode and
// verify steps), in one C++ call: the same kernels, in the same order, on the same arguments as the layers' modules
// call them one by one from Python, so the result is theirs to the bit (tests/models/test_cpu_decode_stack.py).
// What it saves is the time between the kernels: ~200 us a layer of module calls, views and op dispatch from Python,
// 30-43% of a one-sequence step of the default model (benchmarks/NOTES.md, session 28).
//
// One layer, as DecoderLayer.forward runs it with the cpu kernel choices (layer ops, rotary and attention in C++):
//   hidden, residual = add_rms_norm(hidden, residual)        (the first layer: rms_norm, residual = hidden)
//   qkv = qkv_proj(hidden); q and k rotated in place (after their norms, Qwen3)
//   k, v stored into the layer's cache at slot_mapping; out = attention of q over the cache, row by row
//   hidden = o_proj(out) (+ its bias); hidden, residual = add_rms_norm(hidden, residual)
//   hidden = down_proj(silu_and_mul(gate_up_proj(hidden)))
// A linear layer multiplies as its method does (layers/linear_method.py, layers/quantization/gguf.py): GGUF groups
// through the grouped-integer kernel in float32, float weights through float32 panels (layers/cpu_float_gemm.cpp),
// oneDNN (reordered) or at::linear.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace pagedllm_cpu {
namespace {

// How a linear layer's method computes x W^T + bias.
enum ProductKind : int64_t { kLinear = 0, kOneDnn = 1, kPanels = 2, kInt4 = 4, kInt8 = 8 };

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

// One linear layer's product, as its method computes it (the kind, the tensors it holds, the bias it adds).
class Product : public torch::CustomClassHolder {
 public:
  Product(int64_t kind, at::Tensor weight, std::optional<at::Tensor> scales, std::optional<at::Tensor> bias)
      : kind_(kind), weight_(std::move(weight)), scales_(std::move(scales)), bias_(std::move(bias)) {
    TORCH_CHECK(kind_ == kLinear || kind_ == kOneDnn || kind_ == kPanels || kind_ == kInt4 || kind_ == kInt8,
                "Product: kind is 0 (at::linear), 1 (oneDNN), 2 (float32 panels), 4 or 8 (grouped integers), got ",
                kind_);
    TORCH_CHECK((kind_ == kInt4 || kind_ == kInt8) == scales_.has_value(), "Product: scales go with grouped kinds");
  }

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind_) {
      case kLinear:
        return at::linear(x, weight_, bias_);
      case kOneDnn:
        return onednn_linear(x, weight_, bias_);
      case kPanels:
        return float_panels_mm(x, weight_, bias_);
      default: {  // GGUFLinearMethod.apply: the kernel in float32, cast back, then the bias
        const at::Tensor x32 = x.to(at::kFloat).contiguous();
        at::Tensor out = kind_ == kInt4 ? grouped_int4_mm(x32, weight_, *scales_) : grouped_int8_mm(x32, weight_, *scales_);
        out = out.to(x.scalar_type());
        return bias_ ? out + *bias_ : out;
      }
    }
  }

 private:
  int64_t kind_;
  at::Tensor weight_;
  std::optional<at::Tensor> scales_, bias_;
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps, at::Tensor cos_sin)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps), cos_sin_(std::move(cos_sin)) {}

  // Layers are added in model order. o_bias is added after o_proj's product, as RowParallelLinear does.
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, at::Tensor k_cache, at::Tensor v_cache,
                 c10::intrusive_ptr<Product> qkv, c10::intrusive_ptr<Product> o, std::optional<at::Tensor> o_bias,
                 c10::intrusive_ptr<Product> gate_up, c10::intrusive_ptr<Product> down) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "add_layer: q_norm and k_norm come together");
    layers_.push_back({std::move(input_norm), std::move(post_attention_norm), std::move(q_norm), std::move(k_norm),
                       std::move(k_cache), std::move(v_cache), std::move(qkv), std::move(o), std::move(o_bias),
                       std::move(gate_up), std::move(down)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden: the embedded tokens [tokens, hidden]; the attention arguments as paged_attention_rows takes them.
  // Returns (hidden, residual) after the last layer, for the model's final norm.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, const at::Tensor& positions,
                                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                             const std::optional<at::Tensor>& row_seqs, const at::Tensor& visible) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: no layers added");
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    at::Tensor residual;
    for (Layer& layer : layers_) {
      if (!residual.defined()) {
        residual = hidden;
        hidden = rms_norm(hidden, layer.input_norm, eps_);
      } else {
        std::tie(hidden, residual) = add_rms_norm(hidden, residual, layer.input_norm, eps_);
      }
      at::Tensor qkv = (*layer.qkv)(hidden);
      rotate_qk_(qkv, positions, cos_sin_, heads_, kv_heads_, head_dim_, layer.q_norm, layer.k_norm,
                 layer.q_norm ? eps_ : 0.0);
      const std::vector<at::Tensor> parts = qkv.split({q_size, kv_size, kv_size}, -1);
      const at::Tensor query = parts[0].view({-1, heads_, head_dim_});
      store_kv_(parts[1].view({-1, kv_heads_, head_dim_}), parts[2].view({-1, kv_heads_, head_dim_}), layer.k_cache,
                layer.v_cache, slot_mapping);
      const at::Tensor attended = paged_attention_rows(query.contiguous(), layer.k_cache, layer.v_cache, block_tables,
                                                       row_seqs, visible, scale_, std::nullopt, std::nullopt);
      hidden = (*layer.o)(attended.flatten(1));
      if (layer.o_bias) hidden = hidden + *layer.o_bias;
      std::tie(hidden, residual) = add_rms_norm(hidden, residual, layer.post_attention_norm, eps_);
      hidden = (*layer.down)(silu_and_mul((*layer.gate_up)(hidden)));
    }
    return {hidden, residual};
  }

 private:
  struct Layer {
    at::Tensor input_norm, post_attention_norm;
    std::optional<at::Tensor> q_norm, k_norm;
    at::Tensor k_cache, v_cache;
    c10::intrusive_ptr<Product> qkv, o;
    std::optional<at::Tensor> o_bias;
    c10::intrusive_ptr<Product> gate_up, down;
  };

  int64_t heads_, kv_heads_, head_dim_;
  double scale_, eps_;
  at::Tensor cos_sin_;
  std::vector<Layer> layers_;
};

}  // namespace pagedllm_cpu

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.class_<pagedllm_cpu::Product>("Product")
      .def(torch::init<int64_t, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>());
  m.class_<pagedllm_cpu::DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor>())
      .def("add_layer", &pagedllm_cpu::DecoderStack::add_layer)
      .def("num_layers", &pagedllm_cpu::DecoderStack::num_layers)
      .def("forward", &pagedllm_cpu::DecoderStack::forward);
}
