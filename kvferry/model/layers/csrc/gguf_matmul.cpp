// GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) times a few float32 rows, multiplied in
// integers. Built and loaded at run time by kvferry/model/layers/gguf_kernel.py
// (--quantization gguf).
//
// The file's weight rows are `in / 32` blocks of 32 weights each:
//   Q4_0: fp16 d, 16 bytes of nibbles            w = d * (q - 8)
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles    w = d * q + m
//   Q8_0: fp16 d, 32 int8                        w = d * q
// (nibbles: the low ones are elements 0-15, the high ones 16-31).
//
// `gguf_pack` rearranges them once, at load, into tiles of 16 output rows (kTile): per tile
// and block, the 16 rows' d as fp16, their offsets m' (m for Q4_1, -8 d for Q4_0, exact in
// fp16) and their quants interleaved so that one vector holds 4 consecutive weights of each
// of the 16 rows (a 32-bit lane per row). A batch-1 product then takes each weight once,
// against 4 activations broadcast to every lane, with one multiply-add instruction per 64
// weights: no horizontal sums, and scales for 16 rows from one conversion. The tile takes the
// file's bytes per weight (Q4: 5 bits, Q8_0: 8.5).
//
// Each activation row is first quantized per block of 32 to int8 (dx = max|x| / 127,
// qx = round-to-nearest-even(x / dx)); per output, per block, in block order:
//   dot = sum(q * qx)                         exact, in int32
//   acc = fma(float(dot), d * dx, acc)        d * dx rounded to float first
//   off = fma(m', dx * sum(qx), off)          Q4 only; dx * sum(qx) rounded to float first
// and the output is acc + off. The activation rounding (at most dx / 2 per input) is the only
// difference from the dequantized float reference.
//
// Paths, chosen when the library is built for an instruction-set level (cpu_kernels):
// AVX-512 BW (16 rows a vector; `vpdpbusd` where the build has VNNI, else `vpmaddubsw` and
// `vpmaddwd`: the same integer sums), AVX2 (a tile as two halves of 8 rows), and a portable
// scalar one, which a caller can also force (`portable`) to test it anywhere. All three
// compute every output with the operations above in the same order: the same bits from any
// build and either path. Tiles are split over the threads (at::parallel_for); activation
// rows are taken in turns of up to kMaxRows per tile. A row's result does not depend on the
// rows beside it: batch-invariant, as speculative decoding's exactness needs
// (kvferry/spec_decode).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
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

constexpr int64_t kBlock = 32;  // weights per block
constexpr int64_t kTile = 16;   // output rows per tile
constexpr int64_t kGroups = kBlock / 4;  // 4-weight groups per block: one 32-bit lane each
// Activation rows per pass over a tile's weights: as many as the vector registers hold
// accumulators for beside the tile's weights (AVX-512: 32 registers; AVX2: 16).
#ifdef KVFERRY_GGUF_AVX512
constexpr int64_t kMaxRows = 8;
#else
constexpr int64_t kMaxRows = 4;
#endif
// gguf.GGMLQuantizationType values
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

struct BlockFormat {
  int64_t bytes;      // per block in the file
  int64_t quants_at;  // where the quants start in a file block
  bool four_bit;
  bool has_min;       // Q4_1
};

