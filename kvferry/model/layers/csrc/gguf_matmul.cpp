// GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) times a few float32 rows, multiplied in
// integers as the blocks are stored. Built and loaded at run time by
// kvferry/model/layers/gguf_kernel.py (--quantization gguf).
//
// A weight row is `in / 32` blocks of 32 weights, each block as the GGUF file holds it:
//   Q4_0: fp16 d, 16 bytes of nibbles            w = d * (q - 8)
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles    w = d * q + m
//   Q8_0: fp16 d, 32 int8                        w = d * q
// (nibbles: the low ones are elements 0-15, the high ones 16-31).
//
// Each activation row is first quantized per block of 32 to int8 (dx = max|x| / 127,
// qx = round-to-nearest-even(x / dx)), so a block's contribution is an integer dot product:
//   Q4: d * dx * sum(q * qx) + m' * dx * sum(qx)   (m' = m, or -8 d for Q4_0)
//   Q8: d * dx * sum(q * qx)
// The activation rounding (at most dx / 2 per input) is the only difference from the
// dequantized float reference; the integer sums are exact, the float sums over blocks are
// in another order than a BLAS's.
//
// Paths, chosen when the library is built for an instruction-set level (cpu_kernels):
// AVX-512 BW (two blocks per 512-bit `vpmaddubsw`, or `vpdpbusd` where the build has VNNI:
// the same integer sums, as no pair of products reaches int16's limit), AVX2 (`vpmaddubsw`
// on one block), and a portable scalar one, which a caller can also force (`portable`) to
// test it anywhere.
// Output rows are split over the threads (at::parallel_for); activation rows are
// taken in turns of up to kMaxRows per weight row while that row is in L1. A row's result
// does not depend on the rows beside it (each has its own accumulators, summed in the same
// order whatever the turn's size): batch-invariant, as speculative decoding's exactness
// needs (kvferry/spec_decode). The AVX2 and AVX-512 passes compute the same lanes, products
// and sums in the same order: the same bits from either build (the portable path sums
// in another order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVFERRY_GGUF_AVX2 1
#endif
#if defined(KVFERRY_GGUF_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define KVFERRY_GGUF_AVX512 1
#endif

namespace {

constexpr int64_t kBlock = 32;
// Activation rows per pass over a weight row: as many as the vector registers hold
// accumulators for (AVX-512: 32 registers, two accumulators a row; AVX2: 16).
#ifdef KVFERRY_GGUF_AVX512
constexpr int64_t kMaxRows = 8;
#else
constexpr int64_t kMaxRows = 4;
#endif
// gguf.GGMLQuantizationType values
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

struct BlockFormat {
  int64_t bytes;       // per block
  int64_t quants_at;   // where the quants start in a block
  bool four_bit;
  bool has_min;        // Q4_1
};

BlockFormat format_of(int64_t qtype) {
  if (qtype == kQ4_0) return {18, 2, true, false};
  if (qtype == kQ4_1) return {20, 4, true, true};
  TORCH_CHECK(qtype == kQ8_0, "gguf_matmul: block type ", qtype, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  return {34, 2, false, false};
}

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef KVFERRY_GGUF_AVX2
  return _cvtsh_ss(bits);  // F16C: one instruction (c10::Half converts in software)
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Quantized activation rows: int8 values, and per block the scale and the values' sum.
struct QuantRows {
  std::vector<int8_t> q;      // [rows, in]
  std::vector<float> scale;   // [rows, blocks]
  std::vector<float> sum;     // [rows, blocks]: the values' sum (an integer, exact as a float)
};

QuantRows quantize_rows(const float* x, int64_t rows, int64_t in) {
  const int64_t blocks = in / kBlock;
  QuantRows out{std::vector<int8_t>(rows * in), std::vector<float>(rows * blocks), std::vector<float>(rows * blocks)};
  for (int64_t b = 0; b < rows * blocks; ++b) {
    const float* v = x + b * kBlock;
    float amax = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    int32_t total = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(v[i] * inv));
      out.q[b * kBlock + i] = static_cast<int8_t>(q);
      total += q;
    }
    out.scale[b] = d;
    out.sum[b] = static_cast<float>(total);
  }
  return out;
}

struct Operands {
  const uint8_t* weight;  // [features, blocks * format.bytes]
  const QuantRows* x;
  float* out;             // [rows, features]
  int64_t rows, blocks, features;
  BlockFormat format;
};

