// float32 x W^T + b on weights laid out as tiles of 16 output features, at any row count.
// Built and loaded at run time by kvferry/model/layers/float32_kernel.py.
//
// A decode step multiplies a few rows by every weight: its time is the weights' bytes over
// memory bandwidth. Here a tile's weights are one contiguous stream ([in, 16] floats), so
// each call reads the weight once, front to back, at the bandwidth two cores reach.
//
// The arithmetic is fixed: every output is sum_k x[k] * w[k] as fused multiply-adds in
// the order k = 0, 1, ..., in - 1 from zero, then + bias. No row, row count, thread count
// or instruction set changes it, so a row gets the same bits alone, beside 2,047 others,
// on an AVX2 machine and on an AVX-512 one (batch invariance: speculative decoding's
// verification and P/D's byte identity rest on it). The vector paths put output features
// in lanes and broadcast inputs, which keeps that order; the portable path is the same
// loop one lane at a time (std::fma), and the tests hold the vector paths to its bits.
//
// Layout (made by float32_kernel.tile): `tiles` float [t, in, 16] with t a multiple of 2;
// element (i, k, r) is W[16 i + r][k], zero for features past the weight's last.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "cpu_vec.h"

namespace {

constexpr int64_t kTile = 16;        // output features per tile
constexpr int64_t kRowBlock = 96;    // rows whose inputs stay in cache while every panel passes
constexpr int64_t kChunk = 16;       // inputs per row side by side in a packed block

// A packed row's length: its inputs rounded up to whole chunks.
int64_t padded_in(int64_t in) { return (in + kChunk - 1) / kChunk * kChunk; }

// Where one call's operands are.
struct Operands {
  const float* x;      // [rows, in]
  const float* tiles;  // [tiles, in, 16]
  const float* bias;   // [features] or nullptr
  float* out;          // [rows, features]
  int64_t in, features;
};

// ---- portable: the reference order, one output at a time --------------------------------

void portable_rows(const Operands& op, int64_t first, int64_t rows, int64_t tile) {
  const float* weights = op.tiles + tile * op.in * kTile;
  const int64_t valid = std::min(kTile, op.features - tile * kTile);
  for (int64_t m = first; m < first + rows; ++m) {
    const float* x = op.x + m * op.in;
    for (int64_t r = 0; r < valid; ++r) {
      float total = 0.0f;
      for (int64_t k = 0; k < op.in; ++k) total = std::fma(x[k], weights[k * kTile + r], total);
      const int64_t feature = tile * kTile + r;
      op.out[m * op.features + feature] = op.bias ? total + op.bias[feature] : total;
    }
  }
}

#if defined(KVFERRY_AVX512)
// ---- AVX-512: a panel of two tiles (two zmm of features) for up to 12 rows --------------

constexpr int64_t kPanelTiles = 2;
constexpr int kMaxRows = 12;  // 24 accumulators + 2 weights + 1 input of 32 registers
// 12 row pointers do not fit the general registers (the compiler spilled some): the rows
// are packed (pack_rows) and every input is read from one pointer.
constexpr bool kPacksRows = true;

template <int ROWS>
void panel(const Operands& op, const float* inputs, int64_t first, int64_t tile) {
  const float* w0 = op.tiles + tile * op.in * kTile;
  const float* w1 = w0 + op.in * kTile;
  __m512 low[ROWS], high[ROWS];
  for (int m = 0; m < ROWS; ++m) low[m] = high[m] = _mm512_setzero_ps();
  for (int64_t chunk = 0; chunk < op.in; chunk += kChunk) {
    const float* chunk_inputs = inputs + chunk * ROWS;
    const int64_t end = std::min(kChunk, op.in - chunk);
    for (int64_t j = 0; j < end; ++j) {
      const int64_t k = chunk + j;
      const __m512 a = _mm512_loadu_ps(w0 + k * kTile), b = _mm512_loadu_ps(w1 + k * kTile);
      for (int m = 0; m < ROWS; ++m) {
        const __m512 input = _mm512_set1_ps(chunk_inputs[m * kChunk + j]);
        low[m] = _mm512_fmadd_ps(input, a, low[m]);
        high[m] = _mm512_fmadd_ps(input, b, high[m]);
      }
    }
  }
  const int64_t feature = tile * kTile;
  const __mmask16 low_mask = kvferry_vec::lanes(op.features - feature);
  const __mmask16 high_mask = kvferry_vec::lanes(std::max<int64_t>(0, op.features - feature - kTile));
  __m512 bias_low = _mm512_setzero_ps(), bias_high = _mm512_setzero_ps();
  if (op.bias) {
    bias_low = _mm512_maskz_loadu_ps(low_mask, op.bias + feature);
    bias_high = _mm512_maskz_loadu_ps(high_mask, op.bias + feature + kTile);
  }
  for (int m = 0; m < ROWS; ++m) {
    float* out = op.out + (first + m) * op.features + feature;
    _mm512_mask_storeu_ps(out, low_mask, op.bias ? _mm512_add_ps(low[m], bias_low) : low[m]);
    if (high_mask) _mm512_mask_storeu_ps(out + kTile, high_mask, op.bias ? _mm512_add_ps(high[m], bias_high) : high[m]);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// ---- AVX2: a panel of one tile (two ymm of features) for up to 6 rows -------------------

constexpr int64_t kPanelTiles = 1;
constexpr int kMaxRows = 6;  // 12 accumulators + 2 weights + 1 input of 16 registers

// Six row pointers fit the general registers: the rows are read in place (packing them
// measured slower here, 3-15% by shape on an AVX-512 host held to AVX2).
constexpr bool kPacksRows = false;

template <int ROWS>
void panel(const Operands& op, const float*, int64_t first, int64_t tile) {
  const float* w = op.tiles + tile * op.in * kTile;
  const float* x = op.x + first * op.in;
  __m256 low[ROWS], high[ROWS];
  for (int m = 0; m < ROWS; ++m) low[m] = high[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < op.in; ++k) {
    const __m256 a = _mm256_loadu_ps(w + k * kTile), b = _mm256_loadu_ps(w + k * kTile + 8);
    for (int m = 0; m < ROWS; ++m) {
      const __m256 input = _mm256_set1_ps(x[m * op.in + k]);
      low[m] = _mm256_fmadd_ps(input, a, low[m]);
      high[m] = _mm256_fmadd_ps(input, b, high[m]);
    }
  }
  const int64_t feature = tile * kTile, valid = std::min(kTile, op.features - feature);
  for (int m = 0; m < ROWS; ++m) {
    alignas(32) float sums[kTile];
    _mm256_store_ps(sums, low[m]);
    _mm256_store_ps(sums + 8, high[m]);
    float* out = op.out + (first + m) * op.features + feature;
    for (int64_t r = 0; r < valid; ++r) out[r] = op.bias ? sums[r] + op.bias[feature + r] : sums[r];
  }
}

#else
#define KVFERRY_FLOAT32_PORTABLE_ONLY 1
constexpr int64_t kPanelTiles = 1;
constexpr int kMaxRows = 1;
constexpr bool kPacksRows = false;  // the portable loop reads the rows in place
#endif

#ifndef KVFERRY_FLOAT32_PORTABLE_ONLY
template <int... ROWS>
void panel_rows(const Operands& op, const float* inputs, int64_t first, int64_t rows, int64_t tile,
                std::integer_sequence<int, ROWS...>) {
  // panel<rows>: one template per row count up to kMaxRows
  ((rows == ROWS + 1 ? (panel<ROWS + 1>(op, inputs, first, tile), true) : false) || ...);
}
#endif

// A row block's inputs as the AVX-512 path reads them. Rows come in groups of up to kMaxRows,
// and a group's inputs in chunks of kChunk k: chunk c holds each row's x[., c .. c + 15]
// in turn ([rows of the group, kChunk]), so a panel finds every input it broadcasts at a
// fixed distance from one pointer instead of in rows far apart, and packing is a copy of
// 64-byte runs. Group g starts at g * padded_in(in). Where the inputs lie changes no sum:
// each output keeps its order over k. A block of one row is its own layout, read in place.
const float* pack_rows(const Operands& op, int64_t first, int64_t rows, float* packed) {
  if (rows == 1) return op.x + first * op.in;
  for (int64_t group = 0; group < rows; group += kMaxRows) {
    const int64_t count = std::min<int64_t>(kMaxRows, rows - group);
    float* out = packed + group * padded_in(op.in);
    for (int64_t chunk = 0; chunk < op.in; chunk += kChunk) {
      const int64_t width = std::min(kChunk, op.in - chunk);
      for (int64_t m = 0; m < count; ++m)
        std::memcpy(out + chunk * count + m * kChunk, op.x + (first + group + m) * op.in + chunk, width * sizeof(float));
    }
  }
  return packed;
}

// Rows [first, first + rows) against panel `p` (kPanelTiles tiles), in groups the
// registers hold; `inputs` is the block as pack_rows lays it out (where this build packs).
void rows_against_panel(const Operands& op, const float* inputs, int64_t first, int64_t rows, int64_t p,
                        bool portable) {
  const int64_t tile = p * kPanelTiles;
#ifndef KVFERRY_FLOAT32_PORTABLE_ONLY
  if (!portable) {
    for (int64_t group = 0; group < rows; group += kMaxRows) {
      const int64_t count = std::min<int64_t>(kMaxRows, rows - group);
      panel_rows(op, inputs + group * padded_in(op.in), first + group, count, tile,
                 std::make_integer_sequence<int, kMaxRows>{});
    }
    return;
  }
#endif
  const int64_t tiles = (op.features + kTile - 1) / kTile;
  for (int64_t t = tile; t < std::min(tile + kPanelTiles, tiles); ++t) portable_rows(op, first, rows, t);
}

// Rows [first, first + rows) against panels [begin, end), a row block at a time; each block
// packed first where this build packs (a copy of [block rows, in], small beside its
// multiply-adds).
void rows_against_panels(const Operands& op, int64_t first, int64_t rows, int64_t begin, int64_t end,
                         bool portable) {
  // Uninitialised (no zeroing pass): pack_rows writes every value a panel reads.
  const bool packs = kPacksRows && !portable;
  const int64_t size = rows > 1 ? std::min(kRowBlock, rows) * padded_in(op.in) : 0;
  const std::unique_ptr<float[]> packed(packs ? new float[size] : nullptr);
  for (int64_t block = first; block < first + rows; block += kRowBlock) {
    const int64_t count = std::min(kRowBlock, first + rows - block);
    const float* inputs = packs ? pack_rows(op, block, count, packed.get()) : nullptr;
    for (int64_t p = begin; p < end; ++p) rows_against_panel(op, inputs, block, count, p, portable);
  }
}

// One parallel region per call. Threads share the panels (each packs every row block for
// itself), or, for a weight of few panels and many rows, the rows (in whole register
// groups), so that no thread packs a block for only a few panels.
void matmul(const Operands& op, int64_t rows, bool portable) {
  const int64_t tiles = (op.features + kTile - 1) / kTile;
  const int64_t panels = (tiles + kPanelTiles - 1) / kPanelTiles;
  const int64_t threads = at::get_num_threads(), groups = (rows + kMaxRows - 1) / kMaxRows;
  if (panels < 4 * threads && groups >= 8 * threads) {
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      const int64_t first = begin * kMaxRows;
      rows_against_panels(op, first, std::min(rows, end * kMaxRows) - first, 0, panels, portable);
    });
    return;
  }
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    rows_against_panels(op, 0, rows, begin, end, portable);
  });
}