BlockFormat format_of(int64_t qtype) {
  if (qtype == kQ4_0) return {18, 2, true, false};
  if (qtype == kQ4_1) return {20, 4, true, true};
  TORCH_CHECK(qtype == kQ8_0, "gguf_matmul: block type ", qtype, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  return {34, 2, false, false};
}

// One tile's block: fp16 d [16], (Q4) fp16 m' [16], quants. Q4: 4 vectors of 64 bytes, byte
// 4 j + i of vector v holding row j's weights 8 v + i (low nibble) and 8 v + 4 + i (high);
// Q8_0: 8 vectors, byte 4 j + i of vector g holding row j's weight 4 g + i.
struct TileFormat {
  int64_t offsets_at, quants_at, bytes;
};

TileFormat tile_format(const BlockFormat& f) {
  if (f.four_bit) return {2 * kTile, 4 * kTile, 4 * kTile + kTile * kBlock / 2};
  return {0, 2 * kTile, 2 * kTile + kTile * kBlock};
}

uint16_t half_bits(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// A file block's 32 weights as the integers q it stores (Q4: 0..15, Q8_0: -128..127).
void decode_block(const uint8_t* quants, bool four_bit, int8_t* q) {
  if (!four_bit) {
    std::memcpy(q, quants, kBlock);
    return;
  }
  for (int64_t i = 0; i < kBlock / 2; ++i) {
    q[i] = static_cast<int8_t>(quants[i] & 0x0F);
    q[i + kBlock / 2] = static_cast<int8_t>(quants[i] >> 4);
  }
}

// Row j of the file's blocks (one block) into its place in a tile's block.
void pack_row(const uint8_t* block, const BlockFormat& f, const TileFormat& tf, int64_t j, uint8_t* tile) {
  const uint16_t d = half_bits(block);
  std::memcpy(tile + 2 * j, &d, 2);
  if (f.four_bit) {
    const uint16_t offset = f.has_min ? half_bits(block + 2) : c10::Half(-8.f * half_to_float(d)).x;
    std::memcpy(tile + tf.offsets_at + 2 * j, &offset, 2);
  }
  int8_t q[kBlock];
  decode_block(block + f.quants_at, f.four_bit, q);
  uint8_t* quants = tile + tf.quants_at;
  for (int64_t g = 0; g < kGroups; ++g) {
    for (int64_t i = 0; i < 4; ++i) {
      const uint8_t value = static_cast<uint8_t>(q[4 * g + i]);
      if (!f.four_bit) {
        quants[g * 64 + 4 * j + i] = value;
      } else if (g % 2 == 0) {
        quants[(g / 2) * 64 + 4 * j + i] |= value;
      } else {
        quants[(g / 2) * 64 + 4 * j + i] |= static_cast<uint8_t>(value << 4);
      }
    }
  }
}

// The file's blocks uint8 [out, in / 32 * bytes per block] as tiles: uint8 [tiles, blocks,
// tile bytes]; rows past `out` in the last tile are zero (they add nothing, and are not
// written out).
at::Tensor gguf_pack(const at::Tensor& blocks, int64_t qtype) {
  const BlockFormat f = format_of(qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf_pack: blocks uint8 [out, bytes per row]");
  TORCH_CHECK(blocks.size(1) % f.bytes == 0, "gguf_pack: ", blocks.size(1), " bytes a row is not whole blocks");
  const TileFormat tf = tile_format(f);
  const int64_t out = blocks.size(0), count = blocks.size(1) / f.bytes, tiles = (out + kTile - 1) / kTile;
  at::Tensor packed = at::zeros({tiles, count, tf.bytes}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t j = 0; j < kTile && t * kTile + j < out; ++j)
        for (int64_t b = 0; b < count; ++b)
          pack_row(src + ((t * kTile + j) * count + b) * f.bytes, f, tf, j, dst + (t * count + b) * tf.bytes);
  });
  return packed;
}

// Quantized activation rows: int8 values, per block the scale dx and dx * sum(qx).
struct QuantRows {
  std::vector<int8_t> q;       // [rows, in]
  std::vector<float> scale;    // [rows, blocks]
  std::vector<float> offset;   // [rows, blocks]: dx * sum(qx), rounded once
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
    out.offset[b] = d * static_cast<float>(total);
  }
  return out;
}

struct Operands {
  const uint8_t* tiles;  // [tiles, blocks, tile bytes]
  const QuantRows* x;
  float* out;            // [rows, features]
  int64_t blocks, features;
  BlockFormat format;
  TileFormat tile;

  const uint8_t* tile_block(int64_t t, int64_t b) const { return tiles + (t * blocks + b) * tile.bytes; }
  const int8_t* row_block(int64_t row, int64_t b) const { return x->q.data() + (row * blocks + b) * kBlock; }
  // Where a tile's outputs go in an output row, and how many of its 16 rows are real.
  int64_t width(int64_t t) const { return std::min(kTile, features - t * kTile); }
};

// One row's quant q of row j, weight k, in a tile's block.
int32_t tile_quant(const uint8_t* quants, bool four_bit, int64_t j, int64_t k) {
  const int64_t g = k / 4, i = k % 4;
  if (!four_bit) return static_cast<int8_t>(quants[g * 64 + 4 * j + i]);
  const uint8_t byte = quants[(g / 2) * 64 + 4 * j + i];
  return g % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
}

void portable_tile(const Operands& op, int64_t t, int64_t first, int64_t count) {
  const bool four_bit = op.format.four_bit;
  for (int64_t r = first; r < first + count; ++r) {
    float acc[kTile] = {}, off[kTile] = {};
    for (int64_t b = 0; b < op.blocks; ++b) {
      const uint8_t* tile = op.tile_block(t, b);
      const int8_t* x = op.row_block(r, b);
      const float dx = op.x->scale[r * op.blocks + b], sx = op.x->offset[r * op.blocks + b];
      for (int64_t j = 0; j < kTile; ++j) {
        int32_t dot = 0;
        for (int64_t k = 0; k < kBlock; ++k) dot += tile_quant(tile + op.tile.quants_at, four_bit, j, k) * x[k];
        const float scale = half_to_float(half_bits(tile + 2 * j)) * dx;
        acc[j] = std::fma(static_cast<float>(dot), scale, acc[j]);
        if (four_bit) off[j] = std::fma(half_to_float(half_bits(tile + op.tile.offsets_at + 2 * j)), sx, off[j]);
      }
    }
    for (int64_t j = 0; j < op.width(t); ++j) op.out[r * op.features + t * kTile + j] = acc[j] + off[j];
  }
}

