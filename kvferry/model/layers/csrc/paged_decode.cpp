// Paged decode attention on CPU: each decode query attends the keys its block table
// names, read in place from the KV cache (no gathered copy), accumulating in fp32 whatever
// the cache dtype. Built and loaded at run time by kvferry/model/layers/decode_kernel.py.
//
// q [B, heads, D] contiguous; cache: K at `cache`, V at `cache + kv_stride`, a key at
// block * block_stride + offset * token_stride + head * head_stride, D contiguous values;
// table int64 [B, width]; seq_lens int64 [B] (the query is the last position);
// start_pos int64 [B] (position of each table's first key); window 0: full attention,
// else a key at most window - 1 positions before the query. out [B, heads, D].
//
// A sequence's keys are cut into spans of kSpanKeys (the last shorter), computed apart,
// whose partial softmaxes (max, sum, weighted values) are merged at the end in span order
// (flash-decoding). The cut depends on the number of keys alone, never on the batch or the
// threads, so a decode row gets the same bits alone and beside any others (batch
// invariance: P/D's byte identity and speculative decoding's exactness rest on it). Work
// is shared out as items that threads take one after another as they finish: a span of
// one (sequence, KV head); a sequence of a single span is one item with all its KV heads
// (each tile of its blocks read in one sweep) when there are sequences enough for every
// thread, else one per KV head. A call with little work stays on the calling thread.
// An item visits its keys in tiles: the scores of all its group's query heads over a tile,
// an online-softmax update, then the tile's values weighted into fp32 sums. Where the
// compiler targets AVX-512 the tiles use its intrinsics (bf16 dot products with
// AVX512_BF16); elsewhere portable loops compute the same.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace {

using kvferry_vec::max_of;

constexpr int64_t kTileKeys = 64;           // keys scored, then summed, together: their rows stay in L1
constexpr int kMaxPassHeads = 8;            // query heads one pass over the keys serves (kept in registers)
constexpr int64_t kItemsPerThread = 8;      // sequences per thread for an item to take all KV heads
constexpr int64_t kSpanKeys = 256;          // a sequence's keys in spans of this many, whatever the batch
constexpr int64_t kMinParallelWork = 1024;  // fewer key rows (keys x KV heads) in a call: one thread
constexpr int64_t kRowPad = 32;             // scratch rows padded to whole vectors (32 bf16, 2 x 16 fp32)

struct Geometry {
  int64_t block_size, block_stride, token_stride, head_stride, kv_stride, window;
  float scale;
};

// The keys one decode sees, as indices into its table: [first, first + count).
struct KeySpan {
  int64_t first, count;
};

// One unit of work: of one sequence, the query heads of KV heads [kv_first, kv_first +
// kv_count) over a span of its keys. A sequence's KV heads share an item when there are
// sequences enough to go round (each tile of its blocks is then read in one sweep).
struct WorkItem {
  int64_t sequence, kv_first, kv_count;
  KeySpan keys;
  int64_t slot;  // where a split span (kv_count 1) leaves its partial softmax; -1: it writes `out`
};

// Running softmax of a pass's query heads for one KV head: the largest score so far and the
// sum of e^(score - max); the weighted value sums (relative to the same max) are Scratch::acc.
struct Softmax {
  float max[kMaxPassHeads], sum[kMaxPassHeads];
};

// How a pass keeps its queries: bf16 bits for vdpbf16ps dot products, else fp32.
template <typename scalar_t>
struct QueryFormat {
  using type = float;
};
#if defined(KVFERRY_AVX512_BF16)
template <>
struct QueryFormat<c10::BFloat16> {
  using type = uint16_t;
};
#endif
template <typename scalar_t>
using query_t = typename QueryFormat<scalar_t>::type;

// Per-thread buffers for a pass, per KV head of the item; rows padded to kRowPad with zeros.
template <typename scalar_t>
struct Scratch {
  std::vector<query_t<scalar_t>> queries;  // the pass's query heads
  std::vector<float> acc;                  // their weighted value sums
  std::vector<Softmax> softmax;
};

inline int64_t padded(int64_t dim) { return (dim + kRowPad - 1) / kRowPad * kRowPad; }

// ---- tile primitives: AVX-512 ----------------------------------------------------------
#if defined(KVFERRY_AVX512)

using kvferry_vec::exp_nonpositive;
using kvferry_vec::lanes;
using kvferry_vec::sum_lanes;