// The block's scale d and offset m' (the weight q stands for is d * q + m'; Q8_0: m' = 0).
void block_scales(const uint8_t* block, const BlockFormat& f, float& d, float& m) {
  d = half_at(block);
  m = f.has_min ? half_at(block + 2) : (f.four_bit ? -8.f * d : 0.f);
}

// A block's 32 weights as the integers q the format stores (Q4: 0..15, Q8_0: -128..127).
// Decoded into their own array, apart from the dot product: GCC 12 at -march=native on an
// AVX-512 VNNI CPU vectorized a loop that mixed the two (a nibble zero-extended, an int8
// sign-extended, chosen per format) into a wrong Q8_0 dot product.
void decode_block(const uint8_t* quants, bool four_bit, int16_t* w) {
  if (four_bit) {
    for (int64_t i = 0; i < kBlock / 2; ++i) {
      w[i] = static_cast<int16_t>(quants[i] & 0x0F);
      w[i + kBlock / 2] = static_cast<int16_t>(quants[i] >> 4);
    }
    return;
  }
  for (int64_t i = 0; i < kBlock; ++i) w[i] = static_cast<int16_t>(static_cast<int8_t>(quants[i]));
}

void portable_row(const Operands& op, int64_t feature, int64_t first, int64_t count) {
  const uint8_t* row = op.weight + feature * op.blocks * op.format.bytes;
  int16_t w[kBlock];
  for (int64_t r = first; r < first + count; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < op.blocks; ++b) {
      const uint8_t* block = row + b * op.format.bytes;
      decode_block(block + op.format.quants_at, op.format.four_bit, w);
      const int8_t* qx = op.x->q.data() + (r * op.blocks + b) * kBlock;
      int32_t dot = 0;
      for (int64_t i = 0; i < kBlock; ++i) dot += static_cast<int32_t>(w[i]) * qx[i];
      float d, m;
      block_scales(block, op.format, d, m);
      const float dx = op.x->scale[r * op.blocks + b];
      acc += d * dx * static_cast<float>(dot) + m * dx * op.x->sum[r * op.blocks + b];
    }
    op.out[r * op.features + feature] = acc;
  }
}

#ifdef KVFERRY_GGUF_AVX2

// 32 weights of a block as bytes: unsigned nibbles (Q4) or signed int8 (Q8_0).
inline __m256i load_block(const uint8_t* quants, bool four_bit) {
  if (!four_bit) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low), _mm_and_si128(packed, low));
}

// 8 int32 partial sums of w * x over a block (w unsigned nibbles, or signed int8).
inline __m256i block_dot(__m256i w, __m256i x, bool four_bit) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (four_bit) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// d0 m0 d1 m1 of two consecutive blocks from one conversion (lanes 1 and 3 mean something for
// Q4_1 only; Q8_0's are quants).
inline __m128 pair_scales(const uint8_t* block0, const uint8_t* block1) {
  uint32_t head0, head1;
  std::memcpy(&head0, block0, 4);
  std::memcpy(&head1, block1, 4);
  return _mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(head1), static_cast<int>(head0)));
}

// [m0', m1', m0', m1']: the two blocks' offsets (Q4_1: m; Q4_0: -8 d).
inline __m128 pair_offsets(__m128 dm, const BlockFormat& f) {
  if (f.has_min) return _mm_shuffle_ps(dm, dm, _MM_SHUFFLE(3, 1, 3, 1));
  return _mm_mul_ps(_mm_set1_ps(-8.f), _mm_shuffle_ps(dm, dm, _MM_SHUFFLE(2, 0, 2, 0)));
}

// Two consecutive floats in lanes 0 and 1 (lanes 2 and 3 zero): one 8-byte load.
inline __m128 two_floats(const float* p) { return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))); }

// m0' dx0 sum0 + m1' dx1 sum1 of a row's two blocks, with the scalar form's one fused
// multiply-add (the rounding every path of this kernel shares).
inline float pair_offset(__m128 m, __m128 dx_pair, const float* sums) {
  const __m128 sum_pair = two_floats(sums);
  const __m128 scaled = _mm_mul_ps(m, dx_pair);
  const __m128 second = _mm_mul_ss(_mm_movehdup_ps(scaled), _mm_movehdup_ps(sum_pair));
  return _mm_cvtss_f32(_mm_fmadd_ss(scaled, sum_pair, second));
}

