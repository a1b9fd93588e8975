// Paged decode attention on CPU: each decode query attends the keys its block table
// names, read in place from the KV cache (no gathered copy), in fp32 whatever the cache
// dtype. Built and loaded at run time by kvferry/model/layers/decode_kernel.py.
//
// q [B, heads, D] contiguous; cache: K at `cache`, V at `cache + kv_stride`, a key at
// block * block_stride + offset * token_stride + head * head_stride, D contiguous values;
// table int64 [B, width]; seq_lens int64 [B] (the query is the last position);
// start_pos int64 [B] (position of each table's first key); window 0: full attention,
// else a key at most window - 1 positions before the query. out [B, heads, D].
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

struct Geometry {
  int64_t block_size, block_stride, token_stride, head_stride, kv_stride, window;
  float scale;
};

// A cached row of `dim` values as fp32 (bf16: the high half of an fp32, so a shift).
template <typename scalar_t>
inline void load_row(const scalar_t* row, int64_t dim, float* out) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(row[d]);
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* row, int64_t dim, float* out) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  uint32_t* words = reinterpret_cast<uint32_t*>(out);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) words[d] = static_cast<uint32_t>(bits[d]) << 16;
}

// Per-thread scratch: the scaled queries, one key or value row, scores, the weighted sums.
struct Scratch {
  std::vector<float> query, row, scores, acc;
};

// One sequence, all its heads: each query head's scores over the visible keys, softmax,
// weighted sum of values. Keys are visited block by block, every KV head of a token
// together (a block's rows are contiguous in NHD: one forward sweep of its memory).
template <typename scalar_t>
void attend_sequence(const scalar_t* q, const scalar_t* cache, const int64_t* table, int64_t width,
                     int64_t seq_len, int64_t first_pos, int64_t kv_heads, int64_t group, int64_t dim,
                     const Geometry& geo, scalar_t* out, Scratch& scratch) {
  const int64_t heads = kv_heads * group;
  const int64_t query_pos = seq_len - 1;
  const int64_t low = std::max(first_pos, geo.window > 0 ? query_pos - geo.window + 1 : int64_t(0));
  const int64_t count = query_pos - low + 1;
  TORCH_CHECK(count >= 1, "paged_decode: a decode sees no key");
  TORCH_CHECK((query_pos - first_pos) / geo.block_size < width, "paged_decode: block table too short");
  scratch.query.resize(heads * dim);
  scratch.row.resize(dim);
  scratch.scores.resize(heads * count);
  scratch.acc.assign(heads * dim, 0.0f);
  float* query = scratch.query.data();
  float* row = scratch.row.data();
  float* scores = scratch.scores.data();
  float* acc = scratch.acc.data();
  load_row(q, heads * dim, query);
  for (int64_t i = 0; i < heads * dim; ++i) query[i] *= geo.scale;
  // visit(j, token): key j's row for KV head 0 at `token` (head h at + h * head_stride).
  auto for_each_key = [&](auto&& visit) {
    int64_t index = low - first_pos;
    for (int64_t j = 0; j < count;) {
      const int64_t offset = index % geo.block_size;
      const int64_t run = std::min(geo.block_size - offset, count - j);
      const scalar_t* token = cache + table[index / geo.block_size] * geo.block_stride + offset * geo.token_stride;
      for (int64_t r = 0; r < run; ++r, ++j, token += geo.token_stride) visit(j, token);
      index += run;
    }
  };
  for_each_key([&](int64_t j, const scalar_t* token) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      load_row(token + h * geo.head_stride, dim, row);
      for (int64_t g = h * group; g < (h + 1) * group; ++g) {
        const float* qg = query + g * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qg[d] * row[d];
        scores[g * count + j] = dot;
      }
    }
  });
  for (int64_t g = 0; g < heads; ++g) {
    float* weights = scores + g * count;
    const float peak = *std::max_element(weights, weights + count);
    float total = 0.0f;
    for (int64_t j = 0; j < count; ++j) {
      weights[j] = std::exp(weights[j] - peak);
      total += weights[j];
    }
    const float inverse = 1.0f / total;
    for (int64_t j = 0; j < count; ++j) weights[j] *= inverse;
  }
  for_each_key([&](int64_t j, const scalar_t* token) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      load_row(token + geo.kv_stride + h * geo.head_stride, dim, row);
      for (int64_t g = h * group; g < (h + 1) * group; ++g) {
        const float weight = scores[g * count + j];
        float* ag = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ag[d] += weight * row[d];
      }
    }
  });
  for (int64_t i = 0; i < heads * dim; ++i) out[i] = static_cast<scalar_t>(acc[i]);
}

void paged_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& table,
                  const at::Tensor& seq_lens, const at::Tensor& start_pos, at::Tensor& out,
                  int64_t kv_heads, int64_t block_size, int64_t block_stride, int64_t token_stride,
                  int64_t head_stride, int64_t kv_stride, int64_t window, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && table.is_contiguous(), "paged_decode: contiguous q, out, table");
  TORCH_CHECK(cache.stride(-1) == 1 && q.scalar_type() == cache.scalar_type(), "paged_decode: cache layout or dtype");
  TORCH_CHECK(table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong && start_pos.scalar_type() == at::kLong);
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), width = table.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && seq_lens.numel() == batch && start_pos.numel() == batch);
  const int64_t group = heads / kv_heads;
  const Geometry geo{block_size, block_stride, token_stride, head_stride, kv_stride, window, static_cast<float>(scale)};
  const int64_t* tables = table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = start_pos.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qs = q.data_ptr<scalar_t>();
    const scalar_t* base = cache.data_ptr<scalar_t>();
    scalar_t* outs = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t b = begin; b < end; ++b) {
        attend_sequence<scalar_t>(qs + b * heads * dim, base, tables + b * width, width, lens[b], starts[b],
                                  kv_heads, group, dim, geo, outs + b * heads * dim, scratch);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(kvferry_kernels, m) {
  m.def(
      "paged_decode(Tensor q, Tensor cache, Tensor table, Tensor seq_lens, Tensor start_pos, "
      "Tensor(a!) out, int kv_heads, int block_size, int block_stride, int token_stride, "
      "int head_stride, int kv_stride, int window, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvferry_kernels, CPU, m) { m.impl("paged_decode", &paged_decode); }
