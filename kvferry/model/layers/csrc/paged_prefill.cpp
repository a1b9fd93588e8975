// Prefill attention on CPU: the queries of a prompt span attend its cached context, read
// in place from the paged KV cache through the block table, then the span's own fresh
// keys; causal, optional sliding window, grouped query heads. Flash-style: per (query
// head, tile of queries), key tiles are scored and folded into running softmax sums, so no
// [queries, keys] matrix and no gathered KV copy exist. Built and loaded at run time by
// kvferry/model/layers/prefill_kernel.py (its own library; operators in `kvferry_cpu`).
//
// Each KV head's keys and values are first packed tile by tile into the layout the
// microkernels read. bf16 on a CPU with AVX-512 BF16: keys as bf16 pairs with 16 keys on
// the lanes, values as key pairs, scored and summed with _mm512_dpbf16_ps (fp32
// accumulation; probabilities rounded to bf16 like the values). fp32 of a head width that
// is a multiple of 32 on a build with AVX-512 or AVX2 + FMA: keys on the lanes, query rows
// blocked in registers, one microkernel written once over either instruction set's lanes.
// Otherwise (fp16, other widths, `portable`): fp32 tiles in loops the compiler vectorises.
//
// q [spans * L, heads, D], k, v [spans * L, kv_heads, D] (each at strides of its own, D
// contiguous); out contiguous, q's shape. Span s's query i sits at position context + i and sees keys at positions
// <= its own (window > 0: and > its own - window): cached ones at positions start ..
// context - 1 (cache: K at `cache`, V at + kv_stride, position p at table[p / block_size]
// * block_stride + p % block_size * token_stride + head * head_stride), then its own k/v.
// Several spans only without context (a batch of same-length fresh prompts).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu_vec.h"

namespace {

constexpr int64_t kQueryTile = 32;  // queries per work item
constexpr int64_t kKeyTile = 32;    // keys per softmax step
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLazyMargin = 8.0f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One call's shape: positions, masking and where the keys live.
struct Problem {
  int64_t spans, length, context, start, window;
  int64_t heads, kv_heads, dim;
  float scale;
  // Key tiles start at absolute positions, multiples of kKeyTile (`origin`: the one at or
  // before `start`; keys before `start` are never read, packed as zeros and masked): a
  // query row then folds the same tiles whatever the span it is in (a whole prompt, a
  // chunk over cached context, its last token alone), so it gets the same bits.
  int64_t origin() const { return start - start % kKeyTile; }
  int64_t keys() const { return context - origin() + length; }  // per span, from `origin()`
  int64_t key_tiles() const { return (keys() + kKeyTile - 1) / kKeyTile; }
  int64_t query_tiles() const { return (length + kQueryTile - 1) / kQueryTile; }
};

// Key j of a span (position start + j), K (which 0) or V (1): a cached row or a fresh one.
template <typename scalar_t>
struct KeyRows {
  const scalar_t* cache;
  const int64_t* table;
  int64_t block_size, block_stride, token_stride, head_stride, kv_stride;
  const scalar_t* fresh[2];
  int64_t fresh_token_stride[2], fresh_head_stride[2];  // of k and of v

  const scalar_t* row(const Problem& p, int64_t span, int which, int64_t j, int64_t head) const {
    const int64_t pos = p.origin() + j;
    if (pos >= p.context) {
      const int64_t token = span * p.length + pos - p.context;
      return fresh[which] + token * fresh_token_stride[which] + head * fresh_head_stride[which];
    }
    return cache + which * kv_stride + table[pos / block_size] * block_stride +
           (pos % block_size) * token_stride + head * head_stride;
  }
};

// Query i of a span's head: rows of D contiguous values at any token and head strides.
template <typename scalar_t>
struct QueryRows {
  const scalar_t* data;
  int64_t token_stride, head_stride;
  const scalar_t* row(const Problem& p, int64_t span, int64_t i, int64_t head) const {
    return data + (span * p.length + i) * token_stride + head * head_stride;
  }
};

// Running softmax state and output sums of one query tile, and its scores.
struct TileState {
  std::vector<float> scores, out, peak, total, sums;  // sums: 16 lanes a row (fast path)
  std::vector<uint16_t> weights;  // bf16 probabilities (fast path)

  void reset(int64_t dim) {
    scores.assign(kQueryTile * kKeyTile, 0.0f);
    weights.assign(kQueryTile * kKeyTile, 0);
    out.assign(kQueryTile * dim, 0.0f);
    peak.assign(kQueryTile, kNegInf);
    total.assign(kQueryTile, 0.0f);
    sums.assign(kQueryTile * 16, 0.0f);
  }
};

// Which keys of a (query tile, key tile) a query may not see: after it, or (window > 0)
// window or more positions before it. `partial` false: every query sees every key.
struct TileMask {
  bool partial;
  int64_t first_query_pos, first_key_pos, window;

