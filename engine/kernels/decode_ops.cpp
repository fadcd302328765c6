// The small steps of a decoder layer at decode time, each one op over every row of the
// step, so that a layer is nine calls (four GEMMs and these) instead of transformers'
// hundred-odd modules and small ops. engine/direct_decode.py strings them together.
//
// Each computes in float32 and rounds to the activations' dtype (float32, bfloat16 or
// float16) where transformers' layer rounds a tensor it keeps: a GEMM's output, a
// normalised input, the residual stream, a rotated query or key, the cache.
//   rms_norm_residual  x += norm'(delta) (or x += delta), then norm(x): the residual add
//                      that ends a block and the RMSNorm that starts the next.
//   rope_kv            q/k norms per head (Gemma 3, Qwen 3), rotary embedding, and the
//                      key and value written into the cache; returns the queries.
//   decode_attention   one query token a row over its slot's cached keys (causal, with
//                      an optional sliding window and score soft-cap), grouped heads.
//   gated_act          act(gate) * up, SiLU or tanh-approximated GELU.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// Rows [0, rows) of `width` values each, split across threads once a thread has this
// many values: each row is computed alone, in the same order, so the split changes no
// result. These ops had run on one thread, the other waiting in libgomp: at 64 rows of
// Gemma 3 the norms, rotary and cache write were about an eighth of a decode step. The
// workers touch raw memory only: they do not hold the caller's thread-local modes
// (inference mode among them), so an ATen op there would see other rules.
constexpr int64_t kRowValuesPerThread = 2048;
template <typename Each>
void for_rows(int64_t rows, int64_t width, const Each& each) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kRowValuesPerThread / std::max<int64_t>(1, width)), each);
}

template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Row r of a [rows, width] tensor of any float dtype, rounded to T, as float32.
struct FloatRows {
  at::Tensor held;  // float32, contiguous
  const float* data;
  int64_t width;
};

template <typename T>
FloatRows float_rows(const at::Tensor& t) {
  at::Tensor held = t.scalar_type() == c10::CppTypeToScalarType<T>::value
                        ? t.to(at::kFloat).contiguous()
                        : t.to(c10::CppTypeToScalarType<T>::value).to(at::kFloat).contiguous();
  return {held, held.data_ptr<float>(), held.size(-1)};
}

// x * rsqrt(mean(x^2) + eps) * weight, in float32.
inline void normalise(const float* x, const float* weight, float eps, int64_t n, float* out) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  const float scale = 1.0f / std::sqrt(static_cast<float>(sum / n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

template <typename T>
at::Tensor rms_norm_residual_impl(at::Tensor& x, const std::optional<at::Tensor>& delta,
                                  const std::optional<at::Tensor>& delta_weight,
                                  const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), width = x.size(1);
  T* xs = x.data_ptr<T>();
  const float* w = weight.data_ptr<float>();
  at::Tensor out = at::empty_like(x);
  T* outs = out.data_ptr<T>();
  std::optional<FloatRows> d;
  if (delta.has_value()) d = float_rows<T>(*delta);
  const float* dw = delta_weight.has_value() ? delta_weight->data_ptr<float>() : nullptr;
  for_rows(rows, width, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width), normed(width);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xs + r * width;
      for (int64_t i = 0; i < width; ++i) row[i] = static_cast<float>(xr[i]);
      if (d.has_value()) {
        const float* dr = d->data + r * width;
        if (dw != nullptr) {
          normalise(dr, dw, static_cast<float>(eps), width, normed.data());
          for (int64_t i = 0; i < width; ++i) row[i] = rounded<T>(row[i] + rounded<T>(normed[i]));
        } else {
          for (int64_t i = 0; i < width; ++i) row[i] = rounded<T>(row[i] + dr[i]);
        }
        for (int64_t i = 0; i < width; ++i) xr[i] = static_cast<T>(row[i]);
      }
      normalise(row.data(), w, static_cast<float>(eps), width, normed.data());
      for (int64_t i = 0; i < width; ++i) outs[r * width + i] = static_cast<T>(normed[i]);
    }
  });
  return out;
}

}  // namespace

