// One Llama-family decoder layer for a decode step, in one operator call: the residual add
// and RMSNorm, the fused q/k/v projection, rotate-half rope, the KV write, paged decode
// attention, the output projection, the second residual add and RMSNorm, the gated SiLU MLP.
// Built and loaded at run time by kvferry/model/layers/fused_decode.py (float32 models, and
// --quantization gguf).
//
// A batch-1 decode step of a small model spends as long between its matmuls as in them when
// each of a layer's ~20 operators is dispatched from Python one after another; here the
// elementwise work is plain loops over a few rows, and the projections and the attention are
// the kernel library's own operators (kvferry_cpu::float32_matmul or gguf_matmul, write_kv,
// paged_decode), called through the dispatcher: their arithmetic is the one the unfused
// layer runs.
//
// Every row is computed on its own (norms, rope and activation per row; the matmul and
// attention kernels are batch-invariant), so a row's result does not depend on the rows
// beside it (speculative decoding's verification rows, kvferry/spec_decode). The norms sum
// their squares in double: the same result whatever vector width a build uses.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "cpu_vec.h"

namespace {

using GGUFMatmul = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool);
using Float32Matmul = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t, bool);
using WriteKV = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                     int64_t, int64_t, int64_t);
using PagedDecode = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, double);

// The kernel library's operator `name`, looked up on first use (its library is loaded
// first, by fused_decode.py: a float32 model's layers never load the GGUF kernel, nor a
// GGUF model's the float32 one).
template <typename Signature>
c10::TypedOperatorHandle<Signature> kernel_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

const c10::TypedOperatorHandle<GGUFMatmul>& gguf_matmul_op() {
  static const auto op = kernel_op<GGUFMatmul>("kvferry_cpu::gguf_matmul");
  return op;
}

const c10::TypedOperatorHandle<Float32Matmul>& float32_matmul_op() {
  static const auto op = kernel_op<Float32Matmul>("kvferry_cpu::float32_matmul");
  return op;
}

const c10::TypedOperatorHandle<WriteKV>& write_kv_op() {
  static const auto op = kernel_op<WriteKV>("kvferry_cpu::write_kv");
  return op;
}

const c10::TypedOperatorHandle<PagedDecode>& paged_decode_op() {
  static const auto op = kernel_op<PagedDecode>("kvferry_cpu::paged_decode");
  return op;
}

// Rows a thread takes at least in the elementwise loops: a decode step's few rows stay on
// one thread, a prefill chunk's are split. Each row is computed alike on any thread.
constexpr int64_t kRowGrain = 16;

// The `type` of a weight held as float32 tiles (float32_kernel.tile): GGML's type id of F32.
constexpr int64_t kFloat32Tiles = 0;

// A weight as a kernel's tiles: float32 ones (type kFloat32Tiles), or GGUF blocks (gguf_pack,
// type: the block type); and its outputs.
struct Blocks {
  const at::Tensor& tiles;
  int64_t type, features;
};

at::Tensor project(const at::Tensor& rows, const Blocks& weight, const std::optional<at::Tensor>& bias) {
  if (weight.type == kFloat32Tiles)  // the bias added as the unfused float32 linear adds it
    return float32_matmul_op().call(rows, weight.tiles, bias, weight.features, false);
  at::Tensor out = gguf_matmul_op().call(rows, weight.tiles, weight.type, weight.features, false);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out.size(1),
                "decode_layer: a float32 bias per output");
    float* o = out.data_ptr<float>();
    const float* b = bias->data_ptr<float>();
    for (int64_t r = 0; r < out.size(0); ++r)
      for (int64_t i = 0; i < out.size(1); ++i) o[r * out.size(1) + i] += b[i];
  }
  return out;
}

// residual += hidden in place (`add` false: residual already holds the sum), and the normed
// sum weight * x / rms(x) as a new tensor.
at::Tensor add_and_norm(const at::Tensor& hidden, at::Tensor& residual, bool add, const at::Tensor& weight,
                        double eps) {
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  at::Tensor normed = at::empty_like(hidden);
  const float* h = hidden.data_ptr<float>();
  float* res = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* out = normed.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = res + r * width;
      double squares = 0.0;
      for (int64_t i = 0; i < width; ++i) {
        if (add) x[i] += h[r * width + i];
        squares += static_cast<double>(x[i]) * x[i];
      }
      const float inverse = static_cast<float>(1.0 / std::sqrt(squares / width + eps));
      for (int64_t i = 0; i < width; ++i) out[r * width + i] = x[i] * inverse * w[i];
    }
  });
  return normed;
}