  bool hidden(int64_t r, int64_t c) const {
    const int64_t query_pos = first_query_pos + r, key_pos = first_key_pos + c;
    return key_pos > query_pos || (window > 0 && query_pos - key_pos >= window);
  }
};

// Folds one row's new scores into its running max and sum; returns the factor that
// rescales its earlier output sums, and leaves exp2 of the scaled scores in `row`.
inline float fold_row_portable(float* row, float scale, float& peak, float& total) {
  float high = kNegInf;
  for (int64_t c = 0; c < kKeyTile; ++c) high = std::max(high, row[c] * scale);
  const float next = std::max(peak, high);
  const float base = next == kNegInf ? 0.0f : next;  // a row that sees nothing yet
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < kKeyTile; ++c) {
    row[c] = std::exp2(row[c] * scale - base);
    sum += row[c];
  }
  const float rescale = std::exp2(peak - base);
  total = total * rescale + sum;
  peak = next;
  return rescale;
}

inline void rescale_row(float* out, int64_t dim, float factor) {
  if (factor == 1.0f) return;
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) out[d] *= factor;
}

// Portable microkernels: fp32 tiles, keys transposed [D][kKeyTile], values [kKeyTile][D].
struct PortableKernel {
  using packed_t = float;
  static int64_t tile_elements(int64_t dim) { return kKeyTile * dim; }

  template <typename scalar_t>
  static void pack_keys(const scalar_t* const* rows, int64_t dim, float* tile) {
    for (int64_t c = 0; c < kKeyTile; ++c)
      for (int64_t d = 0; d < dim; ++d) tile[d * kKeyTile + c] = rows[c] ? static_cast<float>(rows[c][d]) : 0.0f;
  }

  template <typename scalar_t>
  static void pack_values(const scalar_t* const* rows, int64_t dim, float* tile) {
    for (int64_t c = 0; c < kKeyTile; ++c)
      for (int64_t d = 0; d < dim; ++d) tile[c * dim + d] = rows[c] ? static_cast<float>(rows[c][d]) : 0.0f;
  }

  template <typename scalar_t>
  static void score(const scalar_t* const* queries, int64_t dim, const float* keys, int64_t rows, float* scores) {
    for (int64_t r = 0; r < rows; ++r) {
      float* row = scores + r * kKeyTile;
      std::fill(row, row + kKeyTile, 0.0f);
      for (int64_t d = 0; d < dim; ++d) {
        const float qd = static_cast<float>(queries[r][d]);
        const float* kd = keys + d * kKeyTile;
#pragma omp simd
        for (int64_t c = 0; c < kKeyTile; ++c) row[c] += qd * kd[c];
      }
    }
  }

  template <typename scalar_t>
  static void score_fold(const scalar_t* const* queries, int64_t dim, const float* keys, const TileMask& mask,
                         float scale, int64_t rows, TileState& state) {
    score(queries, dim, keys, rows, state.scores.data());
    if (mask.partial) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < kKeyTile; ++c)
          if (mask.hidden(r, c)) state.scores[r * kKeyTile + c] = kNegInf;
    }
    fold(state, dim, scale, rows);
  }

  static void fold(TileState& state, int64_t dim, float scale, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
      const float factor = fold_row_portable(&state.scores[r * kKeyTile], scale, state.peak[r], state.total[r]);
      rescale_row(&state.out[r * dim], dim, factor);
    }
  }

  static float row_total(const TileState& state, int64_t r) { return state.total[r]; }

  static void accumulate(TileState& state, int64_t dim, const float* values, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
      float* out = &state.out[r * dim];
      for (int64_t c = 0; c < kKeyTile; ++c) {
        const float weight = state.scores[r * kKeyTile + c];
        const float* vc = values + c * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) out[d] += weight * vc[d];
      }
    }
  }
};