// 16 cached values as fp32, zeros past the mask (a masked load never touches those bytes).
inline __m512 load_floats(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load_floats(const c10::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}
inline __m512 load_floats(const c10::BFloat16* p, __mmask16 mask) { return kvferry_vec::load_bf16(p, mask); }
inline __m512 load_floats(const double* p, __mmask16 mask) {  // fp64 caches: rounded, as every value
  const __m256 low = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd(__mmask8(mask), p));
  const __m256 high = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd(__mmask8(mask >> 8), p + 8));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(low)), _mm256_castps_pd(high), 1));
}

// values[j] = e^(values[j] - shift) in place; returns their sum.
inline float exp_shifted(float* values, int64_t n, float shift) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = lanes(n - j);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, values + j), _mm512_set1_ps(shift));
    const __m512 weights = exp_nonpositive(x);
    _mm512_mask_storeu_ps(values + j, mask, weights);
    total = _mm512_mask_add_ps(total, mask, total, weights);
  }
  return sum_lanes(total);
}

// scores[g * kTileKeys + j] = scale * (query g . key row j), the row at rows[j] + offset.
template <int HEADS, typename scalar_t>
void score_tile(const float* queries, const scalar_t* const* rows, int64_t offset, int64_t n, int64_t dim,
                float scale, float* scores) {
  const int64_t stride = padded(dim);
  for (int64_t j = 0; j < n; ++j) {
    __m512 sums[HEADS];
    for (int g = 0; g < HEADS; ++g) sums[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 key = load_floats(rows[j] + offset + d, lanes(dim - d));
      for (int g = 0; g < HEADS; ++g) {
        sums[g] = _mm512_fmadd_ps(_mm512_loadu_ps(queries + g * stride + d), key, sums[g]);
      }
    }
    for (int g = 0; g < HEADS; ++g) scores[g * kTileKeys + j] = sum_lanes(sums[g]) * scale;
  }
}

#if defined(KVFERRY_AVX512_BF16)
// The same for bf16 caches: bf16 queries, pairs of products summed in fp32 by vdpbf16ps.
template <int HEADS>
void score_tile(const uint16_t* queries, const c10::BFloat16* const* rows, int64_t offset, int64_t n, int64_t dim,
                float scale, float* scores) {
  const int64_t stride = padded(dim);
  for (int64_t j = 0; j < n; ++j) {
    __m512 sums[HEADS];
    for (int g = 0; g < HEADS; ++g) sums[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 32) {
      const __mmask32 mask = dim - d >= 32 ? __mmask32(~0u) : __mmask32((1u << (dim - d)) - 1);
      const __m512bh key = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[j] + offset + d);
      for (int g = 0; g < HEADS; ++g) {
        const __m512bh query = (__m512bh)_mm512_loadu_si512(queries + g * stride + d);
        sums[g] = _mm512_dpbf16_ps(sums[g], query, key);
      }
    }
    for (int g = 0; g < HEADS; ++g) scores[g * kTileKeys + j] = sum_lanes(sums[g]) * scale;
  }
}
#endif

// acc[g] = acc[g] * rescale[g] + sum over the tile of weight[g][j] * the value row at
// rows[j] + offset. Sixteen values of every head at a time, held in registers across the
// tile's keys.
template <int HEADS, typename scalar_t>
void accumulate_tile(const float* weights, const scalar_t* const* rows, int64_t offset, int64_t n, int64_t dim,
                     const float* rescale, float* acc) {
  const int64_t stride = padded(dim);
  for (int64_t d = 0; d < dim; d += 16) {
    const __mmask16 mask = lanes(dim - d);
    __m512 sums[HEADS];
    for (int g = 0; g < HEADS; ++g) {
      sums[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * stride + d), _mm512_set1_ps(rescale[g]));
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m512 value = load_floats(rows[j] + offset + d, mask);
      for (int g = 0; g < HEADS; ++g) {
        sums[g] = _mm512_fmadd_ps(_mm512_set1_ps(weights[g * kTileKeys + j]), value, sums[g]);
      }
    }
    for (int g = 0; g < HEADS; ++g) _mm512_storeu_ps(acc + g * stride + d, sums[g]);
  }
}

// ---- tile primitives: portable ---------------------------------------------------------
#else

inline float exp_shifted(float* values, int64_t n, float shift) {
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    values[j] = std::exp(values[j] - shift);
    total += values[j];
  }
  return total;
}

