// A GGUF linear's one plane of codes (8-bit, or 4-bit) laid out sixteen weight rows
// side by side (eight with AVX2), times activations quantised to int8 per group of 32:
// the layout integer dot products multiply best once activation rows share a weight.
// Registered as torch.ops.sluice_kernels.blocks_mm; engine/plane_kernels.py lays out
// its weights, in blocks of block_rows() rows.
//
// The weight is planes_mm.cpp's one plane, w = code * scale + offset per group of 32
// inputs, re-laid as blocks of R rows (R = 16 with AVX-512 VNNI, 8 with AVX2):
//   codes uint8 [N/R, K/4, R, 4]: for inputs 4j..4j+3, each of the block's rows' four
//     codes, row after row (one vector); 4-bit codes [N/R, K/8, R, 4], byte i of a row
//     holding input 8j + i in its low nibble and 8j + 4 + i in its high one;
//   scales, offset fp16 [N/R, K/32, R]: a group's R rows' values, side by side.
// One integer dot product (vpdpbusd; AVX2's maddubs without VNNI) then adds four inputs
// of R rows against one activation row's four codes broadcast: a group is eight of them
// into one int32 vector, whose R lanes are the R rows' dot products, scaled in one
// multiply-add. planes_mm's layout instead takes a weight row at a time and its lanes
// are parts of one row's sum, each scaled on its own: at 16 activation rows Gemma 3's
// 8-bit head there was slower than its dense bfloat16 copy, and with AVX2 alone
// (emulated on a Zen 5) a 3072 x 576 Q4_1 linear at 512 rows took 16.6 ms in rows,
// 8.4 ms as dense float32 and 4.9 ms in blocks. Where the CPU has AMX and Linux grants
// its tile state, sixteen activation rows or more go through AMX's tile dot product
// instead (amx_blocks below), whose weight tile is this layout as it is, with the same
// results. On an Intel Xeon with AMX that made Gemma 3's 262144 x 640 head 10-20 %
// faster than VNNI at 16 to 64 rows, and 4-bit shapes about even; below 16 rows the
// padded tile cost as much as VNNI's 16 rows. x: any float [M, K]; the result float32
// [M, N].
//
// Without an offset, the codes are centred: w = (code - C) * scale, C = 128 for 8-bit
// codes (what Q8_0 and re-quantised Q6_K hold), 16 for five-bit ones (Q5_0's, held as
// bytes in 0..31) and 8 for 4-bit ones (Q4_0). Each
// group's integer sums then start at -C * sum(activation codes), which saves the
// offset's multiply-add: a group's scaling takes three float operations instead of
// four, and the 8-bit pass is bound by its vector operations (docs/benchmarks.md,
// "centred blocks").
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

// What a block's codes are: 4-bit (two inputs a byte), 8-bit, or bytes known to lie in
// 0..31 (five-bit: a Q5_0's), whose products AVX2 alone can sum in int16 unsigned.
enum Codes { kFour, kEight, kFive };
#define SLUICE_INLINE inline __attribute__((always_inline))

// The vector the blocks are as wide as: sixteen rows of int32 lanes with AVX-512 VNNI,
// eight with AVX2 (AVX-VNNI's dot product where the CPU has it, AVX2's maddubs where
// it does not: an AMD Zen 2 or Zen 3).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define SLUICE_BLOCKS 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SLUICE_BLOCKS 8
#else
#define SLUICE_BLOCKS 0
#endif

#if SLUICE_BLOCKS
constexpr int64_t kBlockRows = SLUICE_BLOCKS;

#if SLUICE_BLOCKS == 16
// From how many activation rows AMX multiplies the blocks, where it can: one tile's.
constexpr int64_t kAmxRows = 16;
// Three rows or more: four activation rows a pass against two blocks at once. Each
// step then loads four broadcast codes and two weight vectors for eight dot products
// (eight rows against one block: nine loads for eight). On an Intel Xeon with AMX
// turned off, warm caches, 64 rows: 7-14 % faster on three layer shapes of the default
// models, 9 % on Gemma 3's head (18 % at 16 rows); four rows x three blocks and five
// rows x two measured no faster (docs/benchmarks.md, "four rows against two blocks").
constexpr int kRowsPerPass = 4;
constexpr int kBlocksPerPass = 2;
constexpr int kOddBlockRows = 8;  // activation rows a pass against a last odd block
// No prefetch: Gemma 3's head at one row measured 4.0 ms with it, 3.7 without (Zen 5).
constexpr int kPrefetchRows = 0;
#define SLUICE_UNROLL_STEPS _Pragma("GCC unroll 8")
constexpr bool kSignedBytes = false;