// Rotate-half rope of `heads` heads of `dim` values starting at `first` in each row of x.
// cos and sin [rows, 1, dim / 2] (any row stride, values contiguous).
void rotate(at::Tensor& x, int64_t first, int64_t heads, int64_t dim, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = dim / 2, stride = x.size(1);
  float* base = x.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos.data_ptr<float>() + r * cos.stride(0);
      const float* s = sin.data_ptr<float>() + r * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        float* v = base + r * stride + (first + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = v[i], x2 = v[i + half];
          v[i] = x1 * c[i] - x2 * s[i];
          v[i + half] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}

// silu(g) * up = g * sigmoid(g) * up, with sigmoid from e = e^-|g| (never overflows):
// 1 / (1 + e) for g >= 0, e / (1 + e) below. e^x for x in [-87, 0]: 2^n e^r, n = round(x /
// ln 2), r = x - n ln 2 (ln 2 in two parts), e^r by its Taylor series to r^7 (within 1e-8),
// 2^n exact (the results stay normal: x is held at -87). The AVX-512, AVX2 and scalar
// forms below do these operations alike, so every build gives every lane the same bits.
constexpr float kLog2E = 1.44269504f, kLn2High = 0.693147182f, kLn2Low = -1.90465430e-9f, kExpFloor = -87.0f;
constexpr float kExpTaylor[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

inline float silu_times(float g, float up) {
  const float x = std::max(-std::fabs(g), kExpFloor);
  const float n = std::nearbyint(x * kLog2E);
  float r = std::fma(-n, kLn2High, x);
  r = std::fma(-n, kLn2Low, r);
  float p = kExpTaylor[0];
  for (int i = 1; i < 8; ++i) p = std::fma(p, r, kExpTaylor[i]);
  const float e = p * std::ldexp(1.0f, static_cast<int>(n));
  const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
  return g * sigmoid * up;
}

#if defined(KVFERRY_AVX512)
inline __m512 silu_times(__m512 g, __m512 up) {
  const __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)), _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  const __m512 e = _mm512_scalef_ps(p, n);
  const __mmask16 nonnegative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 numerator = _mm512_mask_blend_ps(nonnegative, e, _mm512_set1_ps(1.0f));
  const __m512 sigmoid = _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), up);
}
constexpr int64_t kSiluLanes = 16;
using SiluVector = __m512;
inline SiluVector silu_load(const float* at) { return _mm512_loadu_ps(at); }
inline void silu_store(float* at, SiluVector v) { _mm512_storeu_ps(at, v); }
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 silu_times(__m256 g, __m256 up) {
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);
  const __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), magnitude), _mm256_set1_ps(kExpFloor));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
  const __m256 nonnegative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
  const __m256 numerator = _mm256_blendv_ps(e, _mm256_set1_ps(1.0f), nonnegative);
  const __m256 sigmoid = _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), up);
}
constexpr int64_t kSiluLanes = 8;
using SiluVector = __m256;
inline SiluVector silu_load(const float* at) { return _mm256_loadu_ps(at); }
inline void silu_store(float* at, SiluVector v) { _mm256_storeu_ps(at, v); }
#else
constexpr int64_t kSiluLanes = 0;  // scalar only
#endif

// silu(gate) * up of a merged [rows, 2 * width] projection: [rows, width].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * 2 * width;
      float* row = o + r * width;
      int64_t i = 0;
#if defined(KVFERRY_AVX512) || (defined(__AVX2__) && defined(__FMA__))
      for (; i + kSiluLanes <= width; i += kSiluLanes)
        silu_store(row + i, silu_times(silu_load(gate + i), silu_load(gate + width + i)));
#endif
      for (; i < width; ++i) row[i] = silu_times(gate[i], gate[width + i]);
    }
  });
  return out;
}

