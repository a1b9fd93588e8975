// Vector helpers every CPU kernel in this directory shares: which instruction set the build
// targets, bf16 loads and conversions, the exp approximations of the softmaxes, horizontal
// reductions. The instruction set comes from the compiler's flags, never from the running
// CPU: kvferry/model/layers/cpu_kernels.py builds each kernel for explicit levels
// (-mavx2 -mfma ..., -mavx512f ... -mavx512bf16) and loads only a build the CPU can run.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

// KVFERRY_AVX512: AVX-512 F, BW and VL (16 fp32 lanes, masked 16-bit loads);
// KVFERRY_AVX512_BF16: with the bf16 dot products (vdpbf16ps) and conversions too.
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVFERRY_AVX512 1
#if defined(__AVX512BF16__)
#define KVFERRY_AVX512_BF16 1
#endif
#endif

namespace kvferry_vec {

// 2^f for f in [-0.5, 0.5]: ln2^k / k!, k = 6 .. 0 (Horner's order), for exp2_nonpositive.
constexpr float kExp2Polynomial[7] = {1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
                                      5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f,
                                      1.0f};

// ---- portable ---------------------------------------------------------------------------

// The largest of values[0 .. n).
inline float max_of_portable(const float* values, int64_t n) { return *std::max_element(values, values + n); }

#if defined(KVFERRY_AVX512)
// ---- AVX-512 ----------------------------------------------------------------------------

// The first `remaining` of 16 lanes (all when 16 or more remain).
inline __mmask16 lanes(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1);
}

// 16 bf16 bit patterns as fp32: bf16 is the high half of an fp32.
inline __m512 bf16_words_to_fp32(__m256i words16) {
  const __m512i words = _mm512_cvtepu16_epi32(words16);
  return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}

// 16 bf16 values as fp32.
inline __m512 load_bf16(const c10::BFloat16* values) {
  return bf16_words_to_fp32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
}

// The same for the lanes of `mask`, zeros past it (a masked load never touches those bytes).
inline __m512 load_bf16(const c10::BFloat16* values, __mmask16 mask) {
  return bf16_words_to_fp32(_mm256_maskz_loadu_epi16(mask, values));
}

// e^x for x <= 0: 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, where the Taylor
// series to r^7 is within 1e-8 of e^r; x below -104 gives 0 (as expf underflows).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147182f), x);  // ln 2 in two parts: r exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-1.90465430e-9f), r);
  const float coefficients[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  __m512 p = _mm512_set1_ps(coefficients[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(coefficients[i]));
  return _mm512_scalef_ps(p, n);
}

// 2^x for x <= 0 (-inf included): round to n, a degree-6 polynomial of the rest, scale by 2^n.
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-160.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  __m512 poly = _mm512_set1_ps(kExp2Polynomial[0]);
  for (int k = 1; k < 7; ++k) poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(kExp2Polynomial[k]));
  return _mm512_scalef_ps(poly, n);
}

// Horizontal reductions of 16 fp32 lanes.
inline float sum_lanes(__m512 values) { return _mm512_reduce_add_ps(values); }
inline float max_lanes(__m512 values) { return _mm512_reduce_max_ps(values); }

// The largest of values[0 .. n), 16 at a time.
inline float max_of(const float* values, int64_t n) {
  __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) {
    peak = _mm512_mask_max_ps(peak, lanes(n - j), peak, _mm512_maskz_loadu_ps(lanes(n - j), values + j));
  }
  return max_lanes(peak);
}

#else

inline float max_of(const float* values, int64_t n) { return max_of_portable(values, n); }

#endif  // KVFERRY_AVX512

#if defined(__AVX2__) && defined(__FMA__)
// 2^x for x <= 0 (-inf included) on 8 lanes: the same polynomial, 2^n built in the exponent
// bits (AVX2 has no scalef); below -127 the exponent field is 0 and the result 0.
inline __m256 exp2_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 poly = _mm256_set1_ps(kExp2Polynomial[0]);
  for (int k = 1; k < 7; ++k) poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(kExp2Polynomial[k]));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(poly, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}
#endif  // AVX2 + FMA

#if defined(KVFERRY_AVX512_BF16)
// Two bf16 values (adjacent in memory) on every 32-bit lane, for vdpbf16ps.
inline __m512bh bf16_pair_on_every_lane(const uint16_t* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

// 32 bf16 values as vdpbf16ps reads them.
inline __m512bh load_bf16_pairs(const uint16_t* at) { return (__m512bh)_mm512_loadu_si512(at); }
#endif  // KVFERRY_AVX512_BF16

}  // namespace kvferry_vec