template <int HEADS, typename scalar_t>
void score_tile(const float* queries, const scalar_t* const* rows, int64_t offset, int64_t n, int64_t dim,
                float scale, float* scores) {
  const int64_t stride = padded(dim);
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* key = rows[j] + offset;
    for (int g = 0; g < HEADS; ++g) {
      const float* query = queries + g * stride;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += query[d] * static_cast<float>(key[d]);
      scores[g * kTileKeys + j] = dot * scale;
    }
  }
}

template <int HEADS, typename scalar_t>
void accumulate_tile(const float* weights, const scalar_t* const* rows, int64_t offset, int64_t n, int64_t dim,
                     const float* rescale, float* acc) {
  const int64_t stride = padded(dim);
  for (int g = 0; g < HEADS; ++g) {
    for (int64_t d = 0; d < dim; ++d) acc[g * stride + d] *= rescale[g];
  }
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* value = rows[j] + offset;
    for (int g = 0; g < HEADS; ++g) {
      const float weight = weights[g * kTileKeys + j];
      float* sums = acc + g * stride;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) sums[d] += weight * static_cast<float>(value[d]);
    }
  }
}

#endif

// ---- one pass: some query heads of an item's KV heads over its keys ----------------------

// `heads` query rows of q into zero-padded rows: fp32, or bf16 bits for vdpbf16ps.
template <typename scalar_t>
void load_queries(const scalar_t* q, int heads, int64_t dim, float* rows) {
  for (int g = 0; g < heads; ++g) {
    for (int64_t d = 0; d < dim; ++d) rows[g * padded(dim) + d] = static_cast<float>(q[g * dim + d]);
  }
}

#if defined(KVFERRY_AVX512_BF16)
void load_queries(const c10::BFloat16* q, int heads, int64_t dim, uint16_t* rows) {
  for (int g = 0; g < heads; ++g) std::memcpy(rows + g * padded(dim), q + g * dim, dim * sizeof(uint16_t));
}
#endif

// rows[j]: the K row of the table's key `first + j` for the head at `head_base`, j < n.
// Block by block: one table lookup and division per block, not per key.
template <typename scalar_t>
void gather_rows(const scalar_t* head_base, const int64_t* table, const Geometry& geo, int64_t first, int64_t n,
                 const scalar_t** rows) {
  for (int64_t j = 0; j < n;) {
    const int64_t offset = first % geo.block_size;
    const int64_t run = std::min(geo.block_size - offset, n - j);
    const scalar_t* row = head_base + table[first / geo.block_size] * geo.block_stride + offset * geo.token_stride;
    for (int64_t r = 0; r < run; ++r, ++j, row += geo.token_stride) rows[j] = row;
    first += run;
  }
}

// Ask for the rows at rows[j] + offset, j < n, `bytes` each, to be brought into L2 ahead of
// use: a tile's rows are scattered over blocks the hardware prefetcher does not foresee.
// (Into L2, one tile ahead: measured faster than into L1, than the current tile, and than
// none, on shuffled blocks.)
template <typename scalar_t>
void prefetch_rows(const scalar_t* const* rows, int64_t n, int64_t offset, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(rows[j] + offset);
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(row + line, 0, 1);
  }
}

// Fold a tile's scores into the running softmax: scores become weights e^(score - max),
// rescale[g] the factor that brings the earlier sums to the new max.
inline void update_softmax(int heads, float* scores, int64_t n, Softmax& softmax, float* rescale) {
  for (int g = 0; g < heads; ++g) {
    float* row = scores + g * kTileKeys;
    const float peak = std::max(softmax.max[g], max_of(row, n));
    rescale[g] = std::exp(softmax.max[g] - peak);  // the first tile: e^-inf = 0 times empty sums
    softmax.sum[g] = softmax.sum[g] * rescale[g] + exp_shifted(row, n, peak);
    softmax.max[g] = peak;
  }
}

// Everything an item reads or writes. A partial (per slot and query head of the group):
// [max, sum, dim weighted value sums].
template <typename scalar_t>
struct Problem {
  const scalar_t* q;
  const scalar_t* cache;
  const int64_t* tables;
  scalar_t* out;
  float* partials;
  int64_t width, heads, group, dim;
  Geometry geo;

  // Row of q and out of a sequence's query head `g` of KV head `kv_head`.
  int64_t row(int64_t sequence, int64_t kv_head, int64_t g) const { return sequence * heads + kv_head * group + g; }
};