at::Tensor sluice::rms_norm_residual(at::Tensor x, const std::optional<at::Tensor>& delta,
                                     const std::optional<at::Tensor>& delta_weight, const at::Tensor& weight,
                                     double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm_residual: x [rows, width], contiguous");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1),
              "rms_norm_residual: weight float32 [width]");
  TORCH_CHECK(!delta.has_value() || delta->sizes() == x.sizes(), "rms_norm_residual: delta as x");
  TORCH_CHECK(!delta_weight.has_value() || (delta_weight->scalar_type() == at::kFloat &&
                                             delta_weight->numel() == x.size(1)),
              "rms_norm_residual: delta_weight float32 [width]");
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_residual",
                                         [&] { return rms_norm_residual_impl<scalar_t>(x, delta, delta_weight, weight, eps); });
}

namespace {

// The cache [layers, slots, kv_heads, positions, head_dim]: where slot s, head h,
// position p of a layer starts.
template <typename T>
struct CacheView {
  T* base;
  int64_t slot, head, position;

  CacheView(at::Tensor& cache, int64_t layer)
      : base(cache.data_ptr<T>() + layer * cache.stride(0)),
        slot(cache.stride(1)),
        head(cache.stride(2)),
        position(cache.stride(3)) {}

  T* at_(int64_t s, int64_t h, int64_t p) const { return base + s * slot + h * head + p * position; }
};

// Every position (int64 [rows]) within the cache's `cached` positions.
void check_positions(const at::Tensor& positions, int64_t cached, const char* op) {
  const int64_t* pos = positions.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(pos, pos + positions.numel(), [&](int64_t p) { return p >= 0 && p < cached; }), op,
              ": a position past the cache");
}

// The slot each of `rows` rows reads and writes: slots[r] where given (a packed step's
// prompt tokens share their slot), else r; nullptr for the latter. Checked against the
// cache's `cached` slots.
const int64_t* cache_slots(const std::optional<at::Tensor>& slots, int64_t rows, int64_t cached, const char* op) {
  if (!slots.has_value()) {
    TORCH_CHECK(rows <= cached, op, ": more rows than slots");
    return nullptr;
  }
  TORCH_CHECK(slots->scalar_type() == at::kLong && slots->is_contiguous() && slots->numel() == rows, op,
              ": slots int64 [rows]");
  const int64_t* slot_of = slots->data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(slot_of, slot_of + rows, [&](int64_t s) { return s >= 0 && s < cached; }), op,
              ": a slot past the cache");
  return slot_of;
}

template <typename T>
at::Tensor rope_kv_impl(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& inv_freq,
                        double rope_scale, const std::optional<at::Tensor>& q_norm,
                        const std::optional<at::Tensor>& k_norm, double eps, at::Tensor& k_cache,
                        at::Tensor& v_cache, int64_t layer, int64_t heads, int64_t kv_heads, const int64_t* slots) {
  const int64_t rows = qkv.size(0), dim = k_cache.size(4), half = dim / 2;
  const FloatRows in = float_rows<T>(qkv);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* freq = inv_freq.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  at::Tensor q = at::empty({rows, heads, dim}, k_cache.options());
  T* qs = q.data_ptr<T>();
  CacheView<T> keys(k_cache, layer), values(v_cache, layer);
  for_rows(rows, (heads + 2 * kv_heads) * dim, [&](int64_t begin, int64_t end) {
    std::vector<float> cos(dim), sin(dim), head(dim);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = pos[r], slot = slots != nullptr ? slots[r] : r;
      for (int64_t j = 0; j < half; ++j) {
        const float angle = static_cast<float>(p) * freq[j];
        cos[j] = cos[j + half] = rounded<T>(std::cos(angle) * static_cast<float>(rope_scale));
        sin[j] = sin[j + half] = rounded<T>(std::sin(angle) * static_cast<float>(rope_scale));
      }
      const float* row = in.data + r * in.width;
      // Queries (heads) then keys (kv_heads): normalised per head where the model does,
      // rotated, rounded.
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const float* src = row + h * dim;
        const float* norm = h < heads ? qn : kn;
        if (norm != nullptr) {
          normalise(src, norm, static_cast<float>(eps), dim, head.data());
          for (int64_t j = 0; j < dim; ++j) head[j] = rounded<T>(head[j]);
        } else {
          std::copy(src, src + dim, head.begin());
        }
        T* dst = h < heads ? qs + (r * heads + h) * dim : keys.at_(slot, h - heads, p);
        for (int64_t j = 0; j < dim; ++j) {
          const float rotated = j < half ? -head[j + half] : head[j - half];
          dst[j] = static_cast<T>(head[j] * cos[j] + rotated * sin[j]);
        }
      }
      const float* v = row + (heads + kv_heads) * dim;
      for (int64_t h = 0; h < kv_heads; ++h) {
        T* dst = values.at_(slot, h, p);
        for (int64_t j = 0; j < dim; ++j) dst[j] = static_cast<T>(v[h * dim + j]);
      }
    }
  });
  return q;
}

}  // namespace