#if defined(KVFERRY_AVX512)
// fp32 lanes of AVX-512: 16 a register, 32 registers. Register blocks (rows x vectors):
// scores 12 x 2 (all 32 keys of a tile), weighted sums 12 x 2 (32 values of a head).
struct Avx512Lanes {
  using reg = __m512;
  static constexpr int kLanes = 16, kRows = 12, kVecs = 2;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* at) { return _mm512_loadu_ps(at); }
  static void store(float* at, reg x) { _mm512_storeu_ps(at, x); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static bool any_above(reg a, float bound) { return _mm512_cmp_ps_mask(a, set1(bound), _CMP_GT_OQ) != 0; }
  static float max_lanes(reg a) { return _mm512_reduce_max_ps(a); }
  static float sum_lanes(reg a) { return _mm512_reduce_add_ps(a); }
  static reg exp2_nonpositive(reg x) { return kvferry_vec::exp2_nonpositive(x); }

  // 16 rows of 16 into 16 columns: r[j] becomes (r[0][j], ..., r[15][j]).
  static void transpose(reg r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);      // per 128-bit lane: a0 b0 a1 b1
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);  // a2 b2 a3 b3
    }
    for (int i = 0; i < 16; i += 4) {  // per lane: column 0, 1, 2, 3 of rows i .. i + 3
      u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
      u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
      u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
      u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int j = 0; j < 4; ++j) {  // lane k of u[j], u[4 + j], u[8 + j], u[12 + j]: column 4k + j
      const __m512 low = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44), low2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
      const __m512 high = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE), high2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
      r[j] = _mm512_shuffle_f32x4(low, low2, 0x88);
      r[4 + j] = _mm512_shuffle_f32x4(low, low2, 0xDD);
      r[8 + j] = _mm512_shuffle_f32x4(high, high2, 0x88);
      r[12 + j] = _mm512_shuffle_f32x4(high, high2, 0xDD);
    }
  }

  // `scores` of keys first_key .. + 15 with those hidden from the query at query_pos set to -inf.
  static reg hide(reg scores, int64_t first_key, int64_t query_pos, int64_t window) {
    const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first_key)),
                                          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __m512i query = _mm512_set1_epi32(static_cast<int32_t>(query_pos));
    __mmask16 hidden = _mm512_cmpgt_epi32_mask(keys, query);
    if (window > 0) {
      hidden |= _mm512_cmpge_epi32_mask(_mm512_sub_epi32(query, keys), _mm512_set1_epi32(static_cast<int32_t>(window)));
    }
    return _mm512_mask_mov_ps(scores, hidden, set1(kNegInf));
  }
};
using Fp32Lanes = Avx512Lanes;
#define KVFERRY_PREFILL_FP32_LANES 1
#elif defined(__AVX2__) && defined(__FMA__)
// fp32 lanes of AVX2: 8 a register, 16 registers. Register blocks: 6 rows x 2 vectors (16
// keys of a tile, 16 values of a head), as a 6 x 16 GEMM microkernel.
struct Avx2Lanes {
  using reg = __m256;
  static constexpr int kLanes = 8, kRows = 6, kVecs = 2;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* at) { return _mm256_loadu_ps(at); }
  static void store(float* at, reg x) { _mm256_storeu_ps(at, x); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static bool any_above(reg a, float bound) { return _mm256_movemask_ps(_mm256_cmp_ps(a, set1(bound), _CMP_GT_OQ)) != 0; }
  static float max_lanes(reg a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static float sum_lanes(reg a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }

  static reg exp2_nonpositive(reg x) { return kvferry_vec::exp2_nonpositive(x); }

  // 8 rows of 8 into 8 columns: r[j] becomes (r[0][j], ..., r[7][j]).
  static void transpose(reg r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // per 128-bit lane: a0 b0 a1 b1
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // a2 b2 a3 b3
    }
    for (int i = 0; i < 8; i += 4) {  // per lane: column 0, 1, 2, 3 of rows i .. i + 3
      u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
      u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {
      r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
      r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
  }

  static reg hide(reg scores, int64_t first_key, int64_t query_pos, int64_t window) {
    const __m256i keys = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(first_key)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i query = _mm256_set1_epi32(static_cast<int32_t>(query_pos));
    __m256i hidden = _mm256_cmpgt_epi32(keys, query);
    if (window > 0) {
      const __m256i reach = _mm256_set1_epi32(static_cast<int32_t>(window - 1));
      hidden = _mm256_or_si256(hidden, _mm256_cmpgt_epi32(_mm256_sub_epi32(query, keys), reach));
    }
    return _mm256_blendv_ps(scores, set1(kNegInf), _mm256_castsi256_ps(hidden));
  }
};
using Fp32Lanes = Avx2Lanes;
#define KVFERRY_PREFILL_FP32_LANES 1
#endif

#if defined(KVFERRY_AVX512_BF16)
using kvferry_vec::exp2_nonpositive;
using kvferry_vec::max_lanes;
using kvferry_vec::sum_lanes;

inline __m512bh pair_of(const uint16_t* pair) { return kvferry_vec::bf16_pair_on_every_lane(pair); }
inline __m512bh load_bh(const uint16_t* at) { return kvferry_vec::load_bf16_pairs(at); }

// bf16 microkernels. A key tile: 2 groups of 16 keys, each [D / 2][16 keys][2] (a key's
// values d, d + 1 side by side); a value tile: [kKeyTile / 2][D][2] (keys c, c + 1 side by
// side). Needs D a multiple of 32.
struct Bf16Kernel {
  using packed_t = uint16_t;
  static constexpr int kRows = 8;  // query rows per register block
  static int64_t tile_elements(int64_t dim) { return kKeyTile * dim; }

  static uint16_t bits(const c10::BFloat16* row, int64_t d) { return row ? row[d].x : 0; }

  static void pack_keys(const c10::BFloat16* const* rows, int64_t dim, uint16_t* tile) {
    for (int64_t c = 0; c < kKeyTile; ++c) {
      uint16_t* lane = tile + (c / 16) * 16 * dim + (c % 16) * 2;
      for (int64_t d = 0; d < dim; d += 2) {
        lane[(d / 2) * 32] = bits(rows[c], d);
        lane[(d / 2) * 32 + 1] = bits(rows[c], d + 1);
      }
    }
  }

  static void pack_values(const c10::BFloat16* const* rows, int64_t dim, uint16_t* tile) {
    for (int64_t c = 0; c < kKeyTile; ++c)
      for (int64_t d = 0; d < dim; ++d) tile[((c / 2) * dim + d) * 2 + c % 2] = bits(rows[c], d);
  }

  // Scores of 8 query rows at a time in registers, each row then folded (masked, scaled,
  // exponentiated, rounded to bf16 weights) without a trip through memory.
  static void score_fold(const c10::BFloat16* const* queries, int64_t dim, const uint16_t* keys, const TileMask& mask,
                         float scale, int64_t rows, TileState& state) {
    const uint16_t* second = keys + 16 * dim;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      __m512 acc[kRows][2];
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 2) {
        const __m512bh k0 = load_bh(keys + d * 16), k1 = load_bh(second + d * 16);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          const __m512bh qr = pair_of(reinterpret_cast<const uint16_t*>(queries[r0 + r]) + d);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qr, k0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qr, k1);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) fold_row(r0 + r, acc[r][0], acc[r][1], mask, scale, dim, state);
    }
  }

  // Lazy rescaling: a row's reference max moves only when a score exceeds it by more than
  // kLazyMargin (log2 units), so weights stay below 2^kLazyMargin and most key tiles skip the
  // rescale of the row's sums. Sums stay on 16 lanes until the end (no horizontal add).
  static inline void fold_row(int64_t r, __m512 s0, __m512 s1, const TileMask& mask, float scale, int64_t dim,
                              TileState& state) {
    const __m512 scaled = _mm512_set1_ps(scale);
    s0 = _mm512_mul_ps(s0, scaled);
    s1 = _mm512_mul_ps(s1, scaled);
    if (mask.partial) {
      s0 = Avx512Lanes::hide(s0, mask.first_key_pos, mask.first_query_pos + r, mask.window);
      s1 = Avx512Lanes::hide(s1, mask.first_key_pos + 16, mask.first_query_pos + r, mask.window);
    }
    const __m512 highs = _mm512_max_ps(s0, s1);
    float* sums = &state.sums[r * 16];
    if (_mm512_cmp_ps_mask(highs, _mm512_set1_ps(state.peak[r] + kLazyMargin), _CMP_GT_OQ)) {
      const float high = max_lanes(highs);  // horizontal: only when the max moves
      const float factor = std::exp2(state.peak[r] - high);
      state.peak[r] = high;
      rescale_row(&state.out[r * dim], dim, factor);
      _mm512_storeu_ps(sums, _mm512_mul_ps(_mm512_loadu_ps(sums), _mm512_set1_ps(factor)));
    }
    const float peak = state.peak[r];
    const __m512 shift = _mm512_set1_ps(peak == kNegInf ? 0.0f : peak);  // a row that sees nothing yet
    const __m512 p0 = exp2_nonpositive(_mm512_sub_ps(s0, shift)), p1 = exp2_nonpositive(_mm512_sub_ps(s1, shift));
    _mm512_storeu_si512(&state.weights[r * kKeyTile], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_loadu_ps(sums), _mm512_add_ps(p0, p1)));
  }

  static float row_total(const TileState& state, int64_t r) {
    return sum_lanes(_mm512_loadu_ps(&state.sums[r * 16]));
  }

  static void accumulate(TileState& state, int64_t dim, const uint16_t* values, int64_t rows) {
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        float* out = &state.out[r0 * dim + d0];
        __m512 acc[kRows][2];
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          acc[r][0] = _mm512_loadu_ps(out + r * dim);
          acc[r][1] = _mm512_loadu_ps(out + r * dim + 16);
        }
        const uint16_t* weights = &state.weights[r0 * kKeyTile];
        for (int64_t c = 0; c < kKeyTile; c += 2) {
          const uint16_t* pair = values + (c * dim + d0 * 2);
          const __m512bh v0 = load_bh(pair), v1 = load_bh(pair + 32);
#pragma GCC unroll 8
          for (int r = 0; r < kRows; ++r) {
            const __m512bh w = pair_of(weights + r * kKeyTile + c);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, v0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w, v1);
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          _mm512_storeu_ps(out + r * dim, acc[r][0]);
          _mm512_storeu_ps(out + r * dim + 16, acc[r][1]);
        }
      }
    }
  }
};
#endif