using Ints = __m512i;
using Floats = __m512;
inline Ints load_codes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline Ints splat_int(int32_t v) { return _mm512_set1_epi32(v); }
inline Floats splat(float v) { return _mm512_set1_ps(v); }
inline Floats zero_floats() { return _mm512_setzero_ps(); }
inline Floats to_floats(Ints v) { return _mm512_cvtepi32_ps(v); }
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline void store(float* p, Floats v) { _mm512_storeu_ps(p, v); }
inline Floats load_halves(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Ints low_nibbles(Ints v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline Ints high_nibbles(Ints v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline Ints dot_add(Ints sum, Ints w, Ints q) { return _mm512_dpbusd_epi32(sum, w, q); }
#else
// Eight rows: a 256-bit vector of int32 lanes; sixteen registers. Three rows or more:
// four activation rows a pass against one block. With AVX2 alone (emulated on a Zen 5,
// one thread, warm, 256 rows) 3072 x 576 Q4_1 ran at 131-134 GMAC/s so, 117 at two rows
// against two blocks, 126 at three against one, 129-134 at six; 2048 x 640 Q8_0 at 89-90,
// against 78, 85 and 87.
constexpr int kRowsPerPass = 4;
constexpr int kBlocksPerPass = 1;
constexpr int kOddBlockRows = 4;
// Eight blocks ahead at one and two rows: with AVX2 alone (emulated on a Zen 5), a
// 1536 x 640 Q8_0 linear at one row took 53 us without, 45 with (the row layout's 44).
constexpr int kPrefetchRows = 2;
// A group's steps two at a time: unrolled whole, GCC issued every step's maddubs first
// and spilled their products to the stack (4-bit: 117-121 GMAC/s on one thread of the
// Zen 5 so, 106 unrolled whole, 3072 x 576 Q4_1 at 256 rows, warm, two rows a pass).
#define SLUICE_UNROLL_STEPS _Pragma("GCC unroll 2")
#if defined(__AVXVNNI__)
constexpr bool kSignedBytes = false;
#else
// 8-bit codes: maddubs would saturate (2 x 255 x 127 > 32767), so they are read as
// signed bytes s = code - 128 and multiplied as |s| by sign(q, s), at most 2 x 128 x
// 127 a pair (llama.cpp's way); a group's start then holds (128 - C) x sum(q).
constexpr bool kSignedBytes = true;
#endif

using Ints = __m256i;
using Floats = __m256;
inline Ints load_codes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Ints splat_int(int32_t v) { return _mm256_set1_epi32(v); }
inline Floats splat(float v) { return _mm256_set1_ps(v); }
inline Floats zero_floats() { return _mm256_setzero_ps(); }
inline Floats to_floats(Ints v) { return _mm256_cvtepi32_ps(v); }
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline void store(float* p, Floats v) { _mm256_storeu_ps(p, v); }
inline Floats load_halves(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Ints low_nibbles(Ints v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline Ints high_nibbles(Ints v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
#if defined(__AVXVNNI__)
inline Ints dot_add(Ints sum, Ints w, Ints q) { return _mm256_dpbusd_avx_epi32(sum, w, q); }
#endif
#endif

// One activation row's integer dot products against one block for a group: int32 lanes,
// one a weight row, plus the group's start (given to begin or to total, whichever the
// form adds it at). A fused dot product (VNNI) takes every form's codes as they are.
// Without one (AVX2 alone), maddubs's int16 pairs are summed before they are widened
// as far as they cannot overflow: 4-bit codes' (at most 2 x 15 x 127) over the whole
// group, eight pairs of a lane at most 30480; five-bit codes' (2 x 31 x 127) over half
// a group, four at most 31496; 8-bit codes', as signed bytes, a step at a time.
#if SLUICE_BLOCKS == 16 || defined(__AVXVNNI__)
// Five-bit codes then multiply as 8-bit ones (the same code, their start apart).
constexpr bool kFiveApart = false;
template <Codes Form>
struct GroupDots {
  Ints sum;
  void begin(int32_t start) { sum = splat_int(start); }
  void add(Ints w, Ints q) { sum = dot_add(sum, w, q); }
  void widen() {}
  Ints total(int32_t) const { return sum; }
};
// A step's weight codes as the dot product takes them: unsigned, as they are.
struct ByteStep {
  Ints magnitude, sign;
  explicit ByteStep(Ints w) : magnitude(w), sign(w) {}
};
template <Codes Form>
SLUICE_INLINE void add_bytes(GroupDots<Form>& dots, const ByteStep& step, Ints q) {
  dots.add(step.magnitude, q);
}
#else
constexpr bool kFiveApart = true;
inline Ints widened_pairs(Ints pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
template <Codes Form>
struct GroupDots;
template <>
struct GroupDots<kFour> {  // pairs summed as int16, widened by total
  Ints pairs;
  void begin(int32_t) { pairs = _mm256_setzero_si256(); }
  void add(Ints w, Ints q) { pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w, q)); }
  void widen() {}
  Ints total(int32_t start) const { return _mm256_add_epi32(splat_int(start), widened_pairs(pairs)); }
};
template <>
struct GroupDots<kFive> {  // pairs summed as int16, widened at each half of the group
  Ints pairs, sum;
  void begin(int32_t start) {
    pairs = _mm256_setzero_si256();
    sum = splat_int(start);
  }
  void add(Ints w, Ints q) { pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w, q)); }
  void widen() {
    sum = _mm256_add_epi32(sum, widened_pairs(pairs));
    pairs = _mm256_setzero_si256();
  }
  Ints total(int32_t) const { return sum; }
};
template <>
struct GroupDots<kEight> {  // signed bytes: widened a step at a time
  Ints sum;
  void begin(int32_t start) { sum = splat_int(start); }
  void add(Ints magnitude, Ints signed_q) {
    sum = _mm256_add_epi32(sum, widened_pairs(_mm256_maddubs_epi16(magnitude, signed_q)));
  }
  void widen() {}
  Ints total(int32_t) const { return sum; }
};
// A step's 8-bit codes as signed bytes s = code - 128: |s| and s, made once for every
// activation row that meets them.
struct ByteStep {
  Ints magnitude, sign;
  explicit ByteStep(Ints w) {
    sign = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    magnitude = _mm256_abs_epi8(sign);
  }
};
template <Codes Form>
SLUICE_INLINE void add_bytes(GroupDots<Form>& dots, const ByteStep& step, Ints q) {
  dots.add(step.magnitude, _mm256_sign_epi8(q, step.sign));
}
#endif

// Activations [M, K] as int8 codes per group of 32, with each group's scale da and
// da * sum(codes) (for the offset term), and its integer sums' start, bias * sum(codes).
struct Quantised {
  int64_t k = 0, groups = 0;
  std::vector<int8_t> codes;   // [M, K]
  std::vector<float> scale;    // [M, G]
  std::vector<float> sum;      // [M, G]
  std::vector<int32_t> start;  // [M, G]
};

// `padded_rows` >= rows: zero codes after the last row, for AMX's whole tiles.
// `bias`: -C for centred weight codes (their sums start at -C x sum(q)), 0 for codes
// with an offset; 128 more for 8-bit codes read as signed bytes.
Quantised quantise(const at::Tensor& x, int64_t padded_rows, int32_t bias) {
  Quantised a;
  const int64_t k = a.k = x.size(1);
  a.groups = k / kGroup;
  a.codes.assign(padded_rows * k, 0);
  a.scale.assign(padded_rows * a.groups, 0.f);
  a.sum.assign(padded_rows * a.groups, 0.f);
  a.start.assign(padded_rows * a.groups, 0);
  sluice::for_each_group(x, [&](int64_t m, int64_t g, const auto* in) {
    int32_t sum = 0;
    const float d = sluice::quantise_group(in, a.codes.data() + m * k + g * kGroup, sum);
    a.scale[m * a.groups + g] = d;
    a.sum[m * a.groups + g] = d * static_cast<float>(sum);
    a.start[m * a.groups + g] = bias * sum;
  });
  return a;
}

inline Ints four_codes(const int8_t* at) {
  int32_t word;
  std::memcpy(&word, at, sizeof(word));
  return splat_int(word);
}

// Activation rows m0..m0+T-1 against B consecutive blocks from `block`: B * T
// independent accumulators, so that successive dot products do not wait on each other.
// Form kFour: a vector holds eight inputs of the block's rows (four otherwise). Centred:
// no offset (the sums start at a.start instead).
// The codes kAhead blocks on are fetched into L2 while a tile of up to kPrefetchRows
// activation rows reads its own (set per vector width above).
constexpr int64_t kAhead = 8;

template <int T, int B, Codes Form, bool Centred>
void tile(const uint8_t* codes, const uint16_t* scales, const uint16_t* offset, int64_t block,
          const Quantised& a, int64_t m0, int64_t n_total, float* out) {
  const int64_t groups = a.groups, k = a.k;
  constexpr bool Nibbles = Form == kFour;
  constexpr int64_t kInputsPerVector = Nibbles ? 8 : 4;
  constexpr int64_t kVectorBytes = kBlockRows * 4;
  const int64_t block_codes = k / kInputsPerVector * kVectorBytes, block_values = groups * kBlockRows;
  Floats acc[B][T];
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) acc[b][t] = zero_floats();
  for (int64_t g = 0; g < groups; ++g) {
    GroupDots<Form> dots[B][T];
    int32_t start[T];
    for (int t = 0; t < T; ++t) {
      start[t] = (Centred || (kSignedBytes && Form == kEight)) ? a.start[(m0 + t) * groups + g] : 0;
      for (int b = 0; b < B; ++b) dots[b][t].begin(start[t]);
    }
SLUICE_UNROLL_STEPS
    for (int64_t j = 0; j < kGroup / kInputsPerVector; ++j) {
      const int64_t input = g * kGroup + kInputsPerVector * j;
      Ints q[T], q_high[T];
      for (int t = 0; t < T; ++t) {
        q[t] = four_codes(a.codes.data() + (m0 + t) * k + input);
        if constexpr (Nibbles) q_high[t] = four_codes(a.codes.data() + (m0 + t) * k + input + 4);
      }
      for (int b = 0; b < B; ++b) {
        const uint8_t* at = codes + (block + b) * block_codes + input / kInputsPerVector * kVectorBytes;
        if constexpr (T <= kPrefetchRows) {
          if (j % (64 / kVectorBytes) == 0) _mm_prefetch(reinterpret_cast<const char*>(at + kAhead * block_codes), _MM_HINT_T1);
        }
        const Ints w = load_codes(at);
        if constexpr (Nibbles) {
          const Ints w_low = low_nibbles(w), w_high = high_nibbles(w);
          for (int t = 0; t < T; ++t) {
            dots[b][t].add(w_low, q[t]);
            dots[b][t].add(w_high, q_high[t]);
          }
        } else if constexpr (Form == kFive) {
          for (int t = 0; t < T; ++t) dots[b][t].add(w, q[t]);
        } else {
          const ByteStep step(w);
          for (int t = 0; t < T; ++t) add_bytes(dots[b][t], step, q[t]);
        }
      }
      if constexpr (Form == kFive) {
        if (j % 4 == 3)
          for (int b = 0; b < B; ++b)
            for (int t = 0; t < T; ++t) dots[b][t].widen();
      }
    }
    for (int b = 0; b < B; ++b) {
      const int64_t at = (block + b) * block_values + g * kBlockRows;
      const Floats scale = load_halves(scales + at);
      for (int t = 0; t < T; ++t) {
        const int64_t row = (m0 + t) * groups + g;
        const Floats scaled = mul(scale, splat(a.scale[row]));
        acc[b][t] = fmadd(to_floats(dots[b][t].total(start[t])), scaled, acc[b][t]);
      }
      if constexpr (!Centred) {
        const Floats off = load_halves(offset + at);
        for (int t = 0; t < T; ++t) acc[b][t] = fmadd(off, splat(a.sum[(m0 + t) * groups + g]), acc[b][t]);
      }
    }
  }
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) store(out + (m0 + t) * n_total + (block + b) * kBlockRows, acc[b][t]);
}
// Activation rows [m, rows) against the B blocks from `block`: T rows a pass while
// they last, then the rest in one pass of fewer.
template <int T, int B, Codes Form, bool Centred>
void passes(const uint8_t* codes, const uint16_t* scales, const uint16_t* offset, int64_t block,
            const Quantised& a, int64_t m, int64_t rows, int64_t n_total, float* out) {
  for (; m + T <= rows; m += T) tile<T, B, Form, Centred>(codes, scales, offset, block, a, m, n_total, out);
  if constexpr (T > 1) {
    if (m < rows) passes<T - 1, B, Form, Centred>(codes, scales, offset, block, a, m, rows, n_total, out);
  }
}

// Every activation row against blocks [begin, end): one or two rows take four or two
// blocks at once, for independent accumulators; more take kBlocksPerPass blocks at
// once in passes of kRowsPerPass rows (each block's codes, K * R bytes or half that,
// stay in L1 for the passes after the first); a last odd block, kOddBlockRows a pass.
template <Codes Form, bool Centred>
void blocks(const uint8_t* codes, const uint16_t* scales, const uint16_t* offset, int64_t begin,
            int64_t end, const Quantised& a, int64_t rows, int64_t n_total, float* out) {
  int64_t block = begin;
  if (rows == 1) {
    for (; block + 4 <= end; block += 4) tile<1, 4, Form, Centred>(codes, scales, offset, block, a, 0, n_total, out);
  } else if (rows == 2) {
    for (; block + 2 <= end; block += 2) tile<2, 2, Form, Centred>(codes, scales, offset, block, a, 0, n_total, out);
  } else {
    for (; block + kBlocksPerPass <= end; block += kBlocksPerPass)
      passes<kRowsPerPass, kBlocksPerPass, Form, Centred>(codes, scales, offset, block, a, 0, rows, n_total, out);
  }
  for (; block < end; ++block) passes<kOddBlockRows, 1, Form, Centred>(codes, scales, offset, block, a, 0, rows, n_total, out);
}

#if SLUICE_BLOCKS == 16 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SLUICE_AMX 1

// Linux gives a process AMX's tile registers only when asked (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, 18); a kernel or hypervisor without
// AMX support refuses, and the VNNI path serves.
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two groups in flight: tmm0 and tmm1 hold a group's int32 sums (sixteen activation
// rows x the block's sixteen weight rows), tmm2 and tmm3 the activation rows' codes for
// it (16 x 32 bytes), tmm4 and tmm5 the block's codes for it (8 rows of four inputs x
// 16 weight rows).
TileConfig tile_config() {
  TileConfig config;
  for (int t : {0, 1}) config.rows[t] = 16, config.colsb[t] = 64;
  for (int t : {2, 3}) config.rows[t] = 16, config.colsb[t] = kGroup;
  for (int t : {4, 5}) config.rows[t] = kGroup / 4, config.colsb[t] = 64;
  return config;
}

// Held in a static: GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, so a
// local configuration's other stores are dropped as dead and ldtilecfg faults.
void configure_tiles() {
  static const TileConfig config = tile_config();
  _tile_loadconfig(&config);
}

// Group g's weight codes as bytes: 8-bit codes are the tile as they are; 4-bit ones are
// widened into `widened` (their low nibbles are inputs 8j..8j+3, the high 8j+4..8j+7).
template <bool Nibbles>
inline const uint8_t* weight_tile(const uint8_t* block_codes, int64_t g, uint8_t* widened) {
  constexpr int64_t kInputsPerVector = Nibbles ? 8 : 4;
  const uint8_t* w = block_codes + g * kGroup / kInputsPerVector * 64;
  if constexpr (!Nibbles) return w;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < kGroup / 8; ++j) {
    const __m512i v = _mm512_loadu_si512(w + j * 64);
    _mm512_store_si512(widened + 2 * j * 64, _mm512_and_si512(v, low));
    _mm512_store_si512(widened + (2 * j + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
  return widened;
}

// Group g's stored sums scaled into acc, as tile() scales its lanes (the same
// operations in the same order, and centred sums given the same start, so results
// match the VNNI path's).
template <bool Centred>
inline void scale_sums(const int32_t* sums, const uint16_t* scales, const uint16_t* offset, int64_t at,
                       const float* a_scale, const float* a_sum, const int32_t* a_start, int64_t groups,
                       __m512* acc) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + at)));
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    __m512i integers = _mm512_load_si512(sums + r * 16);
    if constexpr (Centred) integers = _mm512_add_epi32(integers, _mm512_set1_epi32(a_start[r * groups]));
    const __m512 dots = _mm512_cvtepi32_ps(integers);
    acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(scale, _mm512_set1_ps(a_scale[r * groups])), acc[r]);
  }
  if constexpr (!Centred) {
    const __m512 off = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + at)));
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(a_sum[r * groups]), acc[r]);
  }
}