// Where keys sit in a KV cache tensor, in elements (decode_kernel.py's CacheGeometry):
// NHD [2, blocks, block_size, heads, D], HND [2, blocks, heads, block_size, D].
struct CacheGeometry {
  int64_t kv_heads, block_size, block_stride, token_stride, head_stride, kv_stride;
};

CacheGeometry geometry_of(const at::Tensor& cache, bool hnd) {
  const int64_t token_dim = hnd ? 3 : 2, head_dim = hnd ? 2 : 3;
  return {cache.size(head_dim), cache.size(token_dim), cache.stride(1), cache.stride(token_dim),
          cache.stride(head_dim), cache.stride(0)};
}

// Attention of the rows' q (rotated) over their cached keys, this step's k and v written
// into the cache first: [rows, heads * dim].
at::Tensor attend(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t dim, at::Tensor& cache, bool hnd,
                  const at::Tensor& slots, const at::Tensor& table, const at::Tensor& seq_lens,
                  const std::optional<at::Tensor>& start_pos, int64_t window, double scale) {
  const int64_t rows = qkv.size(0);
  const CacheGeometry g = geometry_of(cache, hnd);
  TORCH_CHECK(g.kv_heads == kv_heads && cache.size(-1) == dim && cache.scalar_type() == at::kFloat,
              "decode_layer: a float32 cache of the layer's KV heads and head size");
  const at::Tensor k = qkv.narrow(1, heads * dim, kv_heads * dim).view({rows, kv_heads, dim});
  const at::Tensor v = qkv.narrow(1, (heads + kv_heads) * dim, kv_heads * dim).view({rows, kv_heads, dim});
  write_kv_op().call(cache, k, v, slots, g.block_size, g.block_stride, g.token_stride, g.head_stride, g.kv_stride);
  const at::Tensor q = qkv.narrow(1, 0, heads * dim).contiguous().view({rows, heads, dim});
  at::Tensor out = at::empty({rows, heads, dim}, qkv.options());
  const at::Tensor starts = start_pos.has_value() ? *start_pos : at::zeros_like(seq_lens);
  paged_decode_op().call(q, cache, table.contiguous(), seq_lens, starts, out, kv_heads, g.block_size,
                         g.block_stride, g.token_stride, g.head_stride, g.kv_stride, window, scale);
  return out.view({rows, heads * dim});
}

// The layer up to its attention: the residual carried (a copy of the previous layer's, or
// of hidden at the first layer) with hidden added, normed, projected to q/k/v and q and k
// rotated. Returns (qkv [rows, (heads + 2 kv_heads) * head_dim], residual).
std::tuple<at::Tensor, at::Tensor> layer_head(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
                                              const at::Tensor& input_norm, double eps, const at::Tensor& qkv,
                                              int64_t qkv_type, const std::optional<at::Tensor>& qkv_bias,
                                              const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                              int64_t kv_heads, int64_t head_dim) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.is_contiguous(),
              "decode_layer: hidden float32 [rows, hidden size], contiguous");
  TORCH_CHECK(input_norm.scalar_type() == at::kFloat, "decode_layer: float32 norm weights");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.stride(-1) == 1 && sin.stride(-1) == 1 &&
                  cos.size(0) >= hidden.size(0) && cos.size(-1) == head_dim / 2,
              "decode_layer: float32 cos and sin [rows, 1, head_dim / 2]");
  at::Tensor carried = residual.has_value() ? residual->contiguous().clone() : hidden.clone();
  TORCH_CHECK(carried.sizes() == hidden.sizes(), "decode_layer: residual of hidden's shape");
  const at::Tensor normed = add_and_norm(hidden, carried, residual.has_value(), input_norm, eps);
  at::Tensor qkv_out = project(normed, {qkv, qkv_type, (heads + 2 * kv_heads) * head_dim}, qkv_bias);
  rotate(qkv_out, 0, heads + kv_heads, head_dim, cos, sin);  // q and k are adjacent
  return {qkv_out, carried};
}

