// A GGUF linear's codes times activations quantised to int8 per group of 32, the way
// llama.cpp multiplies its blocks: integer dot products (AVX-512 VNNI two groups at a
// time where the CPU has it, AVX-VNNI or AVX2's maddubs otherwise), one float scale per
// group. Registered as torch.ops.sluice_kernels.planes_mm; engine/native_kernels.py
// builds it for the CPU it runs on and engine/plane_kernels.py lays out its weights.
//
// A weight is codes times scales plus an offset per group of 32 inputs:
//   w = sum_p code_p * scale_p + offset,
// with either up to two planes of 4-bit codes (codes uint8 [P, N, K/2]: byte j of a
// group holds input j in its low nibble and input j + 16 in its high one), or one plane
// of 8-bit codes (codes uint8 [1, N, K]). scales fp16 [P, N, K/32], offset fp16
// [N, K/32]. An activation group is da * qa (qa int8, da = max|a| / 127), so a group's
//   sum_i w_i a_i = da * sum_p scale_p * dot(code_p, qa) + offset * da * sum(qa).
// x: any float [M, K]; the result float32 [M, N]. One plane laid out in blocks of
// sixteen rows (4-dimensional codes) is multiplied by blocks_mm.cpp instead, which
// also takes centred codes without an offset.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

// Inlined whatever the compiler's estimate: GCC had left step_codes as a call, one a
// step, in the inner loops (29 call sites in the built library).
#define SLUICE_INLINE inline __attribute__((always_inline))

constexpr int64_t kGroup = 32;
constexpr int kMaxPlanes = 2;
constexpr int kTile = 8;  // activation rows per pass over a weight row

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define SLUICE_WIDE 1
constexpr int64_t kStep = 2;  // groups per dot product
#else
#define SLUICE_WIDE 0
constexpr int64_t kStep = 1;
#endif