// Blocks [begin, end) against every activation row (padded to whole tiles of sixteen
// in `a`): for each sixteen activation rows, each group is one signed-by-unsigned tile
// dot product (tdpbsud) of their codes and the block's, whose int32 sums are stored and
// scaled into sixteen vectors held in registers. The next group's product is issued
// before this one's sums are scaled, so the two overlap.
// Group g's product into tile S for the sixteen activation rows at x, through tiles X
// (their codes) and W (the block's). AMX's instructions spell tile numbers into the
// instruction, so they must be literals: a macro, not a function.
#define SLUICE_GROUP_PRODUCT(S, X, W, g, widened)                 \
  do {                                                            \
    _tile_zero(S);                                                \
    _tile_loadd(X, x + (g) * kGroup, k);                          \
    _tile_loadd(W, weight_tile<Nibbles>(w, (g), (widened)), 64);  \
    _tile_dpbsud(S, X, W);                                        \
  } while (0)

template <bool Nibbles, bool Centred>
void amx_blocks(const uint8_t* codes, const uint16_t* scales, const uint16_t* offset, int64_t begin,
                int64_t end, const Quantised& a, int64_t rows, int64_t n_total, float* out) {
  configure_tiles();
  const int64_t groups = a.groups, k = a.k;
  constexpr int64_t kInputsPerVector = Nibbles ? 8 : 4;
  const int64_t block_codes = k / kInputsPerVector * 64, block_values = groups * kBlockRows;
  alignas(64) uint8_t widened[2][kGroup / 4 * 64];
  alignas(64) int32_t sums[16 * 16];
  for (int64_t block = begin; block < end; ++block) {
    const uint8_t* w = codes + block * block_codes;
    for (int64_t first = 0; first < rows; first += 16) {
      const int8_t* x = a.codes.data() + first * k;
      const float* a_scale = a.scale.data() + first * groups;
      const float* a_sum = a.sum.data() + first * groups;
      const int32_t* a_start = a.start.data() + first * groups;
      __m512 acc[16];
      for (auto& v : acc) v = _mm512_setzero_ps();
      // Groups in pairs, even ones through tiles 0/2/4 and odd ones through 1/3/5.
      SLUICE_GROUP_PRODUCT(0, 2, 4, 0, widened[0]);
      for (int64_t g = 0; g < groups; g += 2) {
        const int64_t at = block * block_values + g * kBlockRows;
        if (g + 1 < groups) SLUICE_GROUP_PRODUCT(1, 3, 5, g + 1, widened[1]);
        _tile_stored(0, sums, 64);
        scale_sums<Centred>(sums, scales, offset, at, a_scale + g, a_sum + g, a_start + g, groups, acc);
        if (g + 1 >= groups) break;
        if (g + 2 < groups) SLUICE_GROUP_PRODUCT(0, 2, 4, g + 2, widened[0]);
        _tile_stored(1, sums, 64);
        scale_sums<Centred>(sums, scales, offset, at + kBlockRows, a_scale + g + 1, a_sum + g + 1, a_start + g + 1,
                            groups, acc);
      }
      for (int64_t r = 0; r < std::min<int64_t>(16, rows - first); ++r)
        _mm512_storeu_ps(out + (first + r) * n_total + block * kBlockRows, acc[r]);
    }
  }
  _tile_release();
}
#undef SLUICE_GROUP_PRODUCT
#else
#define SLUICE_AMX 0
#endif
#else
#define SLUICE_AMX 0
#endif

}  // namespace