#if defined(KVFERRY_PREFILL_FP32_LANES)
// fp32 microkernels over one instruction set's lanes `L`, on the portable tiles' packing
// (keys [D][kKeyTile], values [kKeyTile][D]): GEMM-style register blocks of L::kRows query
// rows by L::kVecs vectors of keys (scores) or of head values (weighted sums), with the
// query's or weight's value broadcast. Weights stay fp32 (nothing rounded below the
// inputs' precision); softmax sums stay on lanes, with the lazy rescaling of the bf16
// kernel. Needs D a multiple of 32.
template <typename L>
struct Fp32Kernel : PortableKernel {
  using reg = typename L::reg;
  static constexpr int kKeyVecs = kKeyTile / L::kLanes;  // vectors a row of a key tile
  static constexpr int kSlice = L::kVecs * L::kLanes;    // keys or values a register block spans

  // The portable tiles' packing (missing rows as zeros), in registers: keys transposed
  // L::kLanes x L::kLanes at a time, values copied a vector at a time.
  static void pack_keys(const float* const* rows, int64_t dim, float* tile) {
    for (int64_t c0 = 0; c0 < kKeyTile; c0 += L::kLanes)
      for (int64_t d0 = 0; d0 < dim; d0 += L::kLanes) {
        reg block[L::kLanes];
        for (int i = 0; i < L::kLanes; ++i) block[i] = rows[c0 + i] ? L::load(rows[c0 + i] + d0) : L::zero();
        L::transpose(block);
        for (int j = 0; j < L::kLanes; ++j) L::store(tile + (d0 + j) * kKeyTile + c0, block[j]);
      }
  }

