// Weight-only int4 matmul for a few rows (decode) on CPUs with AVX-512 BF16. Built and
// loaded at run time by kvferry/model/layers/int4_kernel.py.
//
// A decode step at small batches reads every weight once per token: its time is the
// weights' bytes over memory bandwidth. Here each 4-bit weight is read as a nibble and
// turned into a bf16 value in registers (a 16-entry table lookup), never written back
// dequantized, and multiplied by the bf16 activations with `vdpbf16ps` (exact products,
// fp32 sums). Per group of 32 inputs the weights are w = q * scale + base (q in 0..15),
// so a group's contribution is scale * sum(q * x) + base * sum(x).
//
// Layout (made by int4_kernel.pack): 16 output features form a tile, one fp32 lane each.
// `packed` uint8 [out/16, in/2, 16]: byte (t, p, r) holds q[16t + r][2p] in its low
// nibble and q[16t + r][2p + 1] in its high one, so one 16-byte load gives the tile's
// next input pair. `scales`, `zeros` bf16 [out/16, in/32, 16]: w = (q - 8) * scale + zero
// (kvferry.model.layers.int4's quantization), i.e. base = zero - 8 * scale.
//
// Without AVX-512 BF16 at build time the operator reports itself unsupported and the
// Python side keeps torch's own int4 kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVFERRY_INT4_FAST 1
#endif

namespace {

constexpr int64_t kTile = 16;     // output features per tile (fp32 lanes of a zmm)
constexpr int64_t kGroup = 32;    // inputs per scale and base
constexpr int64_t kMaxRows = 8;   // activation rows of one call

bool int4_fast_supported() {
#ifdef KVFERRY_INT4_FAST
  return true;
#else
  return false;
#endif
}

// Sum of each row's inputs per group, from the bf16 values the products use.
void group_sums(const at::BFloat16* x, int64_t rows, int64_t in, float* sums) {
  const int64_t groups = in / kGroup;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.0f;
      for (int64_t i = 0; i < kGroup; ++i) total += static_cast<float>(x[m * in + g * kGroup + i]);
      sums[m * groups + g] = total;
    }
  }
}

#ifdef KVFERRY_INT4_FAST

// bf16 bit patterns of 0..15 (twice: vpermw indexes 32 lanes).
__m512i nibble_table() {
  alignas(64) uint16_t table[32];
  for (int k = 0; k < 32; ++k) {
    const float value = static_cast<float>(k & 15);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    table[k] = static_cast<uint16_t>(bits >> 16);  // exact: small integers fit bf16
  }
  return _mm512_load_si512(table);
}

// 16 bytes (one per tile row: the pair's low and high nibbles) -> 16 lanes of bf16 pairs.
inline __m512i unpack_pair(const uint8_t* bytes, __m512i table) {
  const __m512i words = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i low = _mm512_and_si512(words, _mm512_set1_epi32(0xF));
  const __m512i high = _mm512_slli_epi32(_mm512_srli_epi32(words, 4), 16);
  return _mm512_permutexvar_epi16(_mm512_or_si512(low, high), table);
}

// 16 bf16 values as fp32 (bf16 is the high half of an fp32).
inline __m512 load_bf16(const at::BFloat16* values) {
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}

// One tile of 16 output features for ROWS activation rows; x_pairs: each row's inputs as
// 32-bit words of two bf16 values.
template <int ROWS>
void tile_matmul(const uint8_t* packed, const at::BFloat16* scales, const at::BFloat16* zeros,
                 const uint32_t* x_pairs,
                 const float* sums, int64_t in, float* out, int64_t out_stride, __m512i table) {
  const int64_t groups = in / kGroup, pairs = in / 2;
  __m512 total[ROWS];
  for (int m = 0; m < ROWS; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 dot[ROWS];
    for (int m = 0; m < ROWS; ++m) dot[m] = _mm512_setzero_ps();
    for (int64_t p = g * kGroup / 2; p < (g + 1) * kGroup / 2; ++p) {
      const __m512bh weights = reinterpret_cast<__m512bh>(unpack_pair(packed + p * kTile, table));
      for (int m = 0; m < ROWS; ++m) {
        const __m512bh inputs = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x_pairs[m * pairs + p]));
        dot[m] = _mm512_dpbf16_ps(dot[m], weights, inputs);
      }
    }
    const __m512 scale = load_bf16(scales + g * kTile);
    const __m512 base = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, load_bf16(zeros + g * kTile));
    for (int m = 0; m < ROWS; ++m) {
      total[m] = _mm512_fmadd_ps(dot[m], scale, total[m]);
      total[m] = _mm512_fmadd_ps(base, _mm512_set1_ps(sums[m * groups + g]), total[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(out + m * out_stride, total[m]);
}

template <int ROWS>
void all_tiles(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
               at::Tensor& out) {
  const int64_t in = x.size(1), features = out.size(1), tiles = features / kTile, groups = in / kGroup;
  std::vector<float> sums(ROWS * groups);
  group_sums(x.data_ptr<at::BFloat16>(), ROWS, in, sums.data());
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  const at::BFloat16* scale = scales.data_ptr<at::BFloat16>();
  const at::BFloat16* zero = zeros.data_ptr<at::BFloat16>();
  float* result = out.data_ptr<float>();
  const __m512i table = nibble_table();
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      tile_matmul<ROWS>(weights + t * (in / 2) * kTile, scale + t * groups * kTile, zero + t * groups * kTile,
                        x_pairs, sums.data(), in, result + t * kTile, features, table);
    }
  });
}

#endif  // KVFERRY_INT4_FAST

// x bf16 [rows, in] (rows <= kMaxRows) times the packed weight into out fp32 [rows, out].
void int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                 at::Tensor& out) {
  TORCH_CHECK(int4_fast_supported(), "int4_matmul: built without AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() == 2, "int4_matmul: x bf16 [rows, in]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "int4_matmul: packed uint8");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  zeros.is_contiguous(), "int4_matmul: bf16 scales and zeros");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "int4_matmul: fp32 out");
  const int64_t rows = x.size(0), in = x.size(1), features = out.size(1);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows && out.size(0) == rows, "int4_matmul: 1 to 8 rows");
  TORCH_CHECK(in % kGroup == 0 && features % kTile == 0, "int4_matmul: in % 32, out % 16");
  TORCH_CHECK(packed.numel() == features * in / 2 && scales.numel() == features * in / kGroup &&
                  zeros.numel() == scales.numel(), "int4_matmul: weight sizes");
#ifdef KVFERRY_INT4_FAST
  switch (rows) {
    case 1: all_tiles<1>(x, packed, scales, zeros, out); break;
    case 2: all_tiles<2>(x, packed, scales, zeros, out); break;
    case 3: all_tiles<3>(x, packed, scales, zeros, out); break;
    case 4: all_tiles<4>(x, packed, scales, zeros, out); break;
    case 5: all_tiles<5>(x, packed, scales, zeros, out); break;
    case 6: all_tiles<6>(x, packed, scales, zeros, out); break;
    case 7: all_tiles<7>(x, packed, scales, zeros, out); break;
    default: all_tiles<8>(x, packed, scales, zeros, out); break;
  }
#endif
}

}  // namespace

TORCH_LIBRARY(kvferry_int4, m) {
  m.def("supported() -> bool", &int4_fast_supported);  // no tensor: a catch-all kernel
  m.def("matmul(Tensor x, Tensor packed, Tensor scales, Tensor zeros, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvferry_int4, CPU, m) { m.impl("matmul", &int4_matmul); }
