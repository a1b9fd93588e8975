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
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

#if defined(KVFERRY_AVX512_BF16)
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

using kvferry_vec::load_bf16;

// Where one call's operands are: `rows` activation rows from `x`, results into `out`.
struct Operands {
  const uint8_t* packed;
  const at::BFloat16* scales;
  const at::BFloat16* zeros;
  const at::BFloat16* x;
  at::BFloat16* out;
  int64_t in, features;
};

// One tile of 16 output features for ROWS activation rows (x_pairs: each row's inputs as
// 32-bit words of two bf16 values; sums: each row's per-group input sums), rounded to bf16.
template <int ROWS>
void tile_matmul(const Operands& op, int64_t tile, const uint32_t* x_pairs, const float* sums, __m512i table) {
  const int64_t groups = op.in / kGroup, pairs = op.in / 2;
  const uint8_t* packed = op.packed + tile * pairs * kTile;
  const at::BFloat16* scales = op.scales + tile * groups * kTile;
  const at::BFloat16* zeros = op.zeros + tile * groups * kTile;
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
  for (int m = 0; m < ROWS; ++m) {
    const __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(total[m]));  // round to nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(op.out + m * op.features + tile * kTile), rounded);
  }
}

// ROWS rows (at most kMaxRows) against every tile, tiles split over the threads.
template <int ROWS>
void rows_matmul(const Operands& op) {
  std::vector<float> sums(ROWS * (op.in / kGroup));
  group_sums(op.x, ROWS, op.in, sums.data());
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(op.x);
  const __m512i table = nibble_table();
  at::parallel_for(0, op.features / kTile, 4, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) tile_matmul<ROWS>(op, tile, x_pairs, sums.data(), table);
  });
}

void chunk_matmul(const Operands& op, int64_t rows) {
  switch (rows) {
    case 1: rows_matmul<1>(op); break;
    case 2: rows_matmul<2>(op); break;
    case 3: rows_matmul<3>(op); break;
    case 4: rows_matmul<4>(op); break;
    case 5: rows_matmul<5>(op); break;
    case 6: rows_matmul<6>(op); break;
    case 7: rows_matmul<7>(op); break;
    default: rows_matmul<8>(op); break;
  }
}

#endif  // KVFERRY_INT4_FAST

// x bf16 [rows, in] times the packed weight: bf16 [rows, out] (fp32 sums rounded once),
// in calls of at most kMaxRows rows.
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& zeros) {
  TORCH_CHECK(int4_fast_supported(), "int4_matmul: built without AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "int4_matmul: x bf16 [rows, in]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3,
              "int4_matmul: packed uint8 [out / 16, in / 2, 16]");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  zeros.is_contiguous(), "int4_matmul: bf16 scales and zeros");
  const at::Tensor rows = x.contiguous();
  const int64_t count = rows.size(0), in = rows.size(1), features = packed.size(0) * kTile;
  TORCH_CHECK(in % kGroup == 0, "int4_matmul: inputs a multiple of 32");
  TORCH_CHECK(packed.numel() == features * in / 2 && scales.numel() == features * in / kGroup &&
                  zeros.numel() == scales.numel(), "int4_matmul: weight sizes");
  at::Tensor out = at::empty({count, features}, rows.options());
#ifdef KVFERRY_INT4_FAST
  for (int64_t first = 0; first < count; first += kMaxRows) {
    const Operands op{packed.data_ptr<uint8_t>(), scales.data_ptr<at::BFloat16>(), zeros.data_ptr<at::BFloat16>(),
                      rows.data_ptr<at::BFloat16>() + first * in, out.data_ptr<at::BFloat16>() + first * features,
                      in, features};
    chunk_matmul(op, std::min(kMaxRows, count - first));
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvferry_cpu, m) {
  m.def("int4_supported() -> bool", &int4_fast_supported);  // no tensor: a catch-all kernel
  m.def("int4_matmul(Tensor x, Tensor packed, Tensor scales, Tensor zeros) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvferry_cpu, CPU, m) { m.impl("int4_matmul", &int4_matmul); }