  static void pack_values(const float* const* rows, int64_t dim, float* tile) {
    for (int64_t c = 0; c < kKeyTile; ++c)
      for (int64_t d0 = 0; d0 < dim; d0 += L::kLanes)
        L::store(tile + c * dim + d0, rows[c] ? L::load(rows[c] + d0) : L::zero());
  }

  // The live rows only (a row's bits do not depend on the rows beside it): blocks of
  // L::kRows, then one block of the rest.
  static void score_fold(const float* const* queries, int64_t dim, const float* keys, const TileMask& mask,
                         float scale, int64_t rows, TileState& state) {
    for (int64_t c0 = 0; c0 < kKeyTile; c0 += kSlice) {
      int64_t r0 = 0;
      for (; r0 + L::kRows <= rows; r0 += L::kRows)
        score_block<L::kRows>(queries + r0, dim, keys + c0, &state.scores[r0 * kKeyTile + c0]);
      if (r0 < rows) score_rest(rows - r0, queries + r0, dim, keys + c0, &state.scores[r0 * kKeyTile + c0]);
    }
    for (int64_t r = 0; r < rows; ++r) fold_row(r, mask, scale, dim, state);
  }

  // score_block of `rows` (fewer than L::kRows) rows.
  template <int n = 1>
  static void score_rest(int64_t rows, const float* const* queries, int64_t dim, const float* keys, float* scores) {
    if constexpr (n < L::kRows) {
      if (rows == n) return score_block<n>(queries, dim, keys, scores);
      score_rest<n + 1>(rows, queries, dim, keys, scores);
    }
  }