int64_t sluice::block_rows() { return SLUICE_BLOCKS ? kBlockRows : 0; }

int64_t sluice::amx_rows() {
#if SLUICE_AMX
  return amx_granted() ? kAmxRows : 0;
#else
  return 0;
#endif
}

at::Tensor sluice::blocks_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                             const std::optional<at::Tensor>& offset, bool five_bit) {
  TORCH_CHECK(SLUICE_BLOCKS, "blocks_mm: this build has neither AVX-512 VNNI nor AVX2");
  TORCH_CHECK(x_in.dim() == 2, "blocks_mm: x must be [M, K]");
  const int64_t rows = x_in.size(0), k = x_in.size(1), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0, "blocks_mm: K must divide by 32");
  const bool nibbles = codes.dim() == 4 && codes.size(1) * 8 == k;
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && (nibbles || codes.size(1) * 4 == k) &&
                  codes.size(2) == kBlockRows && codes.size(3) == 4,
              "blocks_mm: codes must be [N/R, K/4, R, 4] (8-bit) or [N/R, K/8, R, 4] (4-bit) uint8, R = block_rows()");
  TORCH_CHECK(!(five_bit && nibbles), "blocks_mm: five-bit codes are held as bytes");
  const int64_t n_blocks = codes.size(0), n_total = n_blocks * kBlockRows;
  const std::vector<int64_t> values{n_blocks, groups, kBlockRows};
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.sizes() == values, "blocks_mm: scales [N/R, K/32, R] float16");
  const bool centred = !offset.has_value();
  TORCH_CHECK(centred || (offset->scalar_type() == at::kHalf && offset->sizes() == values),
              "blocks_mm: offset [N/R, K/32, R] float16, or none for centred codes");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && (centred || offset->is_contiguous()),
              "blocks_mm: weights must be contiguous");
  const at::Tensor x = sluice::quantisable(x_in);
  at::Tensor out = at::empty({rows, n_total}, x.options().dtype(at::kFloat));