inline int64_t partial_size(int64_t dim) { return 2 + dim; }

// Query heads [first, first + HEADS) of every group of the item, over its keys: their
// softmaxes and weighted value sums into scratch. Tile by tile, every KV head of a tile in
// turn, while the next tile's keys and values are fetched.
template <int HEADS, typename scalar_t>
void attend_pass(const WorkItem& item, int64_t first, const Problem<scalar_t>& p, Scratch<scalar_t>& scratch) {
  const Geometry& geo = p.geo;
  const int64_t rows_per_head = HEADS * padded(p.dim);  // scratch floats per KV head
  scratch.queries.assign(item.kv_count * rows_per_head, 0);
  scratch.acc.assign(item.kv_count * rows_per_head, 0.0f);
  scratch.softmax.resize(item.kv_count);
  for (int64_t h = 0; h < item.kv_count; ++h) {
    const int64_t row = p.row(item.sequence, item.kv_first + h, first);
    load_queries(p.q + row * p.dim, HEADS, p.dim, scratch.queries.data() + h * rows_per_head);
    std::fill_n(scratch.softmax[h].max, HEADS, -std::numeric_limits<float>::infinity());
    std::fill_n(scratch.softmax[h].sum, HEADS, 0.0f);
  }
  const scalar_t* head_base = p.cache + item.kv_first * geo.head_stride;
  const int64_t* table = p.tables + item.sequence * p.width;
  const int64_t row_bytes = p.dim * static_cast<int64_t>(sizeof(scalar_t));
  const scalar_t* rows[2][kTileKeys];  // this tile's K rows (first KV head) and the next's
  float scores[HEADS * kTileKeys];
  float rescale[HEADS];
  gather_rows(head_base, table, geo, item.keys.first, std::min(kTileKeys, item.keys.count), rows[0]);
  for (int64_t done = 0, tile = 0; done < item.keys.count; done += kTileKeys, ++tile) {
    const scalar_t* const* current = rows[tile % 2];
    const int64_t n = std::min(kTileKeys, item.keys.count - done);
    const int64_t next = std::min(kTileKeys, item.keys.count - done - n);
    if (next > 0) {
      const scalar_t** following = rows[(tile + 1) % 2];
      gather_rows(head_base, table, geo, item.keys.first + done + n, next, following);
      for (int64_t h = 0; h < item.kv_count; ++h) {
        prefetch_rows(following, next, h * geo.head_stride, row_bytes);
        prefetch_rows(following, next, geo.kv_stride + h * geo.head_stride, row_bytes);
      }
    }
    for (int64_t h = 0; h < item.kv_count; ++h) {
      const int64_t offset = h * geo.head_stride;
      score_tile<HEADS>(scratch.queries.data() + h * rows_per_head, current, offset, n, p.dim, geo.scale, scores);
      update_softmax(HEADS, scores, n, scratch.softmax[h], rescale);
      accumulate_tile<HEADS>(scores, current, geo.kv_stride + offset, n, p.dim, rescale,
                             scratch.acc.data() + h * rows_per_head);
    }
  }
}

// attend_pass with the head count as a compile-time constant (the sums' registers).
template <typename scalar_t>
void attend_heads(int heads, const WorkItem& item, int64_t first, const Problem<scalar_t>& p,
                  Scratch<scalar_t>& scratch) {
  switch (heads) {
#define KVFERRY_HEADS_CASE(H) \
  case H:                     \
    return attend_pass<H>(item, first, p, scratch);
    KVFERRY_HEADS_CASE(1)
    KVFERRY_HEADS_CASE(2)
    KVFERRY_HEADS_CASE(3)
    KVFERRY_HEADS_CASE(4)
    KVFERRY_HEADS_CASE(5)
    KVFERRY_HEADS_CASE(6)
    KVFERRY_HEADS_CASE(7)
    KVFERRY_HEADS_CASE(8)
#undef KVFERRY_HEADS_CASE
  }
  TORCH_CHECK(false, "paged_decode: a pass of ", heads, " query heads");
}

// ---- the batch: items, their results, the merge of split spans ---------------------------