  // Scores of `rows` query rows against kSlice keys of the tile (at `keys`, row stride
  // kKeyTile), into scores[row][key] (same stride). Not inlined: the register allocator
  // then gives the accumulators every register instead of keeping the fold's constants in
  // some of them and spilling accumulators.
  template <int rows>
  __attribute__((noinline)) static void score_block(const float* const* queries, int64_t dim, const float* keys,
                                                    float* scores) {
    reg acc[rows][L::kVecs];
#pragma GCC unroll 12
    for (int r = 0; r < rows; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < L::kVecs; ++j) acc[r][j] = L::zero();
    for (int64_t d = 0; d < dim; ++d) {
      reg k[L::kVecs];
#pragma GCC unroll 4
      for (int j = 0; j < L::kVecs; ++j) k[j] = L::load(keys + d * kKeyTile + j * L::kLanes);
#pragma GCC unroll 12
      for (int r = 0; r < rows; ++r) {
        const reg q = L::set1(queries[r][d]);
#pragma GCC unroll 4
        for (int j = 0; j < L::kVecs; ++j) acc[r][j] = L::fmadd(q, k[j], acc[r][j]);
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < rows; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < L::kVecs; ++j) L::store(scores + r * kKeyTile + j * L::kLanes, acc[r][j]);
  }

  // One row's scores (state.scores) into fp32 weights in place, and its running max and
  // lane sums.
  static inline void fold_row(int64_t r, const TileMask& mask, float scale, int64_t dim, TileState& state) {
    float* row = &state.scores[r * kKeyTile];
    reg s[kKeyVecs];
#pragma GCC unroll 4
    for (int j = 0; j < kKeyVecs; ++j) s[j] = L::load(row + j * L::kLanes);
    const reg scaled = L::set1(scale);
    reg highs = L::set1(kNegInf);
#pragma GCC unroll 4
    for (int j = 0; j < kKeyVecs; ++j) {
      s[j] = L::mul(s[j], scaled);
      if (mask.partial) s[j] = L::hide(s[j], mask.first_key_pos + j * L::kLanes, mask.first_query_pos + r, mask.window);
      highs = L::max(highs, s[j]);
    }
    float* sums = &state.sums[r * L::kLanes];
    if (L::any_above(highs, state.peak[r] + kLazyMargin)) {
      const float high = L::max_lanes(highs);
      const float factor = std::exp2(state.peak[r] - high);
      state.peak[r] = high;
      rescale_row(&state.out[r * dim], dim, factor);
      L::store(sums, L::mul(L::load(sums), L::set1(factor)));
    }
    const float peak = state.peak[r];
    const reg shift = L::set1(peak == kNegInf ? 0.0f : peak);
    reg total = L::load(sums);
#pragma GCC unroll 4
    for (int j = 0; j < kKeyVecs; ++j) {
      const reg weight = L::exp2_nonpositive(L::sub(s[j], shift));
      L::store(row + j * L::kLanes, weight);
      total = L::add(total, weight);
    }
    L::store(sums, total);
  }

  static float row_total(const TileState& state, int64_t r) { return L::sum_lanes(L::load(&state.sums[r * L::kLanes])); }

  static void accumulate(TileState& state, int64_t dim, const float* values, int64_t rows) {
    for (int64_t d0 = 0; d0 < dim; d0 += kSlice) {
      int64_t r0 = 0;
      for (; r0 + L::kRows <= rows; r0 += L::kRows)
        sum_block<L::kRows>(&state.scores[r0 * kKeyTile], values + d0, dim, &state.out[r0 * dim + d0]);
      if (r0 < rows) sum_rest(rows - r0, &state.scores[r0 * kKeyTile], values + d0, dim, &state.out[r0 * dim + d0]);
    }
  }

  // sum_block of `rows` (fewer than L::kRows) rows.
  template <int n = 1>
  static void sum_rest(int64_t rows, const float* weights, const float* values, int64_t dim, float* out) {
    if constexpr (n < L::kRows) {
      if (rows == n) return sum_block<n>(weights, values, dim, out);
      sum_rest<n + 1>(rows, weights, values, dim, out);
    }
  }

  // out[row][0 .. kSlice) += the rows' weights (stride kKeyTile) times the tile's values
  // (at `values`, row stride dim); out's rows have stride dim.
  template <int rows>
  __attribute__((noinline)) static void sum_block(const float* weights, const float* values, int64_t dim,
                                                  float* out) {
    reg acc[rows][L::kVecs];
#pragma GCC unroll 12
    for (int r = 0; r < rows; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < L::kVecs; ++j) acc[r][j] = L::load(out + r * dim + j * L::kLanes);
    for (int64_t c = 0; c < kKeyTile; ++c) {
      reg v[L::kVecs];
#pragma GCC unroll 4
      for (int j = 0; j < L::kVecs; ++j) v[j] = L::load(values + c * dim + j * L::kLanes);
#pragma GCC unroll 12
      for (int r = 0; r < rows; ++r) {
        const reg w = L::set1(weights[r * kKeyTile + c]);
#pragma GCC unroll 4
        for (int j = 0; j < L::kVecs; ++j) acc[r][j] = L::fmadd(w, v[j], acc[r][j]);
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < rows; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < L::kVecs; ++j) L::store(out + r * dim + j * L::kLanes, acc[r][j]);
  }
};
#endif

// Packs key tile `tile` of a span's KV head: K into `keys`, V into `values`.
template <typename Kernel, typename scalar_t>
void pack_tile(const Problem& p, const KeyRows<scalar_t>& source, int64_t span, int64_t head, int64_t tile,
               typename Kernel::packed_t* keys, typename Kernel::packed_t* values) {
  const scalar_t* rows[kKeyTile];
  const int64_t first = tile * kKeyTile;
  for (int which = 0; which < 2; ++which) {
    for (int64_t c = 0; c < kKeyTile; ++c)
      rows[c] = first + c < p.keys() && p.origin() + first + c >= p.start ? source.row(p, span, which, first + c, head)
                                                                          : nullptr;
    if (which == 0) Kernel::pack_keys(rows, p.dim, keys);
    else Kernel::pack_values(rows, p.dim, values);
  }
}

// Packs every (span, KV head, key tile) of K and V: [spans][kv_heads][tiles][tile_elements].
template <typename Kernel, typename scalar_t>
void pack_all(const Problem& p, const KeyRows<scalar_t>& source, typename Kernel::packed_t* keys,
              typename Kernel::packed_t* values) {
  const int64_t tiles = p.key_tiles(), size = Kernel::tile_elements(p.dim);
  at::parallel_for(0, p.spans * p.kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t span = item / (p.kv_heads * tiles), head = item / tiles % p.kv_heads;
      pack_tile<Kernel>(p, source, span, head, item % tiles, keys + item * size, values + item * size);
    }
  });
}

// The key tiles [first, last] that query rows first_query .. + kQueryTile - 1 may see.
std::pair<int64_t, int64_t> visible_tiles(const Problem& p, int64_t first_query) {
  const int64_t low_pos = p.context + first_query;
  const int64_t high_pos = p.context + std::min(first_query + kQueryTile, p.length) - 1;
  const int64_t low_key = p.window > 0 ? std::max<int64_t>(0, low_pos - p.window + 1 - p.origin()) : 0;
  return {low_key / kKeyTile, (high_pos - p.origin()) / kKeyTile};
}