#if SLUICE_WIDE
using Ints = __m512i;
using Floats = __m512;
inline Floats zero_floats() { return _mm512_setzero_ps(); }
inline Ints load_ints(const void* p) { return _mm512_loadu_si512(p); }
inline Floats load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline Floats dot(Ints u, Ints s) {
  return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s));
}
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline float total(Floats v) { return _mm512_reduce_add_ps(v); }
// Two groups' scales, each over its group's 8 lanes of int32 sums.
inline Floats pair(float first, float second) {
  return _mm512_insertf32x8(_mm512_set1_ps(first), _mm256_set1_ps(second), 1);
}
// 32 bytes of nibbles (two groups) as 64 codes: group g's 32, then g + 1's.
SLUICE_INLINE Ints nibble_codes(const uint8_t* bytes) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(packed, low);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
}
#else
using Ints = __m256i;
using Floats = __m256;
inline Floats zero_floats() { return _mm256_setzero_ps(); }
inline Ints load_ints(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Floats load_floats(const float* p) { return _mm256_loadu_ps(p); }
inline __m256i dot_ints(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  // Pairs of u8 x s8 to int16, then pairs of those to int32. A pair of 4-bit codes is
  // at most 2 x 15 x 128 in size: maddubs never saturates.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
inline Floats dot(Ints u, Ints s) { return _mm256_cvtepi32_ps(dot_ints(u, s)); }
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline float total(Floats v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}
inline Floats pair(float first, float) { return _mm256_set1_ps(first); }
SLUICE_INLINE Ints nibble_codes(const uint8_t* bytes) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}
#endif

// 8-bit codes without VNNI: maddubs would saturate (2 x 255 x 127 > 32767). As signed
// bytes s = code - 128, maddubs(|s|, sign(q, s)) is s . q, at most 2 x 128 x 127 in a
// pair (llama.cpp's way), and the weight row's offset gives back 128 x scale x sum(q).
// |s| and s are a weight step's, made once for every activation row it meets: a row
// costs sign, maddubs, madd and a conversion, where the codes' two nibbles cost ten.
#if !SLUICE_WIDE && !defined(__AVXVNNI__)
#define SLUICE_SIGNED_BYTES 1
#else
#define SLUICE_SIGNED_BYTES 0
#endif

// A step's weight codes ready for dot products with activation rows.
struct StepCodes {
  Ints u;     // unsigned: the codes, or |s| (signed bytes)
  Ints sign;  // s (signed bytes only)
};

template <bool Bytes>
SLUICE_INLINE StepCodes ready(Ints u) {
#if SLUICE_SIGNED_BYTES
  if constexpr (Bytes) {
    const __m256i s = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
    return {_mm256_abs_epi8(s), s};
  }
#endif
  return {u, u};
}

template <bool Bytes>
SLUICE_INLINE Floats dot_step(const StepCodes& c, Ints q) {
#if SLUICE_SIGNED_BYTES
  if constexpr (Bytes) return dot(c.u, _mm256_sign_epi8(q, c.sign));
#endif
  return dot(c.u, q);
}

// fp16 -> float32.
inline void widen(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = _cvtsh_ss(in[i]);
}

// Activations laid out step-major, so that the rows of a tile sit next to each other:
// for each step of kStep groups and each row, the step's codes (32 x kStep bytes), its
// groups' scales da spread over their 8 lanes each, and its groups' sums da * sum(qa)
// spread the same way, an eighth to a lane (the lanes add up to the sum). A last step
// missing a group (odd group counts, wide kernel) is zero there.
struct Activations {
  int64_t rows = 0, steps = 0;
  std::vector<int8_t> codes;  // [steps, M, 32 * kStep]
  std::vector<float> scales;  // [steps, M, 8 * kStep]
  std::vector<float> sums;    // [steps, M, 8 * kStep]
};

constexpr int64_t kLanes = 8 * kStep;
constexpr int64_t kStepCodes = kGroup * kStep;

// Each group of 32 as int8 codes and a scale (sluice::quantise_group).
Activations quantise(const at::Tensor& x) {
  const int64_t rows = x.size(0), groups = x.size(1) / kGroup;
  Activations a;
  a.rows = rows;
  a.steps = (groups + kStep - 1) / kStep;
  a.codes.assign(a.steps * rows * kStepCodes, 0);
  a.scales.assign(a.steps * rows * kLanes, 0.f);
  a.sums.assign(a.steps * rows * kLanes, 0.f);
  sluice::for_each_group(x, [&](int64_t m, int64_t g, const auto* in) {
    const int64_t at = (g / kStep * rows + m);
    int32_t sum = 0;
    const float d = sluice::quantise_group(in, a.codes.data() + at * kStepCodes + (g % kStep) * kGroup, sum);
    float* scale = a.scales.data() + at * kLanes + (g % kStep) * 8;
    float* spread = a.sums.data() + at * kLanes + (g % kStep) * 8;
    std::fill(scale, scale + 8, d);
    std::fill(spread, spread + 8, d * static_cast<float>(sum) / 8.f);
  });
  return a;
}

// One weight row's codes, scales and offset: the wide kernel reads the fp16 scales and
// offset themselves, sixteen groups at a time; the narrow one their float32 copies.
struct WeightRow {
  const uint8_t* codes[kMaxPlanes];
  const uint16_t* half_scales[kMaxPlanes];  // [G] each
  const uint16_t* half_offset;              // [G]
  const float* scales;                      // [P, G]
  const float* offset;                      // [G]
  int64_t groups;
};

#if SLUICE_WIDE
// For step j of a block of eight: group 2j's value over lanes 0-7, 2j + 1's over 8-15.
alignas(64) constexpr int32_t kPairIndex[8][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
    {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
    {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15},
};

// Sixteen groups' fp16 values from group g0 as float32 (zeros past the row's end).
inline __m512 sixteen(const uint16_t* values, int64_t g0, int64_t groups) {
  const int64_t left = std::min<int64_t>(16, groups - g0);
  const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, values + g0));
}
#endif