// x float [rows, in] times the tiled weight, + bias: float [rows, out_features].
// `portable`: the reference loop instead of the vector path (the same bits; for tests).
at::Tensor float32_matmul(const at::Tensor& x, const at::Tensor& tiles, const c10::optional<at::Tensor>& bias,
                          int64_t out_features, bool portable) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "float32_matmul: x float32 [rows, in]");
  TORCH_CHECK(tiles.scalar_type() == at::kFloat && tiles.is_contiguous() && tiles.dim() == 3 &&
                  tiles.size(2) == kTile && tiles.size(0) % 2 == 0, "float32_matmul: tiles float32 [2n, in, 16]");
  TORCH_CHECK(tiles.size(1) == x.size(1), "float32_matmul: x has ", x.size(1), " inputs, the weight ", tiles.size(1));
  TORCH_CHECK(out_features > 0 && out_features <= tiles.size(0) * kTile, "float32_matmul: out_features");
  const at::Tensor rows = x.contiguous();
  at::Tensor bias_values;
  if (bias.has_value() && bias->defined()) {
    bias_values = bias->contiguous();
    TORCH_CHECK(bias_values.scalar_type() == at::kFloat && bias_values.numel() == out_features,
                "float32_matmul: bias float32 [out_features]");
  }
  at::Tensor out = at::empty({rows.size(0), out_features}, rows.options());
  const Operands op{rows.data_ptr<float>(), tiles.data_ptr<float>(),
                    bias_values.defined() ? bias_values.data_ptr<float>() : nullptr, out.data_ptr<float>(),
                    rows.size(1), out_features};
  matmul(op, rows.size(0), portable);
  return out;
}

// Which path the library's vector code takes: "avx512", "avx2" or "portable".
std::string float32_matmul_isa() {
#if defined(KVFERRY_AVX512)
  return "avx512";
#elif !defined(KVFERRY_FLOAT32_PORTABLE_ONLY)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvferry_cpu, m) {
  m.def("float32_matmul_isa() -> str", &float32_matmul_isa);  // no tensor: a catch-all kernel
  m.def("float32_matmul(Tensor x, Tensor tiles, Tensor? bias, int out_features, bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvferry_cpu, CPU, m) { m.impl("float32_matmul", &float32_matmul); }