// A pass's results: normalised into `out`, or (a split span) left as partials in its slot.
template <typename scalar_t>
void finish_pass(const WorkItem& item, int64_t first, int heads, const Problem<scalar_t>& p,
                 const Scratch<scalar_t>& scratch) {
  const int64_t stride = padded(p.dim);
  for (int64_t h = 0; h < item.kv_count; ++h) {
    const Softmax& softmax = scratch.softmax[h];
    for (int g = 0; g < heads; ++g) {
      const float* acc = scratch.acc.data() + (h * heads + g) * stride;
      if (item.slot < 0) {
        const float inverse = 1.0f / softmax.sum[g];
        scalar_t* out = p.out + p.row(item.sequence, item.kv_first + h, first + g) * p.dim;
        for (int64_t d = 0; d < p.dim; ++d) out[d] = static_cast<scalar_t>(acc[d] * inverse);
      } else {
        float* partial = p.partials + (item.slot * p.group + first + g) * partial_size(p.dim);
        partial[0] = softmax.max[g];
        partial[1] = softmax.sum[g];
        std::copy(acc, acc + p.dim, partial + 2);
      }
    }
  }
}

// One item: its groups' query heads in passes of up to kMaxPassHeads.
template <typename scalar_t>
void run_item(const WorkItem& item, const Problem<scalar_t>& p, Scratch<scalar_t>& scratch) {
  for (int64_t first = 0; first < p.group; first += kMaxPassHeads) {
    const int heads = static_cast<int>(std::min<int64_t>(kMaxPassHeads, p.group - first));
    attend_heads(heads, item, first, p, scratch);
    finish_pass(item, first, heads, p, scratch);
  }
}

// The spans' partials of one query head (`spans` of them, `step` floats apart) into out.
template <typename scalar_t>
void merge_partials(const float* partials, int64_t spans, int64_t step, int64_t dim, std::vector<float>& sums,
                    scalar_t* out) {
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < spans; ++s) peak = std::max(peak, partials[s * step]);
  sums.assign(dim, 0.0f);
  float total = 0.0f;
  for (int64_t s = 0; s < spans; ++s) {
    const float* partial = partials + s * step;
    const float factor = std::exp(partial[0] - peak);
    total += partial[1] * factor;
    for (int64_t d = 0; d < dim; ++d) sums[d] += partial[2 + d] * factor;
  }
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<scalar_t>(sums[d] / total);
}

// The keys a decode sees, checked against its table.
KeySpan visible_keys(int64_t seq_len, int64_t first_pos, int64_t width, const Geometry& geo) {
  const int64_t query_pos = seq_len - 1;
  const int64_t low = std::max(first_pos, geo.window > 0 ? query_pos - geo.window + 1 : int64_t(0));
  TORCH_CHECK(query_pos >= low, "paged_decode: a decode sees no key");
  TORCH_CHECK((query_pos - first_pos) / geo.block_size < width, "paged_decode: block table too short");
  return KeySpan{low - first_pos, query_pos - low + 1};
}

// How many spans a sequence's keys are cut into: fixed by their count alone.
int64_t spans_of(const KeySpan& keys) { return (keys.count + kSpanKeys - 1) / kSpanKeys; }

// A (sequence, KV head) whose keys were split: its `spans` partials from `first_slot` on.
struct SplitPair {
  int64_t sequence, kv_head, first_slot, spans;
};

struct Plan {
  std::vector<WorkItem> items;    // longest first: threads taking items in turn finish close together
  std::vector<SplitPair> splits;  // to merge once every item is done
  int64_t slots = 0;
};

// Each sequence's spans as items (see the top of the file); one item per sequence of one
// span when there are sequences enough for every thread (or one thread).
Plan plan_items(const std::vector<KeySpan>& visible, int64_t kv_heads, int64_t threads) {
  const int64_t batch = static_cast<int64_t>(visible.size());
  const bool whole_sequences = threads <= 1 || batch >= kItemsPerThread * threads;
  Plan plan;
  for (int64_t b = 0; b < batch; ++b) {
    const KeySpan keys = visible[b];
    const int64_t spans = spans_of(keys);
    if (spans == 1 && whole_sequences) {
      plan.items.push_back({b, 0, kv_heads, keys, -1});
      continue;
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      if (spans == 1) {
        plan.items.push_back({b, h, 1, keys, -1});
        continue;
      }
      plan.splits.push_back({b, h, plan.slots, spans});
      for (int64_t s = 0; s < spans; ++s) {
        const int64_t begin = s * kSpanKeys, end = std::min(keys.count, begin + kSpanKeys);
        plan.items.push_back({b, h, 1, KeySpan{keys.first + begin, end - begin}, plan.slots++});
      }
    }
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.keys.count > b.keys.count; });
  return plan;
}