#ifdef KVFERRY_GGUF_AVX512
// The 32 nibble bytes of two Q4 blocks as 64 weights: each 128-bit lane one half of a block
// (block 0's low nibbles, its high ones, then block 1's), the order of the activations.
inline __m512i nibbles_of_two(const uint8_t* quants0, const uint8_t* quants1) {
  const __m256i packed = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(quants1),
                                             reinterpret_cast<const __m128i*>(quants0));
  const __m512i twice = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), _mm512_castsi256_si512(packed));
  const __m512i high_in_odd_lanes = _mm512_mask_blend_epi64(0xCC, twice, _mm512_srli_epi16(twice, 4));
  return _mm512_and_si512(high_in_odd_lanes, _mm512_set1_epi8(0x0F));
}
#endif

template <int R>
void avx2_row(const Operands& op, int64_t feature, int64_t first) {
  const uint8_t* row = op.weight + feature * op.blocks * op.format.bytes;
  const bool four_bit = op.format.four_bit;
  __m256 acc[R];
  float offsets[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), offsets[r] = 0.f;
  int64_t b = 0;
#ifdef KVFERRY_GGUF_AVX512
  // Two blocks per step: 64 weights against 64 activations, one scale per 256-bit half.
  // What depends on the weight alone (its 64 weights unpacked in one pass, d and m' of both
  // blocks from one conversion) is made once per step and shared by the rows; per row: the
  // integer dot (one VNNI instruction where the build has it), its two dx (one 8-byte load
  // spread over the halves), and the offsets of both blocks in 128-bit lanes. Every
  // product and sum is the scalar form's, rounded as before: a changed rounding of the
  // offsets moves int8 roundings of later layers' activations, and answers (the greedy
  // SmolLM2 answer to the looping ids of docs/benchmarks.md changed at its 2nd token).
  __m512 wide[R];
  for (int r = 0; r < R; ++r) wide[r] = _mm512_setzero_ps();
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  [[maybe_unused]] const __m512i ones = _mm512_set1_epi16(1);  // without VNNI
  const __m512i pick_d = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  for (; b + 1 < op.blocks; b += 2) {
    const uint8_t* block0 = row + b * op.format.bytes;
    const uint8_t* block1 = block0 + op.format.bytes;
    const __m512i w = four_bit ? nibbles_of_two(block0 + op.format.quants_at, block1 + op.format.quants_at)
                               : _mm512_inserti64x4(_mm512_castsi256_si512(load_block(block0 + op.format.quants_at, false)),
                                                    load_block(block1 + op.format.quants_at, false), 1);
    const __m128 dm = pair_scales(block0, block1);
    const __m512 d = _mm512_permutexvar_ps(pick_d, _mm512_castps128_ps512(dm));
    const __m128 m = pair_offsets(dm, op.format);
    const __m512i w_abs = four_bit ? w : _mm512_abs_epi8(w);
    const __mmask64 negative = four_bit ? 0 : _mm512_movepi8_mask(w);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (first + r) * op.blocks + b;
      __m512i x = _mm512_loadu_si512(op.x->q.data() + at * kBlock);
      if (!four_bit) x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
#ifdef __AVX512VNNI__
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w_abs, x);
#else
      const __m512i dot = _mm512_madd_epi16(_mm512_maddubs_epi16(w_abs, x), ones);
#endif
      const __m128 dx_pair = two_floats(&op.x->scale[at]);
      const __m512 dx = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(dx_pair));
      wide[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, dx), wide[r]);
      if (four_bit) offsets[r] += pair_offset(m, dx_pair, &op.x->sum[at]);
    }
  }
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_add_ps(_mm512_castps512_ps256(wide[r]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide[r]), 1)));
  }
