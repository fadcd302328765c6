// A decoder's whole decode step in one call: the layer loop of engine/direct_decode.py
// in C++, so that a step pays no Python and no dispatcher per op (from Python, a SmolLM2
// step was 270 op calls at about 3.5 us of dispatch each, and the Python between them).
//
// Registered as two TorchScript classes:
//   sluice_kernels.Gemm         one projection as the step multiplies it (kinds below;
//                               multiply() is for tests);
//   sluice_kernels.DecodeStack  the layers, added one by one, and forward().
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "kernels.h"

#include <optional>
#include <string>
#include <vector>

namespace {

// What a Gemm's weights are:
//   kOwnPlanes    planes_mm's (codes, scales[, offset]): float32 out;
//   kOwnFives     the same, blocks of five-bit codes (planes_mm's five_bit);
//   kTorchPlanes  (packed, scales_and_zeros) per plane of _weight_int4pack_mm_for_cpu,
//                 bfloat16 activations; two planes summed in float32;
//   kDense        (weight): linear(rows, weight, bias) in the weight's dtype;
//   kInt8Rows     (weight int8 [N, K], scale [N]): rows quantised to int8 per row
//                 (max |x| / 127), an integer GEMM, times both scales (float32 out).
enum Kind : int64_t { kOwnPlanes = 0, kTorchPlanes = 1, kDense = 2, kInt8Rows = 3, kOwnFives = 4 };
constexpr int64_t kGroup = 32;

// rows times a de-quantised weight in its dtype: plain, or reordered once into oneDNN's
// blocked layout (engine/prepacked_dense.py), which only oneDNN's own op reads.
at::Tensor dense_linear(const at::Tensor& rows, const at::Tensor& weight) {
  const at::Tensor x = rows.to(weight.scalar_type());
  if (!weight.is_mkldnn()) return at::linear(x, weight);
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x.contiguous(), weight, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

struct Gemm : torch::CustomClassHolder {
  int64_t kind;
  std::vector<at::Tensor> weights;
  std::optional<at::Tensor> bias;
  // A packed kind multiplies up to max_rows rows; past that, its de-quantised weight
  // (dense) in that weight's dtype, as engine/gguf_packed.py does.
  int64_t max_rows;
  std::optional<at::Tensor> dense;

  Gemm(int64_t kind, std::vector<at::Tensor> weights, std::optional<at::Tensor> bias, int64_t max_rows,
       std::optional<at::Tensor> dense)
      : kind(kind), weights(std::move(weights)), bias(std::move(bias)), max_rows(max_rows), dense(std::move(dense)) {
    const size_t n = this->weights.size();
    TORCH_CHECK(((kind == kOwnPlanes || kind == kOwnFives) && (n == 2 || n == 3)) || (kind == kTorchPlanes && n >= 2 && n % 2 == 0) ||
                    (kind == kDense && n == 1) || (kind == kInt8Rows && n == 2),
                "Gemm: kind ", kind, " cannot hold ", n, " weights");
  }

  at::Tensor product(const at::Tensor& rows) const {
    if (dense.has_value() && rows.size(0) > max_rows) return dense_linear(rows, *dense);
    switch (kind) {
      case kOwnPlanes:
      case kOwnFives:
        return sluice::planes_mm(rows, weights[0], weights[1],
                                 weights.size() > 2 ? std::optional<at::Tensor>(weights[2]) : std::nullopt,
                                 kind == kOwnFives);
      case kTorchPlanes: {
        const at::Tensor x = rows.to(at::kBFloat16);
        at::Tensor total = at::_weight_int4pack_mm_for_cpu(x, weights[0], kGroup, weights[1]);
        if (weights.size() == 2) return total;
        // Summed in float32, so that the sum adds no bfloat16 rounding of its own.
        total = total.to(at::kFloat);
        for (size_t p = 2; p < weights.size(); p += 2)
          total.add_(at::_weight_int4pack_mm_for_cpu(x, weights[p], kGroup, weights[p + 1]));
        return total;
      }
      case kInt8Rows: {
        const at::Tensor scale = rows.abs().amax({-1}, true).to(at::kFloat).clamp_min_(1e-12).div_(127.0);
        const at::Tensor values = rows.mul(scale.reciprocal()).round_().to(at::kChar);
        return (at::_int_mm(values, weights[0].t()) * scale).mul_(weights[1]);
      }
      default:
        return at::Tensor();
    }
  }

  at::Tensor operator()(const at::Tensor& rows) const {
    if (kind == kDense) return at::linear(rows, weights[0], bias);
    const at::Tensor out = product(rows);
    return bias.has_value() ? out + *bias : out;
  }
};

struct Norm {
  at::Tensor weight;  // float32: what the normalised input is multiplied by
  double eps = 0.0;
};

std::optional<at::Tensor> weight_of(const std::optional<Norm>& norm) {
  return norm.has_value() ? std::optional<at::Tensor>(norm->weight) : std::nullopt;
}

struct Layer {
  int64_t storage, cache_layer;  // its cache: which storage, which layer in it
  Norm attention_norm;
  c10::intrusive_ptr<Gemm> qkv, o_proj, gate_up, down;
  std::optional<at::Tensor> q_norm, k_norm;  // per head (float32 [head_dim])
  double qk_eps;
  at::Tensor inv_freq;
  double rope_scale;
  int64_t window;  // 0: full attention
  double scale, softcap;
  std::optional<Norm> post_attention_norm;  // on the attention's output (Gemma 3)
  Norm mlp_norm;
  int64_t activation;
  std::optional<Norm> post_mlp_norm;  // on the MLP's output (Gemma 3)
};

std::optional<Norm> optional_norm(const std::optional<at::Tensor>& weight, double eps) {
  return weight.has_value() ? std::optional<Norm>(Norm{*weight, eps}) : std::nullopt;
}

struct DecodeStack : torch::CustomClassHolder {
  int64_t heads, kv_heads;
  Norm final_norm;
  std::vector<Layer> layers;

  DecodeStack(int64_t heads, int64_t kv_heads, at::Tensor final_norm, double final_eps)
      : heads(heads), kv_heads(kv_heads), final_norm{std::move(final_norm), final_eps} {}

  // Norms come as (weight or None, eps) pairs, as engine/direct_decode.py's Norm.
  void add_layer(int64_t storage, int64_t cache_layer, at::Tensor attention_norm, double attention_eps,
                 c10::intrusive_ptr<Gemm> qkv, std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 double qk_eps, at::Tensor inv_freq, double rope_scale, int64_t window, double scale,
                 double softcap, c10::intrusive_ptr<Gemm> o_proj, std::optional<at::Tensor> post_attention_norm,
                 double post_attention_eps, at::Tensor mlp_norm, double mlp_eps, c10::intrusive_ptr<Gemm> gate_up,
                 int64_t activation, c10::intrusive_ptr<Gemm> down, std::optional<at::Tensor> post_mlp_norm,
                 double post_mlp_eps) {
    layers.push_back(Layer{storage, cache_layer, Norm{std::move(attention_norm), attention_eps}, std::move(qkv),
                           std::move(o_proj), std::move(gate_up), std::move(down), std::move(q_norm),
                           std::move(k_norm), qk_eps, std::move(inv_freq), rope_scale, window, scale, softcap,
                           optional_norm(post_attention_norm, post_attention_eps), Norm{std::move(mlp_norm), mlp_eps},
                           activation, optional_norm(post_mlp_norm, post_mlp_eps)});
  }

  // The last hidden states [rows, H] of rows taking the embedded tokens x [rows, H]
  // (in the cache's dtype; the residual stream, updated in place) at positions
  // (int64 [rows]) of their slots (slot r, or slots[r]: a packed step's tokens, each a
  // row, those of a prompt chunk sharing its slot); keys[s] and values[s] are storage
  // s's caches.
  at::Tensor forward(at::Tensor x, const at::Tensor& positions, const std::vector<at::Tensor>& keys,
                     const std::vector<at::Tensor>& values, const std::optional<at::Tensor>& slots) const {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "DecodeStack: x [rows, hidden], contiguous");
    TORCH_CHECK(keys.size() == values.size(), "DecodeStack: a key and a value cache per storage");
    std::optional<at::Tensor> delta, delta_weight;
    for (const Layer& layer : layers) {
      TORCH_CHECK(layer.storage < static_cast<int64_t>(keys.size()), "DecodeStack: no cache for a layer");
      const at::Tensor& k_cache = keys[layer.storage];
      const at::Tensor& v_cache = values[layer.storage];
      at::Tensor h = sluice::rms_norm_residual(x, delta, delta_weight, layer.attention_norm.weight,
                                               layer.attention_norm.eps);
      const at::Tensor q = sluice::rope_kv((*layer.qkv)(h), positions, layer.inv_freq, layer.rope_scale,
                                           layer.q_norm, layer.k_norm, layer.qk_eps, k_cache, v_cache,
                                           layer.cache_layer, heads, kv_heads, slots);
      const at::Tensor attended = sluice::decode_attention(q, k_cache, v_cache, layer.cache_layer, positions,
                                                           layer.window, layer.scale, layer.softcap, slots);
      h = sluice::rms_norm_residual(x, (*layer.o_proj)(attended), weight_of(layer.post_attention_norm),
                                    layer.mlp_norm.weight, layer.mlp_norm.eps);
      delta = (*layer.down)(sluice::gated_act((*layer.gate_up)(h), layer.activation, x.scalar_type()));
      delta_weight = weight_of(layer.post_mlp_norm);
    }
    return sluice::rms_norm_residual(x, delta, delta_weight, final_norm.weight, final_norm.eps);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice_kernels, m) {
  m.class_<Gemm>("Gemm")
      .def(torch::init<int64_t, std::vector<at::Tensor>, std::optional<at::Tensor>, int64_t,
                       std::optional<at::Tensor>>())
      .def("multiply", [](const c10::intrusive_ptr<Gemm>& self, const at::Tensor& rows) { return (*self)(rows); });
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, at::Tensor, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward);
}