// Whether every query row of the tile sees every key of the key tile.
bool fully_visible(const Problem& p, int64_t first_query, int64_t first_key) {
  const int64_t low_pos = p.context + first_query, high_pos = low_pos + kQueryTile - 1;
  const int64_t low_key = p.origin() + first_key, high_key = low_key + kKeyTile - 1;
  return high_key <= low_pos && (p.window == 0 || high_pos - low_key < p.window);
}

// One (span, query head, query tile) being attended: its query rows (those past the span
// read zeros, their output dropped), how many are live, and its running softmax. Only the
// live rows are computed: a row's bits depend on neither the rows beside it nor their count.
template <typename Kernel, typename scalar_t>
struct QueryTile {
  const scalar_t* queries[kQueryTile];
  int64_t span, head, first_query, rows;

  QueryTile(const Problem& p, const QueryRows<scalar_t>& q, int64_t span_, int64_t head_, int64_t tile,
            const scalar_t* zeros, TileState& state)
      : span(span_), head(head_), first_query(tile * kQueryTile),
        rows(std::min(kQueryTile, p.length - tile * kQueryTile)) {
    for (int64_t r = 0; r < kQueryTile; ++r) queries[r] = r < rows ? q.row(p, span, first_query + r, head) : zeros;
    state.reset(p.dim);
  }

  // Folds key tile `t` (packed K and V) into the rows' running sums.
  void fold(const Problem& p, int64_t t, const typename Kernel::packed_t* keys, const typename Kernel::packed_t* values,
            TileState& state) const {
    const TileMask mask{!fully_visible(p, first_query, t * kKeyTile), p.context + first_query,
                        p.origin() + t * kKeyTile, p.window};
    Kernel::score_fold(queries, p.dim, keys, mask, p.scale * kLog2e, rows, state);
    Kernel::accumulate(state, p.dim, values, rows);
  }

  // The normalised live rows into `out`.
  void write(const Problem& p, const TileState& state, scalar_t* out) const {
    for (int64_t r = 0; r < rows; ++r) {
      const float inverse = 1.0f / Kernel::row_total(state, r);
      scalar_t* row = out + ((span * p.length + first_query + r) * p.heads + head) * p.dim;
      for (int64_t d = 0; d < p.dim; ++d) row[d] = static_cast<scalar_t>(state.out[r * p.dim + d] * inverse);
    }
  }
};

// Query tile k of a head's list, cheap and dear alternating (0, n-1, 1, n-2, ...): causal
// tiles grow with their position, and each thread's contiguous share then costs the same.
inline int64_t interleaved(int64_t k, int64_t n) { return k % 2 == 0 ? k / 2 : n - 1 - k / 2; }

// Spans of several query tiles: every key tile packed once up front, then each (span, query
// head, query tile) folds the tiles it sees.
template <typename Kernel, typename scalar_t>
void run_packed(const Problem& p, const KeyRows<scalar_t>& source, const QueryRows<scalar_t>& q, scalar_t* out) {
  const int64_t size = Kernel::tile_elements(p.dim), key_tiles = p.key_tiles();
  const int64_t packed = p.spans * p.kv_heads * key_tiles * size;
  std::vector<typename Kernel::packed_t> keys(packed), values(packed);
  pack_all<Kernel>(p, source, keys.data(), values.data());
  const std::vector<scalar_t> zeros(p.dim, static_cast<scalar_t>(0.0f));
  const int64_t tiles = p.query_tiles(), group = p.heads / p.kv_heads;
  at::parallel_for(0, p.spans * p.heads * tiles, 1, [&](int64_t begin, int64_t end) {
    TileState state;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t span = item / (p.heads * tiles), head = item / tiles % p.heads;
      const QueryTile<Kernel, scalar_t> tile(p, q, span, head, interleaved(item % tiles, tiles), zeros.data(), state);
      const int64_t base = (span * p.kv_heads + head / group) * key_tiles;
      const auto [first, last] = visible_tiles(p, tile.first_query);
      for (int64_t t = first; t <= last; ++t)
        tile.fold(p, t, keys.data() + (base + t) * size, values.data() + (base + t) * size, state);
      tile.write(p, state, out);
    }
  });
}

// Spans of one query tile (a prompt's last token alone after a cache hit or a KV transfer,
// a short chunk over a long context): packing the whole context first would cost more than
// attending it. Each (span, KV head) packs its key tiles one at a time as its query heads
// fold them: the same packed tiles in the same order, so the same bits as run_packed.
template <typename Kernel, typename scalar_t>
void run_streamed(const Problem& p, const KeyRows<scalar_t>& source, const QueryRows<scalar_t>& q, scalar_t* out) {
  const int64_t size = Kernel::tile_elements(p.dim), group = p.heads / p.kv_heads;
  const std::vector<scalar_t> zeros(p.dim, static_cast<scalar_t>(0.0f));
  const auto [first, last] = visible_tiles(p, 0);
  at::parallel_for(0, p.spans * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<typename Kernel::packed_t> keys(size), values(size);
    std::vector<TileState> states(group);
    std::vector<QueryTile<Kernel, scalar_t>> tiles;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t span = item / p.kv_heads, kv = item % p.kv_heads;
      tiles.clear();
      for (int64_t h = 0; h < group; ++h) tiles.emplace_back(p, q, span, kv * group + h, 0, zeros.data(), states[h]);
      for (int64_t t = first; t <= last; ++t) {
        pack_tile<Kernel>(p, source, span, kv, t, keys.data(), values.data());
        for (int64_t h = 0; h < group; ++h) tiles[h].fold(p, t, keys.data(), values.data(), states[h]);
      }
      for (int64_t h = 0; h < group; ++h) tiles[h].write(p, states[h], out);
    }
  });
}