#else
  // Two blocks per step as well, in two accumulators (even blocks, odd blocks) added at the
  // end: the 512-bit pass's lanes, products and sums exactly, so both builds give every
  // output the same bits; two independent chains of multiply-adds instead of one.
  __m256 odd[R];
  for (int r = 0; r < R; ++r) odd[r] = _mm256_setzero_ps();
  for (; b + 1 < op.blocks; b += 2) {
    const uint8_t* block0 = row + b * op.format.bytes;
    const uint8_t* block1 = block0 + op.format.bytes;
    const __m256i w0 = load_block(block0 + op.format.quants_at, four_bit);
    const __m256i w1 = load_block(block1 + op.format.quants_at, four_bit);
    const __m128 dm = pair_scales(block0, block1);
    const float d0 = _mm_cvtss_f32(dm), d1 = _mm_cvtss_f32(_mm_movehl_ps(dm, dm));
    const __m128 m = pair_offsets(dm, op.format);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (first + r) * op.blocks + b;
      const int8_t* x = op.x->q.data() + at * kBlock;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kBlock));
      const __m128 dx_pair = two_floats(&op.x->scale[at]);
      const float dx0 = _mm_cvtss_f32(dx_pair), dx1 = _mm_cvtss_f32(_mm_movehdup_ps(dx_pair));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(w0, x0, four_bit)), _mm256_set1_ps(d0 * dx0), acc[r]);
      odd[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(w1, x1, four_bit)), _mm256_set1_ps(d1 * dx1), odd[r]);
      if (four_bit) offsets[r] += pair_offset(m, dx_pair, &op.x->sum[at]);
    }
  }
  for (int r = 0; r < R; ++r) acc[r] = _mm256_add_ps(acc[r], odd[r]);
#endif
  for (; b < op.blocks; ++b) {
    const uint8_t* block = row + b * op.format.bytes;
    const __m256i w = load_block(block + op.format.quants_at, four_bit);
    float d, m;
    block_scales(block, op.format, d, m);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (first + r) * op.blocks + b;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(op.x->q.data() + at * kBlock));
      const float dx = op.x->scale[at];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(w, x, four_bit)), _mm256_set1_ps(d * dx), acc[r]);
      offsets[r] += m * dx * op.x->sum[at];
    }
  }
  for (int r = 0; r < R; ++r) op.out[(first + r) * op.features + feature] = horizontal_sum(acc[r]) + offsets[r];
}

void vector_row(const Operands& op, int64_t feature, int64_t first, int64_t count) {
  switch (count) {
    case 1: avx2_row<1>(op, feature, first); break;
    case 2: avx2_row<2>(op, feature, first); break;
    case 3: avx2_row<3>(op, feature, first); break;
    case 4: avx2_row<4>(op, feature, first); break;
    case 5: avx2_row<5>(op, feature, first); break;
    case 6: avx2_row<6>(op, feature, first); break;
    case 7: avx2_row<7>(op, feature, first); break;
    default: avx2_row<8>(op, feature, first); break;
  }
}

#endif  // KVFERRY_GGUF_AVX2

std::string compiled_path() {
#if defined(KVFERRY_GGUF_AVX512)
  return "avx512";
#elif defined(KVFERRY_GGUF_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

// x float32 [rows, in] times the weight's blocks uint8 [features, in / 32 * bytes per block]:
// float32 [rows, features]. `portable`: the scalar path even where a vector one was built.
at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, bool portable) {
  const BlockFormat format = format_of(qtype);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_matmul: x float32 [rows, in]");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf_matmul: blocks uint8 [out, bytes per row]");
  const at::Tensor rows = x.contiguous();
  const int64_t count = rows.size(0), in = rows.size(1), features = blocks.size(0);
  TORCH_CHECK(in % kBlock == 0, "gguf_matmul: inputs a multiple of 32");
  TORCH_CHECK(blocks.size(1) == in / kBlock * format.bytes, "gguf_matmul: ", blocks.size(1),
              " bytes per weight row for ", in, " inputs");
  at::Tensor out = at::empty({count, features}, rows.options());
  if (count == 0 || features == 0) return out;
  const QuantRows quantized = quantize_rows(rows.data_ptr<float>(), count, in);
  const Operands op{blocks.data_ptr<uint8_t>(), &quantized, out.data_ptr<float>(), count, in / kBlock, features, format};
  at::parallel_for(0, features, 16, [&](int64_t begin, int64_t end) {
    for (int64_t feature = begin; feature < end; ++feature) {
      for (int64_t first = 0; first < count; first += kMaxRows) {
        const int64_t turn = std::min(kMaxRows, count - first);
#ifdef KVFERRY_GGUF_AVX2
        if (!portable) {
          vector_row(op, feature, first, turn);
          continue;
        }
#endif
        portable_row(op, feature, first, turn);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvferry_cpu, m) {
  m.def("gguf_matmul_path() -> str", &compiled_path);  // no tensor: a catch-all kernel
  m.def("gguf_matmul(Tensor x, Tensor blocks, int qtype, bool portable) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvferry_cpu, CPU, m) { m.impl("gguf_matmul", &gguf_matmul); }