// The layer after its attention: output projection, residual add (into `carried`, in
// place) and norm, gated SiLU MLP. Returns (MLP output, residual).
std::tuple<at::Tensor, at::Tensor> layer_tail(const at::Tensor& attended, at::Tensor& carried,
                                              const at::Tensor& post_norm, double eps, const at::Tensor& o,
                                              int64_t o_type, const std::optional<at::Tensor>& o_bias,
                                              const at::Tensor& gate_up, int64_t gate_up_type, const at::Tensor& down,
                                              int64_t down_type, int64_t intermediate) {
  TORCH_CHECK(post_norm.scalar_type() == at::kFloat, "decode_layer: float32 norm weights");
  TORCH_CHECK(attended.scalar_type() == at::kFloat && attended.dim() == 2 && carried.is_contiguous() &&
                  attended.size(0) == carried.size(0),
              "decode_layer: attention output float32 [rows, heads * head_dim], a contiguous residual");
  const int64_t width = carried.size(1);
  const at::Tensor projected = project(attended.contiguous(), {o, o_type, width}, o_bias);
  const at::Tensor mlp_in = add_and_norm(projected, carried, true, post_norm, eps);
  const Blocks gate_up_blocks{gate_up, gate_up_type, 2 * intermediate};
  const at::Tensor activated = silu_and_mul(project(mlp_in, gate_up_blocks, std::nullopt));
  return {project(activated, {down, down_type, width}, std::nullopt), carried};
}

// layer_tail as an operator: the MLP output; the residual is updated in place.
at::Tensor layer_tail_op(const at::Tensor& attended, at::Tensor& residual, const at::Tensor& post_norm, double eps,
                         const at::Tensor& o, int64_t o_type, const std::optional<at::Tensor>& o_bias,
                         const at::Tensor& gate_up, int64_t gate_up_type, const at::Tensor& down, int64_t down_type,
                         int64_t intermediate) {
  return std::get<0>(layer_tail(attended, residual, post_norm, eps, o, o_type, o_bias, gate_up, gate_up_type, down,
                                down_type, intermediate));
}

// One decoder layer over `hidden` [rows, hidden size] float32, each row a decode (one query
// token of its sequence). `residual`: the previous layer's (None at the first layer).
// Returns the MLP's output and the residual, as LlamaDecoderLayer.forward does: layer_head,
// the KV write and paged decode attention, layer_tail.
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv, int64_t qkv_type,
    const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o, int64_t o_type,
    const std::optional<at::Tensor>& o_bias, const at::Tensor& gate_up, int64_t gate_up_type, const at::Tensor& down,
    int64_t down_type, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& cache, bool hnd,
    const at::Tensor& slots, const at::Tensor& table, const at::Tensor& seq_lens,
    const std::optional<at::Tensor>& start_pos, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t intermediate, int64_t window, double scale) {
  auto [qkv_out, carried] =
      layer_head(hidden, residual, input_norm, eps, qkv, qkv_type, qkv_bias, cos, sin, heads, kv_heads, head_dim);
  const at::Tensor attended =
      attend(qkv_out, heads, kv_heads, head_dim, cache, hnd, slots, table, seq_lens, start_pos, window, scale);
  return layer_tail(attended, carried, post_norm, eps, o, o_type, o_bias, gate_up, gate_up_type, down, down_type,
                    intermediate);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvferry_cpu, m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor post_norm, float eps, "
      "Tensor qkv, int qkv_type, Tensor? qkv_bias, Tensor o, int o_type, Tensor? o_bias, Tensor gate_up, "
      "int gate_up_type, Tensor down, int down_type, Tensor cos, Tensor sin, Tensor(a!) cache, bool hnd, "
      "Tensor slots, Tensor table, Tensor seq_lens, Tensor? start_pos, int heads, int kv_heads, int head_dim, "
      "int intermediate, int window, float scale) -> (Tensor, Tensor)");
  m.def(
      "layer_head(Tensor hidden, Tensor? residual, Tensor input_norm, float eps, Tensor qkv, int qkv_type, "
      "Tensor? qkv_bias, Tensor cos, Tensor sin, int heads, int kv_heads, int head_dim) -> (Tensor, Tensor)");
  m.def(
      "layer_tail(Tensor attended, Tensor(a!) residual, Tensor post_norm, float eps, Tensor o, int o_type, "
      "Tensor? o_bias, Tensor gate_up, int gate_up_type, Tensor down, int down_type, int intermediate) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvferry_cpu, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("layer_head", &layer_head);
  m.impl("layer_tail", &layer_tail_op);
}