at::Tensor sluice::rope_kv(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& inv_freq,
                           double rope_scale, const std::optional<at::Tensor>& q_norm,
                           const std::optional<at::Tensor>& k_norm, double eps, at::Tensor k_cache,
                           at::Tensor v_cache, int64_t layer, int64_t heads, int64_t kv_heads,
                           const std::optional<at::Tensor>& slots) {
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "rope_kv: caches [layers, slots, kv_heads, positions, head_dim], alike");
  const int64_t dim = k_cache.size(4);
  TORCH_CHECK(dim % 2 == 0 && k_cache.size(2) == kv_heads, "rope_kv: cache heads and width");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * dim, "rope_kv: qkv [rows, (H + 2 KV) D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == qkv.size(0),
              "rope_kv: positions int64 [rows]");
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.numel() == dim / 2, "rope_kv: inv_freq float32 [D / 2]");
  TORCH_CHECK(!q_norm.has_value() || q_norm->numel() == dim, "rope_kv: q_norm [D]");
  TORCH_CHECK(!k_norm.has_value() || k_norm->numel() == dim, "rope_kv: k_norm [D]");
  check_positions(positions, k_cache.size(3), "rope_kv");
  const int64_t* slot_of = cache_slots(slots, qkv.size(0), k_cache.size(1), "rope_kv");
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "rope_kv", [&] {
    return rope_kv_impl<scalar_t>(qkv, positions, inv_freq, rope_scale, q_norm, k_norm, eps, k_cache, v_cache,
                                  layer, heads, kv_heads, slot_of);
  });
}

namespace {

using sluice::eight;

inline float total(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

constexpr int64_t kHeadsAtOnce = 4;

// e^x for eight floats at most 0 (scores less their maximum): Cephes' expf, a
// polynomial after reducing by ln 2, within a few ulp of std::exp; 0 below -87.3, where
// e^x is no longer a normal float. (std::exp, one score at a time, was 6 % of a perf
// profile of this op at 64 rows of SmolLM2, against 71 % in the op's own code.)
inline __m256 exp_at_most_zero(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.3f);
  const __m256 normal = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_to_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n)), normal);
}

// Asks for the cache lines of `bytes` from p. The attention reads each slot's keys and
// values once, in position order, from a cache that is larger than the L3 at a decode
// step of many rows; the hardware's prefetching alone had it at ≈18 GB/s of a VM's 46.
// A prefetch past the cache's end does not fault.
inline void fetch(const void* p, int64_t bytes) {
  const char* at = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(at + b, _MM_HINT_T0);
}

// Rows of keys or values asked for this many positions before they are read.
constexpr int64_t kFetchAhead = 8;

// The largest of sc[t] for t < n (n ≥ 1), eight at a time.
inline float largest(const float* sc, int64_t n) {
  int64_t t = 0;
  float top = sc[0];
  if (n >= 8) {
    __m256 tops = _mm256_loadu_ps(sc);
    for (t = 8; t + 8 <= n; t += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(sc + t));
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(tops), _mm256_extractf128_ps(tops, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    top = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
  }
  for (; t < n; ++t) top = std::max(top, sc[t]);
  return top;
}

// sc[t] = e^(sc[t] - top) for t < n; returns their sum.
inline float exp_less(float* sc, int64_t n, float top) {
  const __m256 shift = _mm256_set1_ps(top);
  __m256 sums = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_at_most_zero(_mm256_sub_ps(_mm256_loadu_ps(sc + t), shift));
    _mm256_storeu_ps(sc + t, e);
    sums = _mm256_add_ps(sums, e);
  }
  float sum = total(sums);
  for (; t < n; ++t) sum += (sc[t] = std::exp(sc[t] - top));
  return sum;
}