#ifdef KVFERRY_GGUF_AVX512

// 16 rows' 4-weight dot products with 4 activations broadcast to every lane, added to `sum`.
// w: unsigned (Q4 nibbles, or |q| of Q8_0); x: signed (for Q8_0 negated where q < 0).
inline __m512i dot_add(__m512i sum, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(sum, w, x);
#else
  return _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
}

inline __m512i group_of(const int8_t* x, int64_t g) {
  int32_t four;
  std::memcpy(&four, x + 4 * g, 4);
  return _mm512_set1_epi32(four);
}

template <int R>
void avx512_tile(const Operands& op, int64_t t, int64_t first) {
  const bool four_bit = op.format.four_bit;
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), off[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < op.blocks; ++b) {
    const uint8_t* tile = op.tile_block(t, b);
    const uint8_t* quants = tile + op.tile.quants_at;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile)));
    __m512i w[kGroups];
    __mmask64 negative[kGroups];
    for (int64_t g = 0; g < kGroups; ++g) {
      if (four_bit) {
        const __m512i packed = _mm512_loadu_si512(quants + (g / 2) * 64);
        w[g] = g % 2 == 0 ? _mm512_and_si512(packed, low) : _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      } else {
        const __m512i q = _mm512_loadu_si512(quants + g * 64);
        negative[g] = _mm512_movepi8_mask(q);
        w[g] = _mm512_abs_epi8(q);
      }
    }
    const __m512 m = four_bit ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(tile + op.tile.offsets_at)))
                              : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t row = first + r;
      const int8_t* x = op.row_block(row, b);
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      for (int64_t g = 0; g < kGroups; g += 2) {
        __m512i x0 = group_of(x, g), x1 = group_of(x, g + 1);
        if (!four_bit) {
          x0 = _mm512_mask_sub_epi8(x0, negative[g], _mm512_setzero_si512(), x0);
          x1 = _mm512_mask_sub_epi8(x1, negative[g + 1], _mm512_setzero_si512(), x1);
        }
        even = dot_add(even, w[g], x0);
        odd = dot_add(odd, w[g + 1], x1);
      }
      const __m512i dot = _mm512_add_epi32(even, odd);
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(op.x->scale[row * op.blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
      if (four_bit) off[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(op.x->offset[row * op.blocks + b]), off[r]);
    }
  }
  const __mmask16 lanes = static_cast<__mmask16>((1u << op.width(t)) - 1);
  for (int r = 0; r < R; ++r)
    _mm512_mask_storeu_ps(op.out + (first + r) * op.features + t * kTile, lanes, _mm512_add_ps(acc[r], off[r]));
}

#define KVFERRY_GGUF_VECTOR_TILE avx512_tile

#elif defined(KVFERRY_GGUF_AVX2)