// Codes of step `step` of a plane (a last step missing its second group: that group's
// codes read as zeros, never past the row).
template <bool Bytes>
SLUICE_INLINE Ints step_codes(const uint8_t* codes, int64_t step, bool partial) {
  constexpr int64_t bytes = Bytes ? kStepCodes : kStepCodes / 2;
  const uint8_t* at = codes + step * bytes;
  if (partial) {
    alignas(64) uint8_t padded[bytes] = {};
    std::copy(at, at + bytes / kStep, padded);
    at = padded;
    if constexpr (Bytes) return load_ints(at);
    return nibble_codes(at);
  }
  if constexpr (Bytes) return load_ints(at);
  return nibble_codes(at);
}

// out[m0 + t, n] for t < T: the weight row against T activation rows; Planes planes of
// 4-bit codes, or one of 8-bit codes (Bytes).
template <int T, bool Bytes, int Planes>
void tile(const WeightRow& w, const Activations& a, int64_t m0, int64_t n, int64_t n_total,
          float* out) {
  Floats acc[T];
  for (int t = 0; t < T; ++t) acc[t] = zero_floats();
  const int64_t stride = a.rows;  // rows per step in the activations
#if SLUICE_WIDE
  __m512 scale_block[Planes], offset_block = _mm512_setzero_ps();
#endif
  for (int64_t step = 0; step < a.steps; ++step) {
    const int64_t g = step * kStep;
    const bool partial = g + kStep > w.groups;
    StepCodes u[Planes];
    Floats scale[Planes];
#if SLUICE_WIDE
    if ((step & 7) == 0) {
      for (int p = 0; p < Planes; ++p) scale_block[p] = sixteen(w.half_scales[p], g, w.groups);
      offset_block = sixteen(w.half_offset, g, w.groups);
    }
    const __m512i lanes = _mm512_load_si512(kPairIndex[step & 7]);
#pragma GCC unroll 2
    for (int p = 0; p < Planes; ++p) {
      u[p] = ready<Bytes>(step_codes<Bytes>(w.codes[p], step, partial));
      scale[p] = _mm512_permutexvar_ps(lanes, scale_block[p]);
    }
    const Floats offset = _mm512_permutexvar_ps(lanes, offset_block);
#else
#pragma GCC unroll 2
    for (int p = 0; p < Planes; ++p) {
      u[p] = ready<Bytes>(step_codes<Bytes>(w.codes[p], step, partial));
      scale[p] = pair(w.scales[p * w.groups + g], 0.f);
    }
    const Floats offset = pair(w.offset[g], 0.f);
#endif
    const int64_t first = step * stride + m0;
    const int8_t* x = a.codes.data() + first * kStepCodes;
    const float* da = a.scales.data() + first * kLanes;
    const float* sums = a.sums.data() + first * kLanes;
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const Ints q = load_ints(x + t * kStepCodes);
      const Floats d = load_floats(da + t * kLanes);
#pragma GCC unroll 2
      for (int p = 0; p < Planes; ++p) {
        const Floats dots = dot_step<Bytes>(u[p], q);
        acc[t] = fmadd(mul(dots, d), scale[p], acc[t]);
      }
      acc[t] = fmadd(offset, load_floats(sums + t * kLanes), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[(m0 + t) * n_total + n] = total(acc[t]);
}

// One activation row (a one-row decode step) against kRowsAtOnce weight rows from n0:
// their accumulators are independent, so the dot products of one row do not wait on
// each other's latency, and the activation's step is loaded once for all of them.
constexpr int kRowsAtOnce = 4;

// How far ahead of the rows being read their successors are fetched, in blocks of
// kRowsAtOnce rows: the rows of a block are read side by side, a few cache lines each,
// a pattern the hardware's stream prefetcher does not follow. Fetched into L2 (T1):
// on a Zen 4, Gemma 3's 262144 x 640 Q8_0 head at one row took 20 ms on two threads
// with no prefetch, 12-14 ms with T0 ones, 7 ms with these.
constexpr int64_t kBlocksAhead = 8;

template <bool Bytes, int Planes>
void single_row(const WeightRow* w, const Activations& a, int64_t n0, float* out) {
  constexpr int64_t kCodeBytes = Bytes ? kStepCodes : kStepCodes / 2;  // a step's, in a row
  const int64_t ahead = kBlocksAhead * kRowsAtOnce * w[0].groups * (Bytes ? kGroup : kGroup / 2);
  Floats acc[kRowsAtOnce];
  for (int r = 0; r < kRowsAtOnce; ++r) acc[r] = zero_floats();
#if SLUICE_WIDE
  __m512 scale_block[kRowsAtOnce][Planes], offset_block[kRowsAtOnce];
#endif
  for (int64_t step = 0; step < a.steps; ++step) {
    const int64_t g = step * kStep;
    const bool partial = g + kStep > w[0].groups;
    const Ints q = load_ints(a.codes.data() + step * kStepCodes);
    const Floats d = load_floats(a.scales.data() + step * kLanes);
    const Floats sums = load_floats(a.sums.data() + step * kLanes);
#if SLUICE_WIDE
    const __m512i lanes = _mm512_load_si512(kPairIndex[step & 7]);
#endif
#pragma GCC unroll 4
    for (int r = 0; r < kRowsAtOnce; ++r) {
      Floats offset;
#if SLUICE_WIDE
      if ((step & 7) == 0) {
        for (int p = 0; p < Planes; ++p) scale_block[r][p] = sixteen(w[r].half_scales[p], g, w[r].groups);
        offset_block[r] = sixteen(w[r].half_offset, g, w[r].groups);
      }
      offset = _mm512_permutexvar_ps(lanes, offset_block[r]);
#else
      offset = pair(w[r].offset[g], 0.f);
#endif
#pragma GCC unroll 2
      for (int p = 0; p < Planes; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(w[r].codes[p] + step * kCodeBytes + ahead),
                     _MM_HINT_T1);
        const StepCodes u = ready<Bytes>(step_codes<Bytes>(w[r].codes[p], step, partial));
#if SLUICE_WIDE
        const Floats scale = _mm512_permutexvar_ps(lanes, scale_block[r][p]);
#else
        const Floats scale = pair(w[r].scales[p * w[r].groups + g], 0.f);
#endif
        const Floats dots = dot_step<Bytes>(u, q);
        acc[r] = fmadd(mul(dots, d), scale, acc[r]);
      }
      acc[r] = fmadd(offset, sums, acc[r]);
    }
  }
  for (int r = 0; r < kRowsAtOnce; ++r) out[n0 + r] = total(acc[r]);
}

// Every activation row against weight row n: tiles of kTile rows, then the rest.
template <bool Bytes, int Planes>
void weight_row(const WeightRow& w, const Activations& a, int64_t n, int64_t n_total,
                float* out) {
  const int64_t rows = a.rows;
  int64_t m = 0;
  for (; m + kTile <= rows; m += kTile) tile<kTile, Bytes, Planes>(w, a, m, n, n_total, out);
  switch (rows - m) {
    case 1: return tile<1, Bytes, Planes>(w, a, m, n, n_total, out);
    case 2: return tile<2, Bytes, Planes>(w, a, m, n, n_total, out);
    case 3: return tile<3, Bytes, Planes>(w, a, m, n, n_total, out);
    case 4: return tile<4, Bytes, Planes>(w, a, m, n, n_total, out);
    case 5: return tile<5, Bytes, Planes>(w, a, m, n, n_total, out);
    case 6: return tile<6, Bytes, Planes>(w, a, m, n, n_total, out);
    case 7: return tile<7, Bytes, Planes>(w, a, m, n, n_total, out);
    default: return;
  }
}

}  // namespace