// A vector width the attention's dots are taken at: AVX2's eight lanes, or AVX-512's
// sixteen (below), each loading the cache's dtype widened to float32.
struct EightLanes {
  using Vec = __m256;
  static constexpr int64_t kLanes = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T>
  static Vec widen(const T* p) { return eight(p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(Vec v) { return total(v); }
  static Vec splat(float v) { return _mm256_set1_ps(v); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  // Vectors of a value row held at once by weighted_block: four heads' sums of two
  // vectors and the two loaded fill ten of AVX2's sixteen registers.
  static constexpr int kValueVecs = 2;
};

// out[g * stride + p] = dot(query g, key p) for Heads query heads from g0 (float32
// [group, dim]) and Positions consecutive keys, read in the cache's dtype: independent
// sums, so that one sum's additions do not wait on each other's latency (one dot a head
// at a time, over a float copy of the key, had been a chain of dim / 8 dependent adds).
// Each sum adds its terms in the same order whatever Positions is; two positions give
// eight sums in flight, where four heads alone kept the multiply-adds waiting on their
// latency. Heads is a template parameter so that the sums stay in registers: with a
// count known only at run time GCC kept them on the stack, a store and a reload each
// multiply-add (half of the attention's time at SmolLM2's shape with AVX2 alone).
template <typename Lanes, int Heads, int Positions, typename T>
void dots_block(const float* query, int64_t g0, const T* const* keys, int64_t dim, float* out, int64_t stride) {
  constexpr int64_t kLanes = Lanes::kLanes;
  typename Lanes::Vec acc[Heads][Positions];
  for (auto& head : acc)
    for (auto& v : head) v = Lanes::zero();
  int64_t j = 0;
  for (; j + kLanes <= dim; j += kLanes) {
    typename Lanes::Vec k[Positions];
    for (int p = 0; p < Positions; ++p) k[p] = Lanes::widen(keys[p] + j);
    for (int g = 0; g < Heads; ++g) {
      const auto q = Lanes::load(query + (g0 + g) * dim + j);
      for (int p = 0; p < Positions; ++p) acc[g][p] = Lanes::fma(q, k[p], acc[g][p]);
    }
  }
  for (int g = 0; g < Heads; ++g)
    for (int p = 0; p < Positions; ++p) {
      float sum = Lanes::sum(acc[g][p]);
      for (int64_t i = j; i < dim; ++i) sum += query[(g0 + g) * dim + i] * static_cast<float>(keys[p][i]);
      out[(g0 + g) * stride + p] = sum;
    }
}

// dots_block over a group's query heads, up to four a pass.
template <typename Lanes, int Positions, typename T>
void group_dots(const float* query, int64_t group, const T* const* keys, int64_t dim, float* out, int64_t stride) {
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsAtOnce) {
    switch (std::min(kHeadsAtOnce, group - g0)) {
      case 4: dots_block<Lanes, 4, Positions>(query, g0, keys, dim, out, stride); break;
      case 3: dots_block<Lanes, 3, Positions>(query, g0, keys, dim, out, stride); break;
      case 2: dots_block<Lanes, 2, Positions>(query, g0, keys, dim, out, stride); break;
      default: dots_block<Lanes, 1, Positions>(query, g0, keys, dim, out, stride); break;
    }
  }
}

#if defined(__AVX512F__)
using sluice::sixteen;  // sixteen values as float32, as eight() gives eight

template <typename T>
constexpr bool kSixteenWide = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

struct SixteenLanes {
  using Vec = __m512;
  static constexpr int64_t kLanes = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  template <typename T>
  static Vec widen(const T* p) { return sixteen(p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(Vec v) { return _mm512_reduce_add_ps(v); }
  static Vec splat(float v) { return _mm512_set1_ps(v); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static constexpr int kValueVecs = 4;
};

#endif

// out[g][j] = sum over t < n, in order, of p[g * n + t] * value t [j], for Heads heads
// from g0 and Vecs vectors of values from j: the sums stay in registers across the
// positions, each adding its terms in position order, one fused multiply-add each.
template <typename Lanes, typename T, int Heads, int Vecs>
void weighted_block(const float* p, int64_t n, int64_t g0, const CacheView<T>& values, int64_t r, int64_t h,
                    int64_t first, int64_t j, int64_t dim, float* out) {
  constexpr int64_t kLanes = Lanes::kLanes;
  typename Lanes::Vec acc[Heads][Vecs];
  for (int g = 0; g < Heads; ++g)
    for (int v = 0; v < Vecs; ++v) acc[g][v] = Lanes::zero();
  for (int64_t t = 0; t < n; ++t) {
    // The first pass over a row's values brings them in; later passes find them cached.
    if (j == 0) fetch(values.at_(r, h, first + t + kFetchAhead), dim * static_cast<int64_t>(sizeof(T)));
    const T* value = values.at_(r, h, first + t) + j;
    typename Lanes::Vec x[Vecs];
    for (int v = 0; v < Vecs; ++v) x[v] = Lanes::widen(value + kLanes * v);
    for (int g = 0; g < Heads; ++g) {
      const auto weight = Lanes::splat(p[(g0 + g) * n + t]);
      for (int v = 0; v < Vecs; ++v) acc[g][v] = Lanes::fma(weight, x[v], acc[g][v]);
    }
  }
  for (int g = 0; g < Heads; ++g)
    for (int v = 0; v < Vecs; ++v) Lanes::store(out + (g0 + g) * dim + j + kLanes * v, acc[g][v]);
}

template <typename Lanes, typename T, int Vecs>
void weighted_heads(const float* p, int64_t n, int64_t group, const CacheView<T>& values, int64_t r, int64_t h,
                    int64_t first, int64_t j, int64_t dim, float* out) {
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsAtOnce) {
    switch (std::min(kHeadsAtOnce, group - g0)) {
      case 4: weighted_block<Lanes, T, 4, Vecs>(p, n, g0, values, r, h, first, j, dim, out); break;
      case 3: weighted_block<Lanes, T, 3, Vecs>(p, n, g0, values, r, h, first, j, dim, out); break;
      case 2: weighted_block<Lanes, T, 2, Vecs>(p, n, g0, values, r, h, first, j, dim, out); break;
      default: weighted_block<Lanes, T, 1, Vecs>(p, n, g0, values, r, h, first, j, dim, out); break;
    }
  }
}

// The attention-weighted values of a (row, kv head): out [group, dim] = p [group, n]
// times the n values from position first. With AVX2 these were once summed in
// memory, a load and a store a head, position and vector: the decode attention was
// 10.5 % of a SmolLM2 step at C=16 with AVX2 alone (emulated on a Zen 5).
template <typename Lanes, typename T>
void weighted_values(const float* p, int64_t n, int64_t group, const CacheView<T>& values, int64_t r, int64_t h,
                     int64_t first, int64_t dim, float* out) {
  constexpr int64_t kLanes = Lanes::kLanes, kWide = kLanes * Lanes::kValueVecs;
  int64_t j = 0;
  for (; j + kWide <= dim; j += kWide) weighted_heads<Lanes, T, Lanes::kValueVecs>(p, n, group, values, r, h, first, j, dim, out);
  for (; j + kLanes <= dim; j += kLanes) weighted_heads<Lanes, T, 1>(p, n, group, values, r, h, first, j, dim, out);
  for (; j < dim; ++j)
    for (int64_t g = 0; g < group; ++g) {
      float sum = 0.0f;
      for (int64_t t = 0; t < n; ++t) sum += p[g * n + t] * static_cast<float>(values.at_(r, h, first + t)[j]);
      out[g * dim + j] = sum;
    }
}

template <typename T>
at::Tensor decode_attention_impl(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, int64_t layer,
                                 const at::Tensor& positions, int64_t window, double scale, double softcap,
                                 const int64_t* slots) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(2), group = heads / kv_heads;
  at::Tensor out = at::empty({rows, heads * dim}, q.options());
  const T* qs = q.data_ptr<T>();
  T* outs = out.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const CacheView<T> keys(k_cache, layer), values(v_cache, layer);
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // One task a (row, kv head): its group of query heads read each key and value once.
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * dim), acc(group * dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads;
      const int64_t slot = slots != nullptr ? slots[r] : r;
      const int64_t last = pos[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      const int64_t n = last - first + 1;
      scores.assign(group * n, 0.0f);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < dim; ++j) query[g * dim + j] = static_cast<float>(qs[(r * heads + h * group + g) * dim + j]);
      // Keys two positions at a time, then the last alone.
      const auto dots = [&](auto positions, int64_t t) {
        constexpr int kPositions = decltype(positions)::value;
        const T* at[kPositions];
        for (int p = 0; p < kPositions; ++p) at[p] = keys.at_(slot, h, first + t + p);
#if defined(__AVX512F__)
        if constexpr (kSixteenWide<T>)
          group_dots<SixteenLanes, kPositions>(query.data(), group, at, dim, scores.data() + t, n);
        else
#endif
          group_dots<EightLanes, kPositions>(query.data(), group, at, dim, scores.data() + t, n);
      };
      int64_t t = 0;
      for (; t + 2 <= n; t += 2) {
        fetch(keys.at_(slot, h, first + t + kFetchAhead), 2 * dim * static_cast<int64_t>(sizeof(T)));
        dots(std::integral_constant<int, 2>{}, t);
      }
      if (t < n) dots(std::integral_constant<int, 1>{}, t);
      // Scaled apart from the soft-cap, so that the scaling is vectorised.
      for (float& score : scores) score *= s;
      if (cap > 0.0f)
        for (float& score : scores) score = std::tanh(score / cap) * cap;
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores.data() + g * n;
        const float top = largest(sc, n);
        const float inv = 1.0f / exp_less(sc, n, top);
        for (int64_t t = 0; t < n; ++t) sc[t] *= inv;
      }
#if defined(__AVX512F__)
      if constexpr (kSixteenWide<T>)
        weighted_values<SixteenLanes>(scores.data(), n, group, values, slot, h, first, dim, acc.data());
      else
#endif
        weighted_values<EightLanes>(scores.data(), n, group, values, slot, h, first, dim, acc.data());
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < dim; ++j) outs[r * heads * dim + (h * group + g) * dim + j] = static_cast<T>(acc[g * dim + j]);
    }
  });
  return out;
}

}  // namespace