template <typename Kernel, typename scalar_t>
void run(const Problem& p, const KeyRows<scalar_t>& source, const QueryRows<scalar_t>& q, scalar_t* out) {
  if (p.query_tiles() == 1) return run_streamed<Kernel>(p, source, q, out);
  run_packed<Kernel>(p, source, q, out);
}

// Whether `dtype` at head width `dim` takes a vector microkernel of this build.
bool fast_path(c10::ScalarType dtype, int64_t dim) {
  if (dim % 32 != 0) return false;
#if defined(KVFERRY_AVX512_BF16)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(KVFERRY_PREFILL_FP32_LANES)
  if (dtype == at::kFloat) return true;
#endif
  (void)dtype;
  return false;
}

// The lanes of the fp32 microkernel in this build: "avx512", "avx2" or "none".
std::string fp32_lanes() {
#if defined(KVFERRY_AVX512)
  return "avx512";
#elif defined(KVFERRY_PREFILL_FP32_LANES)
  return "avx2";
#else
  return "none";
#endif
}

template <typename scalar_t>
void dispatch(const Problem& p, const KeyRows<scalar_t>& source, const QueryRows<scalar_t>& q, scalar_t* out,
              bool portable) {
  if (!portable && fast_path(c10::CppTypeToScalarType<scalar_t>::value, p.dim)) {
#if defined(KVFERRY_AVX512_BF16)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) return run<Bf16Kernel>(p, source, q, out);
#endif
#if defined(KVFERRY_PREFILL_FP32_LANES)
    if constexpr (std::is_same_v<scalar_t, float>) return run<Fp32Kernel<Fp32Lanes>>(p, source, q, out);
#endif
  }
  run<PortableKernel>(p, source, q, out);
}

void paged_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
                   const at::Tensor& table, at::Tensor& out, int64_t spans, int64_t context, int64_t start,
                   int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t head_stride,
                   int64_t kv_stride, int64_t window, double scale, bool portable) {
  TORCH_CHECK(out.is_contiguous() && table.is_contiguous(), "paged_prefill: contiguous out, table");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && out.sizes() == q.sizes(), "paged_prefill: shapes");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "paged_prefill: k, v dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "paged_prefill: rows of contiguous values");
  TORCH_CHECK(context == 0 || (cache.scalar_type() == q.scalar_type() && cache.stride(-1) == 1), "paged_prefill: cache");
  TORCH_CHECK(table.scalar_type() == at::kLong && spans >= 1 && q.size(0) % spans == 0, "paged_prefill: table, spans");
  TORCH_CHECK(spans == 1 || context == 0, "paged_prefill: several spans only without context");
  const Problem p{spans, q.size(0) / spans, context, start, window, q.size(1), k.size(1), q.size(2),
                  static_cast<float>(scale)};
  TORCH_CHECK(p.heads % p.kv_heads == 0 && k.size(0) == q.size(0) && k.size(2) == p.dim, "paged_prefill: heads");
  TORCH_CHECK(start >= 0 && start <= context && (block_size > 0 || context == 0), "paged_prefill: start");
  TORCH_CHECK(context == 0 || (context - 1) / block_size < table.numel(), "paged_prefill: block table too short");
  if (p.length == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    const KeyRows<scalar_t> source{cache.data_ptr<scalar_t>(), table.data_ptr<int64_t>(), block_size, block_stride,
                                   token_stride, head_stride, kv_stride, {k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>()},
                                   {k.stride(0), v.stride(0)}, {k.stride(1), v.stride(1)}};
    const QueryRows<scalar_t> queries{q.data_ptr<scalar_t>(), q.stride(0), q.stride(1)};
    dispatch<scalar_t>(p, source, queries, out.data_ptr<scalar_t>(), portable);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvferry_cpu, m) {
  m.def(
      "paged_prefill(Tensor q, Tensor k, Tensor v, Tensor cache, Tensor table, Tensor(a!) out, int spans, "
      "int context, int start, int block_size, int block_stride, int token_stride, int head_stride, "
      "int kv_stride, int window, float scale, bool portable=False) -> ()");
  m.def("prefill_fast_path(ScalarType dtype, int dim) -> bool", &fast_path);
  m.def("prefill_fp32_lanes() -> str", &fp32_lanes);
}

TORCH_LIBRARY_IMPL(kvferry_cpu, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