at::Tensor sluice::planes_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                             const std::optional<at::Tensor>& offset_in, bool five_bit) {
  // One plane in blocks of sixteen rows (blocks_mm.cpp).
  if (codes.dim() == 4) return sluice::blocks_mm(x_in, codes, scales, offset_in, five_bit);
  TORCH_CHECK(!five_bit, "planes_mm: only codes in blocks are taken as five-bit");
  TORCH_CHECK(offset_in.has_value(), "planes_mm: row-major codes need an offset");
  const at::Tensor& offset = *offset_in;
  TORCH_CHECK(x_in.dim() == 2, "planes_mm: x must be [M, K]");
  const int64_t rows = x_in.size(0), k = x_in.size(1), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0, "planes_mm: K must divide by 32");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte, "planes_mm: codes [P, N, K/2 or K] uint8");
  const int64_t planes = codes.size(0), n_total = codes.size(1);
  const bool bytes = codes.size(2) == k;
  TORCH_CHECK(bytes ? planes == 1 : (codes.size(2) * 2 == k && planes >= 1 && planes <= kMaxPlanes),
              "planes_mm: codes must be [1, N, K] (8-bit) or [1 or 2, N, K/2] (4-bit)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.sizes() == at::IntArrayRef({planes, n_total, groups}),
              "planes_mm: scales [P, N, K/32] float16");
  TORCH_CHECK(offset.scalar_type() == at::kHalf && offset.sizes() == at::IntArrayRef({n_total, groups}),
              "planes_mm: offset [N, K/32] float16");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && offset.is_contiguous(),
              "planes_mm: weights must be contiguous");
  const at::Tensor x = sluice::quantisable(x_in);
  at::Tensor out = at::empty({rows, n_total}, x.options().dtype(at::kFloat));
  if (rows == 0 || n_total == 0) return out;
  const Activations a = quantise(x);
  const uint8_t* code_base = codes.data_ptr<uint8_t>();
  const auto* scale_base = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* offset_base = reinterpret_cast<const uint16_t*>(offset.data_ptr<at::Half>());
  const int64_t row_bytes = codes.size(2);
  float* result = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(16, n_total / (4 * at::get_num_threads()));
  at::parallel_for(0, n_total, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row_scales(kRowsAtOnce * planes * groups), row_offset(kRowsAtOnce * groups);
    WeightRow ws[kRowsAtOnce];
    // Weight row n's pointers into ws[slot] (and, narrow, its scales widened to float32).
    auto point = [&](int slot, int64_t n) {
      WeightRow& w = ws[slot];
      w = WeightRow{{nullptr, nullptr}, {nullptr, nullptr}, nullptr,
                    row_scales.data() + slot * planes * groups, row_offset.data() + slot * groups, groups};
      for (int64_t p = 0; p < planes; ++p) {
        w.codes[p] = code_base + (p * n_total + n) * row_bytes;
        w.half_scales[p] = scale_base + (p * n_total + n) * groups;
      }
      w.half_offset = offset_base + n * groups;
      if (!SLUICE_WIDE) {
        for (int64_t p = 0; p < planes; ++p)
          widen(w.half_scales[p], row_scales.data() + (slot * planes + p) * groups, groups);
        widen(w.half_offset, row_offset.data() + slot * groups, groups);
        if (SLUICE_SIGNED_BYTES && bytes) {
          // The codes are read as code - 128 (ready): their 128 x scale moves here.
          float* shifted = row_offset.data() + slot * groups;
          const float* scale = row_scales.data() + slot * planes * groups;
          for (int64_t g = 0; g < groups; ++g) shifted[g] += 128.f * scale[g];
        }
      }
    };
    int64_t n = begin;
    if (rows == 1) {
      for (; n + kRowsAtOnce <= end; n += kRowsAtOnce) {
        for (int r = 0; r < kRowsAtOnce; ++r) point(r, n + r);
        if (bytes) {
          single_row<true, 1>(ws, a, n, result);
        } else if (planes == 1) {
          single_row<false, 1>(ws, a, n, result);
        } else {
          single_row<false, 2>(ws, a, n, result);
        }
      }
    }
    for (; n < end; ++n) {
      point(0, n);
      const WeightRow& w = ws[0];
      if (bytes) {
        weight_row<true, 1>(w, a, n, n_total, result);
      } else if (planes == 1) {
        weight_row<false, 1>(w, a, n, n_total, result);
      } else {
        weight_row<false, 2>(w, a, n, n_total, result);
      }
    }
  });
  return out;
}

TORCH_LIBRARY(sluice_kernels, m) {
  m.def("planes_mm(Tensor x, Tensor codes, Tensor scales, Tensor? offset, bool five_bit=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice_kernels, CPU, m) { m.impl("planes_mm", &sluice::planes_mm); }