// Every item, on `threads` threads that each take the next undone item.
template <typename scalar_t>
void run_items(const std::vector<WorkItem>& items, const Problem<scalar_t>& problem, int64_t threads) {
  const int64_t count = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, count), 1, [&](int64_t, int64_t) {
    Scratch<scalar_t> scratch;
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) run_item(items[i], problem, scratch);
  });
}

// Each split pair's partials into out, query head by query head.
template <typename scalar_t>
void merge_splits(const std::vector<SplitPair>& splits, const Problem<scalar_t>& p) {
  const int64_t step = p.group * partial_size(p.dim);  // from one slot to the next
  std::vector<float> sums;
  for (const SplitPair& pair : splits) {
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t row = p.row(pair.sequence, pair.kv_head, g);
      const float* partials = p.partials + pair.first_slot * step + g * partial_size(p.dim);
      merge_partials(partials, pair.spans, step, p.dim, sums, p.out + row * p.dim);
    }
  }
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
  const Geometry geo{block_size, block_stride, token_stride, head_stride, kv_stride, window, static_cast<float>(scale)};
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = start_pos.data_ptr<int64_t>();
  std::vector<KeySpan> visible;
  for (int64_t b = 0; b < batch; ++b) visible.push_back(visible_keys(lens[b], starts[b], width, geo));
  int64_t work = 0;
  for (const KeySpan& keys : visible) work += keys.count * kv_heads;
  // A small call runs on the calling thread: waking the others would cost more than it saves.
  const int64_t threads = work >= kMinParallelWork ? at::get_num_threads() : 1;
  const Plan plan = plan_items(visible, kv_heads, threads);
  std::vector<float> partials(plan.slots * (heads / kv_heads) * partial_size(dim));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const Problem<scalar_t> problem{q.data_ptr<scalar_t>(), cache.data_ptr<scalar_t>(), table.data_ptr<int64_t>(),
                                    out.data_ptr<scalar_t>(), partials.data(), width, heads, heads / kv_heads, dim,
                                    geo};
    run_items(plan.items, problem, threads);
    merge_splits(plan.splits, problem);
  });
}

// A step's k and v [tokens, kv_heads, D] (rows may be strided, D contiguous) into the cache
// at flat slots (block * block_size + offset), one head's D values at a time: the two
// index_copy_ calls of the Python path (and, for HND, its gather of block and offset) in one
// call. The cache's dtype and head size are k's (other caches take the Python path).
void write_kv(at::Tensor& cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
              int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t head_stride,
              int64_t kv_stride) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "write_kv: k and v [tokens, kv_heads, D] of one shape");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "write_kv: k, v and the cache of one dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && cache.stride(-1) == 1 && cache.size(-1) == k.size(2),
              "write_kv: contiguous heads of the cache's head size");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "write_kv: one int64 slot per token");
  const int64_t tokens = k.size(0), heads = k.size(1), item = cache.element_size();
  const int64_t bytes = k.size(2) * item, capacity = cache.size(1) * block_size;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "write_kv: slot ", slot[t], " outside the cache's ", capacity);
  char* base = static_cast<char*>(cache.data_ptr());
  const char* keys = static_cast<const char*>(k.data_ptr());
  const char* values = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    char* at_token = base + ((slot[t] / block_size) * block_stride + (slot[t] % block_size) * token_stride) * item;
    for (int64_t h = 0; h < heads; ++h) {
      char* dst = at_token + h * head_stride * item;
      std::memcpy(dst, keys + (t * k.stride(0) + h * k.stride(1)) * item, bytes);
      std::memcpy(dst + kv_stride * item, values + (t * v.stride(0) + h * v.stride(1)) * item, bytes);
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvferry_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor cache, Tensor table, Tensor seq_lens, Tensor start_pos, "
      "Tensor(a!) out, int kv_heads, int block_size, int block_stride, int token_stride, "
      "int head_stride, int kv_stride, int window, float scale) -> ()");
  m.def(
      "write_kv(Tensor(a!) cache, Tensor k, Tensor v, Tensor slots, int block_size, int block_stride, "
      "int token_stride, int head_stride, int kv_stride) -> ()");
}

TORCH_LIBRARY_IMPL(kvferry_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("write_kv", &write_kv);
}