#if SLUICE_BLOCKS
  if (rows == 0 || n_blocks == 0) return out;
  const int64_t amx_from = sluice::amx_rows();
  const bool amx = amx_from > 0 && rows >= amx_from;
  const Codes form = nibbles ? kFour : five_bit ? kFive : kEight;
  const int32_t centre = centred ? (form == kFour ? 8 : form == kFive ? 16 : 128) : 0;
  const int32_t bias = (kSignedBytes && form == kEight ? 128 : 0) - centre;
  const Quantised a = quantise(x, amx ? (rows + 15) / 16 * 16 : rows, bias);
  const uint8_t* code_base = codes.data_ptr<uint8_t>();
  const auto* scale_base = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* offset_base = centred ? nullptr : reinterpret_cast<const uint16_t*>(offset->data_ptr<at::Half>());
  float* result = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, n_blocks / (4 * at::get_num_threads()));
  // Each layout's kernel for these weights: the codes' form, centred or not.
  const auto run = [&](auto form_tag, auto centred_tag) {
    constexpr Codes kForm = decltype(form_tag)::value;
    constexpr bool kCentred = decltype(centred_tag)::value;
    at::parallel_for(0, n_blocks, grain, [&](int64_t begin, int64_t end) {
#if SLUICE_AMX
      if (amx)
        return amx_blocks<kForm == kFour, kCentred>(code_base, scale_base, offset_base, begin, end, a, rows, n_total,
                                                    result);
#endif
      blocks<kForm, kCentred>(code_base, scale_base, offset_base, begin, end, a, rows, n_total, result);
    });
  };
  const auto run_centred = [&](auto form_tag) {
    centred ? run(form_tag, std::true_type{}) : run(form_tag, std::false_type{});
  };
  if (form == kFour) {
    run_centred(std::integral_constant<Codes, kFour>{});
  } else if (form == kFive && kFiveApart) {
    run_centred(std::integral_constant<Codes, kFive>{});
  } else {
    run_centred(std::integral_constant<Codes, kEight>{});
  }
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(sluice_kernels, m) {
  m.def("blocks_mm(Tensor x, Tensor codes, Tensor scales, Tensor? offset, bool five_bit=False) -> Tensor");
  m.def("block_rows() -> int", &sluice::block_rows);
  m.def("amx_rows() -> int", &sluice::amx_rows);
}

TORCH_LIBRARY_IMPL(sluice_kernels, CPU, m) { m.impl("blocks_mm", &sluice::blocks_mm); }