at::Tensor sluice::decode_attention(const at::Tensor& q, at::Tensor k_cache, at::Tensor v_cache, int64_t layer,
                                    const at::Tensor& positions, int64_t window, double scale, double softcap,
                                    const std::optional<at::Tensor>& slots) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == k_cache.scalar_type(),
              "decode_attention: q [rows, heads, head_dim] in the cache's dtype");
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() && k_cache.size(4) == q.size(2),
              "decode_attention: caches [layers, slots, kv_heads, positions, head_dim], alike");
  TORCH_CHECK(layer >= 0 && layer < k_cache.size(0), "decode_attention: no such layer in the cache");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "decode_attention: heads a multiple of kv heads");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "decode_attention: positions int64 [rows]");
  check_positions(positions, k_cache.size(3), "decode_attention");
  const int64_t* slot_of = cache_slots(slots, q.size(0), k_cache.size(1), "decode_attention");
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    return decode_attention_impl<scalar_t>(q, k_cache, v_cache, layer, positions, window, scale, softcap, slot_of);
  });
}

namespace {

constexpr int64_t kSilu = 0;
constexpr int64_t kGeluTanh = 1;

}  // namespace

// transformers' own arithmetic (the activation and the product each rounded to
// ``dtype``), in ATen's vectorised kernels.
at::Tensor sluice::gated_act(const at::Tensor& gate_up, int64_t act, at::ScalarType dtype) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gated_act: gate_up [rows, 2 I]");
  TORCH_CHECK(act == kSilu || act == kGeluTanh, "gated_act: act 0 (SiLU) or 1 (tanh GELU)");
  const at::Tensor both = gate_up.to(dtype);
  const int64_t width = both.size(1) / 2;
  const at::Tensor gate = both.narrow(1, 0, width), up = both.narrow(1, width, width);
  return (act == kSilu ? at::silu(gate) : at::gelu(gate, "tanh")) * up;
}


TORCH_LIBRARY_FRAGMENT(sluice_kernels, m) {
  m.def("rms_norm_residual(Tensor(a!) x, Tensor? delta, Tensor? delta_weight, Tensor weight, float eps) -> Tensor");
  m.def(
      "rope_kv(Tensor qkv, Tensor positions, Tensor inv_freq, float rope_scale, Tensor? q_norm, Tensor? k_norm, "
      "float eps, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, int heads, int kv_heads, Tensor? slots=None) "
      "-> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, int layer, Tensor positions, int window, "
      "float scale, float softcap, Tensor? slots=None) -> Tensor");
  m.def("gated_act(Tensor gate_up, int act, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice_kernels, CPU, m) {
  m.impl("rms_norm_residual", &sluice::rms_norm_residual);
  m.impl("rope_kv", &sluice::rope_kv);
  m.impl("decode_attention", &sluice::decode_attention);
  m.impl("gated_act", &sluice::gated_act);
}
