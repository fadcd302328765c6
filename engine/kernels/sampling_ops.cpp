// What the sampler needs of a step's logits, over every row at once.
//   argmax_rows  each row's index of its largest value, as torch.argmax(dim=1) gives it:
//                the first of equal maxima, and the first NaN where a row has one;
//                float32 or bfloat16 logits (widened exactly as they are read, so that
//                a bf16 head's output need not be copied to float32 for a greedy row).
// torch's argmax over the last dimension compares one value at a time: at 64 rows of
// Gemma 3's 262 144-token vocabulary it was 11 % of a perf profile of a C=64 load on an
// Intel Xeon (17 ms a step). Here sixteen lanes each keep their own maximum and the
// first index it was seen at; the lanes are reduced at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// The first index of the row's maximum, one value at a time from `begin`; NaN wins.
template <typename T>
int64_t argmax_scalar(const T* row, int64_t begin, int64_t n, int64_t best, float top) {
  for (int64_t i = begin; i < n; ++i) {
    const float x = static_cast<float>(row[i]);
    if (std::isnan(x)) return i;
    if (x > top) top = x, best = i;
  }
  return best;
}

#if defined(__AVX512F__)
// Sixteen values from `at` as float32: a bfloat16 is a float32's upper half.
inline __m512 load16(const float* at) { return _mm512_loadu_ps(at); }
inline __m512 load16(const c10::BFloat16* at) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
#if defined(__AVX512F__)
  constexpr int64_t kLanes = 16;
  if (n >= kLanes) {
    __m512 top = load16(row);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i index = at;
    const __m512i step = _mm512_set1_epi32(kLanes);
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    int64_t i = kLanes;
    for (; i + kLanes <= n; i += kLanes) {
      index = _mm512_add_epi32(index, step);
      const __m512 x = load16(row + i);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      // Strictly greater: a lane keeps the first index of its maximum.
      const __mmask16 greater = _mm512_cmp_ps_mask(x, top, _CMP_GT_OQ);
      top = _mm512_mask_mov_ps(top, greater, x);
      at = _mm512_mask_mov_epi32(at, greater, index);
    }
    if (nan) return argmax_scalar(row, 0, n, 0, -std::numeric_limits<float>::infinity());
    const float best_value = _mm512_reduce_max_ps(top);
    const __mmask16 holders = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best_value), _CMP_EQ_OQ);
    // Among the lanes holding the maximum, the smallest index.
    const __m512i candidates = _mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), holders, at);
    const int64_t best = _mm512_reduce_min_epi32(candidates);
    return argmax_scalar(row, i, n, best, best_value);
  }
#endif
  return argmax_scalar(row, 1, n, 0, static_cast<float>(row[0]));
}

template <typename T>
void argmax_each_row(const at::Tensor& logits, int64_t* chosen) {
  const int64_t n = logits.size(1);
  const T* base = logits.data_ptr<T>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) chosen[r] = argmax_row(base + r * n, n);
  });
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && logits.is_contiguous(),
              "argmax_rows: logits must be contiguous float32 or bfloat16 [rows, vocab]");
  const int64_t n = logits.size(1);
  TORCH_CHECK(n > 0 && n <= INT32_MAX, "argmax_rows: the vocabulary must be 1 to 2^31 - 1 wide");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (dtype == at::kFloat)
    argmax_each_row<float>(logits, out.data_ptr<int64_t>());
  else
    argmax_each_row<c10::BFloat16>(logits, out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice_kernels, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(sluice_kernels, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
