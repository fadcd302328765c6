// The ops of Sluice's kernel library that its other sources call directly (each is
// also registered as torch.ops.sluice_kernels.<name>; the comments at each
// definition say what it computes).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

namespace sluice {

// Eight values from p as float32 (bfloat16 widened exactly, float16 by F16C; every
// build has AVX2 and F16C): AVX2's activations and cached keys and values.
inline __m256 eight(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 eight(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 eight(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 eight(const double* p) {
  return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(p + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(p)));
}

#if defined(__AVX512F__)
// Sixteen values from p as float32 (a bfloat16 is a float32's upper half): activations
// here, cached keys and values in decode_ops.cpp.
inline __m512 sixteen(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 sixteen(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 sixteen(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// One group of 32 activations as int8 codes, llama.cpp's Q8_0 way: scale max|a| / 127,
// codes rounded to nearest even (as torch.round). Returns the scale; `sum` gets the
// codes' sum. Both packed layouts (planes_mm.cpp, blocks_mm.cpp) quantise through it.
// A bfloat16 activation is widened exactly, so either dtype gives the same codes.
#if defined(__AVX512F__)
// Vectorised: the same divisions, rounded as nearbyint rounds (the current mode,
// nearest even), so the same codes as the scalar form below. A scalar loop had been
// 3.8 % of a profile of Gemma 3 at C=64 with AVX-512 alone.
template <typename T>
inline float quantise_group(const T* in, int8_t* out, int32_t& sum) {
  const __m512 low = sixteen(in), high = sixteen(in + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
  const float d = amax / 127.f;
  if (!(d > 0.f)) {
    std::fill(out, out + 32, int8_t{0});
    sum = 0;
    return d;
  }
  const __m512 scale = _mm512_set1_ps(d);
  const __m512i q_low = _mm512_cvtps_epi32(_mm512_div_ps(low, scale));
  const __m512i q_high = _mm512_cvtps_epi32(_mm512_div_ps(high, scale));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(q_low));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(q_high));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high));
  return d;
}
#elif defined(__AVX2__)
// AVX2's form of the same (and the same codes): with AVX2 alone (emulated on a Zen 5),
// quantising 512 rows of 1536 took 0.34 ms in a scalar loop, a tenth of their product
// by a 576 x 1536 Q4_1 weight; 0.18 ms so.
template <typename T>
inline float quantise_group(const T* in, int8_t* out, int32_t& sum) {
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 4; ++i) {
    v[i] = eight(in + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  const float d = _mm_cvtss_f32(half) / 127.f;
  if (!(d > 0.f)) {
    std::fill(out, out + 32, int8_t{0});
    sum = 0;
    return d;
  }
  const __m256 scale = _mm256_set1_ps(d);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], scale));
  // int32 to int8, saturating (every code is within -127..127): the packs interleave
  // 128-bit lanes, which the permute puts back in order.
  const __m256i words = _mm256_packs_epi32(q[0], q[1]), words_high = _mm256_packs_epi32(q[2], q[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words_high),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i folded = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  folded = _mm_add_epi32(folded, _mm_shuffle_epi32(folded, _MM_SHUFFLE(1, 0, 3, 2)));
  folded = _mm_add_epi32(folded, _mm_shuffle_epi32(folded, _MM_SHUFFLE(2, 3, 0, 1)));
  sum = _mm_cvtsi128_si32(folded);
  return d;
}
#else
template <typename T>
inline float quantise_group(const T* in, int8_t* out, int32_t& sum) {
  constexpr int64_t kGroup = 32;
  float amax = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(static_cast<float>(in[i])));
  const float d = amax / 127.f;
  sum = 0;
  for (int64_t i = 0; i < kGroup; ++i) {
    out[i] = d > 0.f ? static_cast<int8_t>(std::nearbyint(static_cast<float>(in[i]) / d)) : 0;
    sum += out[i];
  }
  return d;
}
#endif

// `x` [M, K] as the packed products read it: float32 or bfloat16 as it is (bfloat16
// read directly, not copied to float32 first), any other dtype as float32.
inline at::Tensor quantisable(const at::Tensor& x) {
  const bool direct = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
  return direct ? x.contiguous() : x.to(at::kFloat).contiguous();
}

// Calls `each(m, g, in)` for every row m and group g of `x` (from ``quantisable``), `in`
// the group's 32 values (float or BFloat16), rows split across threads once there are
// this many values a thread: one step's few rows stay on the calling thread.
constexpr int64_t kQuantisedPerThread = 16384;
template <typename Each>
void for_each_group(const at::Tensor& x, const Each& each) {
  const int64_t rows = x.size(0), k = x.size(1), groups = k / 32;
  const auto over = [&](const auto* base) {
    at::parallel_for(0, rows, std::max<int64_t>(1, kQuantisedPerThread / k), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        for (int64_t g = 0; g < groups; ++g) each(m, g, base + m * k + g * 32);
    });
  };
  if (x.scalar_type() == at::kBFloat16) {
    over(x.data_ptr<at::BFloat16>());
  } else {
    over(x.data_ptr<float>());
  }
}

// planes_mm.cpp
at::Tensor planes_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& offset, bool five_bit = false);

// blocks_mm.cpp (no offset: centred codes; five_bit: byte codes all in 0..31, centred
// at 16, which the caller vouches for)
at::Tensor blocks_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& offset, bool five_bit = false);
int64_t block_rows();  // weight rows in a block: 16 (AVX-512 VNNI), 8 (AVX2), or 0
int64_t amx_rows();    // activation rows from which AMX multiplies blocks, or 0 where it cannot

// decode_ops.cpp
at::Tensor rms_norm_residual(at::Tensor x, const std::optional<at::Tensor>& delta,
                             const std::optional<at::Tensor>& delta_weight, const at::Tensor& weight,
                             double eps);
at::Tensor rope_kv(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& inv_freq,
                   double rope_scale, const std::optional<at::Tensor>& q_norm,
                   const std::optional<at::Tensor>& k_norm, double eps, at::Tensor k_cache,
                   at::Tensor v_cache, int64_t layer, int64_t heads, int64_t kv_heads,
                   const std::optional<at::Tensor>& slots = std::nullopt);
// Row r's query at positions[r] over its slot's cached keys and values (slot r, or
// slots[r] where given), in the cache's dtype: [rows, heads * head_dim].
at::Tensor decode_attention(const at::Tensor& q, at::Tensor k_cache, at::Tensor v_cache, int64_t layer,
                            const at::Tensor& positions, int64_t window, double scale, double softcap,
                            const std::optional<at::Tensor>& slots = std::nullopt);
at::Tensor gated_act(const at::Tensor& gate_up, int64_t act, at::ScalarType dtype);

}  // namespace sluice
