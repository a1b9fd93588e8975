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
#include <string>

#include "cpu_vec.h"

namespace {

constexpr int64_t kTile = 16;        // output features per tile
constexpr int64_t kRowBlock = 96;    // rows whose inputs stay in cache while every panel passes

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
// ---- AVX-512: a panel of two tiles (two zmm of features) for up to 6 rows ---------------

constexpr int64_t kPanelTiles = 2;
// 12 accumulators + 2 weights + 1 input; six rows' pointers also fit the general registers
// (with 12 rows the compiler spilled some, and a step took 5-10% longer; 8 rows: 2-4%).
constexpr int kMaxRows = 6;

template <int ROWS>
void panel(const Operands& op, int64_t first, int64_t tile) {
  const float* w0 = op.tiles + tile * op.in * kTile;
  const float* w1 = w0 + op.in * kTile;
  const float* x = op.x + first * op.in;
  __m512 low[ROWS], high[ROWS];
  for (int m = 0; m < ROWS; ++m) low[m] = high[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < op.in; ++k) {
    const __m512 a = _mm512_loadu_ps(w0 + k * kTile), b = _mm512_loadu_ps(w1 + k * kTile);
    for (int m = 0; m < ROWS; ++m) {
      const __m512 input = _mm512_set1_ps(x[m * op.in + k]);
      low[m] = _mm512_fmadd_ps(input, a, low[m]);
      high[m] = _mm512_fmadd_ps(input, b, high[m]);
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

template <int ROWS>
void panel(const Operands& op, int64_t first, int64_t tile) {
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
constexpr int kMaxRows = 1;  // the work is shared among threads in groups of this many rows
#endif

#ifndef KVFERRY_FLOAT32_PORTABLE_ONLY
template <int... ROWS>
void panel_rows(const Operands& op, int64_t first, int64_t rows, int64_t tile, std::integer_sequence<int, ROWS...>) {
  // panel<rows>: one template per row count up to kMaxRows
  ((rows == ROWS + 1 ? (panel<ROWS + 1>(op, first, tile), true) : false) || ...);
}
#endif

// Rows [first, first + rows) against panel `p` (kPanelTiles tiles), in groups the
// registers hold.
void rows_against_panel(const Operands& op, int64_t first, int64_t rows, int64_t p, bool portable) {
  const int64_t tile = p * kPanelTiles;
#ifndef KVFERRY_FLOAT32_PORTABLE_ONLY
  if (!portable) {
    for (int64_t group = first; group < first + rows; group += kMaxRows) {
      const int64_t count = std::min<int64_t>(kMaxRows, first + rows - group);
      panel_rows(op, group, count, tile, std::make_integer_sequence<int, kMaxRows>{});
    }
    return;
  }
#endif
  const int64_t tiles = (op.features + kTile - 1) / kTile;
  for (int64_t t = tile; t < std::min(tile + kPanelTiles, tiles); ++t) portable_rows(op, first, rows, t);
}

// Rows [first, first + rows) against panels [begin, end), a row block at a time.
void rows_against_panels(const Operands& op, int64_t first, int64_t rows, int64_t begin, int64_t end,
                         bool portable) {
  for (int64_t block = first; block < first + rows; block += kRowBlock) {
    const int64_t count = std::min(kRowBlock, first + rows - block);
    for (int64_t p = begin; p < end; ++p) rows_against_panel(op, block, count, p, portable);
  }
}

// One parallel region per call. Threads share the panels, or, for a weight of fewer panels
// than can keep every thread busy and many rows, the rows (in whole register groups).
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