inline __m256i dot_add(__m256i sum, __m256i w, __m256i x) {
  return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

inline __m256i group_of(const int8_t* x, int64_t g) {
  int32_t four;
  std::memcpy(&four, x + 4 * g, 4);
  return _mm256_set1_epi32(four);
}

// One half (8 rows) of a tile: the 512-bit pass's lanes, products and sums.
template <int R>
void avx2_half(const Operands& op, int64_t t, int64_t half, int64_t first, float* results) {
  const bool four_bit = op.format.four_bit;
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), off[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < op.blocks; ++b) {
    const uint8_t* tile = op.tile_block(t, b);
    const uint8_t* quants = tile + op.tile.quants_at + 32 * half;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16 * half)));
    __m256i w[kGroups];
    for (int64_t g = 0; g < kGroups; ++g) {
      if (four_bit) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + (g / 2) * 64));
        w[g] = g % 2 == 0 ? _mm256_and_si256(packed, low) : _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      } else {
        w[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + g * 64));  // signed q
      }
    }
    const __m256 m = four_bit ? _mm256_cvtph_ps(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(tile + op.tile.offsets_at + 16 * half)))
                              : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t row = first + r;
      const int8_t* x = op.row_block(row, b);
      __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
      for (int64_t g = 0; g < kGroups; g += 2) {
        const __m256i x0 = group_of(x, g), x1 = group_of(x, g + 1);
        if (four_bit) {
          even = dot_add(even, w[g], x0);
          odd = dot_add(odd, w[g + 1], x1);
        } else {  // |q| times x with q's sign
          even = dot_add(even, _mm256_sign_epi8(w[g], w[g]), _mm256_sign_epi8(x0, w[g]));
          odd = dot_add(odd, _mm256_sign_epi8(w[g + 1], w[g + 1]), _mm256_sign_epi8(x1, w[g + 1]));
        }
      }
      const __m256i dot = _mm256_add_epi32(even, odd);
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(op.x->scale[row * op.blocks + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
      if (four_bit) off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(op.x->offset[row * op.blocks + b]), off[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(results + r * kTile + 8 * half, _mm256_add_ps(acc[r], off[r]));
}

template <int R>
void avx2_tile(const Operands& op, int64_t t, int64_t first) {
  float results[R * kTile];
  avx2_half<R>(op, t, 0, first, results);
  if (op.width(t) > 8) avx2_half<R>(op, t, 1, first, results);
  for (int r = 0; r < R; ++r)
    std::memcpy(op.out + (first + r) * op.features + t * kTile, results + r * kTile, op.width(t) * sizeof(float));
}

#define KVFERRY_GGUF_VECTOR_TILE avx2_tile

#endif

#ifdef KVFERRY_GGUF_VECTOR_TILE
void vector_tile(const Operands& op, int64_t t, int64_t first, int64_t count) {
  switch (count) {
    case 1: KVFERRY_GGUF_VECTOR_TILE<1>(op, t, first); break;
    case 2: KVFERRY_GGUF_VECTOR_TILE<2>(op, t, first); break;
    case 3: KVFERRY_GGUF_VECTOR_TILE<3>(op, t, first); break;
#ifdef KVFERRY_GGUF_AVX512
    case 4: KVFERRY_GGUF_VECTOR_TILE<4>(op, t, first); break;
    case 5: KVFERRY_GGUF_VECTOR_TILE<5>(op, t, first); break;
    case 6: KVFERRY_GGUF_VECTOR_TILE<6>(op, t, first); break;
    case 7: KVFERRY_GGUF_VECTOR_TILE<7>(op, t, first); break;
    default: KVFERRY_GGUF_VECTOR_TILE<8>(op, t, first); break;
#else
    default: KVFERRY_GGUF_VECTOR_TILE<4>(op, t, first); break;
#endif
  }
}
#endif

std::string compiled_path() {
#if defined(KVFERRY_GGUF_AVX512)
  return "avx512";
#elif defined(KVFERRY_GGUF_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

// x float32 [rows, in] times the weight's tiles (gguf_pack) of `features` outputs: float32
// [rows, features]. `portable`: the scalar path even where a vector one was built.
at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& tiles, int64_t qtype, int64_t features, bool portable) {
  const BlockFormat format = format_of(qtype);
  const TileFormat tile = tile_format(format);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_matmul: x float32 [rows, in]");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 3 && tiles.is_contiguous() &&
                  tiles.size(2) == tile.bytes,
              "gguf_matmul: tiles uint8 [tiles, blocks, ", tile.bytes, "] (gguf_pack)");
  const at::Tensor rows = x.contiguous();
  const int64_t count = rows.size(0), in = rows.size(1);
  TORCH_CHECK(in % kBlock == 0, "gguf_matmul: inputs a multiple of 32");
  TORCH_CHECK(tiles.size(1) == in / kBlock, "gguf_matmul: ", tiles.size(1), " blocks a row for ", in, " inputs");
  TORCH_CHECK(features > 0 && (features + kTile - 1) / kTile == tiles.size(0), "gguf_matmul: ", features,
              " outputs in ", tiles.size(0), " tiles");
  at::Tensor out = at::empty({count, features}, rows.options());
  if (count == 0) return out;
  const QuantRows quantized = quantize_rows(rows.data_ptr<float>(), count, in);
  const Operands op{tiles.data_ptr<uint8_t>(), &quantized, out.data_ptr<float>(), in / kBlock, features, format, tile};
  at::parallel_for(0, tiles.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t first = 0; first < count; first += kMaxRows) {
        const int64_t turn = std::min(kMaxRows, count - first);
#ifdef KVFERRY_GGUF_VECTOR_TILE
        if (!portable) {
          vector_tile(op, t, first, turn);
          continue;
        }
#endif
        portable_tile(op, t, first, turn);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvferry_cpu, m) {
  m.def("gguf_matmul_path() -> str", &compiled_path);  // no tensor: a catch-all kernel
  m.def("gguf_pack(Tensor blocks, int qtype) -> Tensor");
  m.def("gguf_matmul(Tensor x, Tensor tiles, int qtype, int features, bool portable) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvferry_cpu, CPU, m) {
  m.impl("gguf_pack", &gguf_pack);
  m.impl("gguf_matmul", &gguf_matmul);
}
