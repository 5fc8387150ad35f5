// Decode attention over a paged KV cache on the CPU: one query per row, keys and values read in
// place from the cache blocks its block table names (no gather into a padded copy). Consecutive
// rows of one sequence at consecutive positions (a prefill chunk's) are computed as a tile that
// reads each key and value once; the rows are dealt to the threads longest first.
//
// Registered as torch.ops.mcore_kernels_cpu.paged_decode_attention; mcore_kernels.native_build
// compiles this file at first use and mcore_kernels.paged_attention calls it. Shapes:
//   query [B, n, d]; key_blocks, value_blocks [num_blocks, block_size, g, d]; block_table [B, W]
//   (int32 or int64); positions [B] (int64, the query's position; it sees keys first..position,
//   first = position - window + 1 with a window > 0, else 0); sinks [n] float32 or None.
// Scores and the softmax are in float32 (bfloat16 scores from the bfloat16 dot-product instruction
// where the CPU has it: exact products, float32 sums); the output is rounded once to the query's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace mcore_kernels;

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void add_scaled(float w, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

// The float32 buffers one thread reuses for every row it computes (grown as needed, never freed
// between rows): scores [heads, keys], accumulators and the query [heads, dim], per-head softmax
// denominators, a block converted to float32.
struct Scratch {
  std::vector<float> scores, acc, denominator, query, block, top, weights, factor;
  std::vector<int32_t> pairs, range;
};

// Starts loading the cache line at ``address`` into L2. On x86 an asm statement: GCC 12 deletes a
// loop of __builtin_prefetch calls whose trip count it computes with std::min (found by reading
// the compiled kernel: not one prefetch instruction was left).
inline void prefetch_line(const char* address) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*address));
#else
  __builtin_prefetch(address, 0, 2);
#endif
}

// Asks the CPU to bring the cache rows of positions p..last that share p's block, at most ``span``
// of them, into L2 while the current ones are computed. A block's rows are contiguous, but the
// blocks of a sequence are scattered, so the hardware prefetcher restarts at every block: with
// caches far larger than the CPU's, prefetching the next span took the tile walk of a decode step
// from 1064 to 759 us per layer (64 sequences of 32-384 positions, blocks of 16, 8 layers).
template <typename T, typename Index>
inline void prefetch_block(const T* blocks, const Index* row_table, int64_t num_blocks, int64_t block_size,
                           int64_t token_stride, int64_t p, int64_t last, int64_t span) {
  if (p > last) return;
  const int64_t in_block = p % block_size;
  const int64_t block = static_cast<int64_t>(row_table[p / block_size]);
  if (block < 0 || block >= num_blocks) return;  // the visit of that block reports it
  const char* start = reinterpret_cast<const char*>(blocks + (block * block_size + in_block) * token_stride);
  const int64_t rows = std::min({span, block_size - in_block, last - p + 1});
  const int64_t bytes = rows * token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t offset = 0; offset < bytes; offset += 64) prefetch_line(start + offset);
}

// The cache rows of one sequence, a block at a time: calls visit(row pointer, first position,
// count) for consecutive runs of positions first..last that share a block, the next run's rows
// being prefetched meanwhile.
template <typename T, typename Index, typename Visit>
void for_each_block(const T* blocks, const Index* row_table, int64_t num_blocks, int64_t block_size,
                    int64_t token_stride, int64_t first, int64_t last, Visit visit) {
  for (int64_t p = first; p <= last;) {
    const int64_t in_block = p % block_size;
    const int64_t count = std::min(block_size - in_block, last - p + 1);
    const int64_t block = static_cast<int64_t>(row_table[p / block_size]);
    TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block_table names block ",
                block, " of a cache of ", num_blocks, " blocks");
    prefetch_block(blocks, row_table, num_blocks, block_size, token_stride, p + count, last, block_size);
    visit(blocks + (block * block_size + in_block) * token_stride, p, count);
    p += count;
  }
}

// The cache layout and the sequence being computed.
template <typename T, typename Index>
struct Row {
  const T* keys;  // key_blocks, values likewise: [num_blocks, block_size, g, d]
  const T* values;
  const Index* table;  // this sequence's block table row
  int64_t num_blocks, block_size, token_stride;  // token_stride: one position of a block, g * d
  int64_t first, last;  // the positions it sees
};

#if defined(__AVX512F__)
// Keys are walked in spans of at most 16 positions inside one block.
constexpr int64_t kSpan = 16;

#if defined(__AVX512BF16__)
// The sums of eight float32 vectors' lanes, in order.
inline __m256 sums8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// One head's unscaled scores over keys k, k + stride, ... (count <= 16 of them; lanes past count
// are 0): the bfloat16 dot-product instruction (keys not converted, products exact in float32,
// float32 sums), eight keys' lane sums reduced at once.
template <int PAIRS>
inline __m512 bf16_span_scores(const __m512bh* qh, const c10::BFloat16* k, int64_t stride, int64_t count) {
  __m256 sums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t e = 0; e < 2 && 8 * e < count; ++e) {
    __m256 halves[8];
    for (int64_t j = 0; j < 8; ++j) {
      if (8 * e + j >= count) {
        halves[j] = _mm256_setzero_ps();
        continue;
      }
      const c10::BFloat16* key = k + (8 * e + j) * stride;
      __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[0], (__m512bh)_mm512_loadu_si512(key));
      for (int c = 1; c < PAIRS; ++c) sum = _mm512_dpbf16_ps(sum, qh[c], (__m512bh)_mm512_loadu_si512(key + c * 32));
      halves[j] = _mm256_add_ps(_mm512_castps512_ps256(sum), _mm512_extractf32x8_ps(sum, 1));
    }
    sums[e] = sums8(halves);
  }
  return _mm512_insertf32x8(_mm512_castps256_ps512(sums[0]), sums[1], 1);
}
#endif

// Scaled scores of a key group's heads over ``count`` (<= 16) keys k, k + stride, ...: head h's
// at out + 16 h. bfloat16 with an even chunk count uses the dot-product instruction; other dtypes
// convert the keys to float32 and hold four heads' (pre-scaled) queries in registers.
template <int CHUNKS, typename T>
void span_scores(const T* k, int64_t stride, int64_t count, const T* q, int64_t per_group, float scale, float* out) {
  constexpr int64_t dim = CHUNKS * 16;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && CHUNKS % 2 == 0) {
    for (int64_t h = 0; h < per_group; ++h) {
      __m512bh qh[CHUNKS / 2];
      for (int c = 0; c < CHUNKS / 2; ++c) qh[c] = (__m512bh)_mm512_loadu_si512(q + h * dim + c * 32);
      _mm512_storeu_ps(out + 16 * h,
                      _mm512_mul_ps(bf16_span_scores<CHUNKS / 2>(qh, k, stride, count), _mm512_set1_ps(scale)));
    }
    return;
  }
#endif
  for (int64_t h0 = 0; h0 < per_group; h0 += 4) {
    const int64_t heads = std::min<int64_t>(4, per_group - h0);
    __m512 qh[4][CHUNKS];
    for (int64_t h = 0; h < heads; ++h)
      for (int c = 0; c < CHUNKS; ++c) qh[h][c] = _mm512_mul_ps(load16(q + (h0 + h) * dim + c * 16), _mm512_set1_ps(scale));
    for (int64_t t = 0; t < count; ++t) {
      __m512 kc[CHUNKS];
      for (int c = 0; c < CHUNKS; ++c) kc[c] = load16(k + t * stride + c * 16);
      for (int64_t h = 0; h < heads; ++h) {
        __m512 sum = _mm512_mul_ps(qh[h][0], kc[0]);
        for (int c = 1; c < CHUNKS; ++c) sum = _mm512_fmadd_ps(qh[h][c], kc[c], sum);
        out[16 * (h0 + h) + t] = _mm512_reduce_add_ps(sum);
      }
    }
  }
}

// The values of bfloat16 rows split into their even and odd elements (vc[2j], vc[2j + 1] hold
// elements 32j, 32j + 2, ... and 32j + 1, 32j + 3, ...): two integer ops per 32 values instead of
// a widening per 16. Other dtypes and head dims load 16 values per vector in order.
template <int CHUNKS, typename T>
inline void load_values(const T* v, __m512* vc) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && CHUNKS % 2 == 0) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int j = 0; j < CHUNKS / 2; ++j) {
      const __m512i raw = _mm512_loadu_si512(v + 32 * j);
      vc[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      vc[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    }
  } else {
    for (int c = 0; c < CHUNKS; ++c) vc[c] = load16(v + c * 16);
  }
}

// Accumulators laid out as load_values loads, written to ``row`` in element order.
template <int CHUNKS, typename T>
inline void store_values(const float* acc, float* row) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && CHUNKS % 2 == 0) {
    for (int j = 0; j < CHUNKS / 2; ++j)
      for (int i = 0; i < 16; ++i) row[32 * j + 2 * i] = acc[32 * j + i], row[32 * j + 2 * i + 1] = acc[32 * j + 16 + i];
  } else {
    std::memcpy(row, acc, CHUNKS * 16 * sizeof(float));
  }
}

// Rescales the accumulators of ``queries`` (query j's at acc + j * dim, laid out as load_values
// loads) by factor[j] and adds the weighted values of keys lo .. hi - 1 of v, v + stride, ...
// (query j's weight of key t at weights[j * per_query + t * per_key]), a few queries'
// accumulators in registers at a time.
template <int CHUNKS, typename T>
void span_values(const T* v, int64_t stride, int64_t lo, int64_t hi, const float* weights, int64_t per_query,
                 int64_t per_key, const float* factor, int64_t queries, float* acc) {
  constexpr int64_t dim = CHUNKS * 16;
  constexpr int64_t kQueries = CHUNKS <= 4 ? 4 : 2;  // accumulators and values fit the 32 registers
  for (int64_t j0 = 0; j0 < queries; j0 += kQueries) {
    const int64_t n = std::min<int64_t>(kQueries, queries - j0);
    __m512 a[kQueries][CHUNKS];
    for (int64_t j = 0; j < n; ++j) {
      const __m512 f = _mm512_set1_ps(factor[j0 + j]);
      for (int c = 0; c < CHUNKS; ++c) a[j][c] = _mm512_mul_ps(f, _mm512_loadu_ps(acc + (j0 + j) * dim + c * 16));
    }
    for (int64_t t = lo; t < hi; ++t) {
      __m512 vc[CHUNKS];
      load_values<CHUNKS>(v + t * stride, vc);
      for (int64_t j = 0; j < n; ++j) {
        const __m512 weight = _mm512_set1_ps(weights[(j0 + j) * per_query + t * per_key]);
        for (int c = 0; c < CHUNKS; ++c) a[j][c] = _mm512_fmadd_ps(weight, vc[c], a[j][c]);
      }
    }
    for (int64_t j = 0; j < n; ++j)
      for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(acc + (j0 + j) * dim + c * 16, a[j][c]);
  }
}

#if defined(__AVX512BF16__)
// Scores of up to 16 queries (one per lane; pairs + 16 i holds their elements 2i, 2i + 1) against
// ``count`` (<= 16) bfloat16 keys k, k + stride, ...: key t's scores in s[t] (lanes across
// queries, so the softmax needs no horizontal sums). Each key's element pair is broadcast.
template <int PAIRS, bool FULL>
inline void lane_scores(const int32_t* pairs, const c10::BFloat16* k, int64_t stride, int64_t count, __m512* s) {
  for (int t = 0; t < 16; ++t) s[t] = _mm512_setzero_ps();
  for (int i = 0; i < PAIRS * 16; ++i) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(pairs + 16 * i);
    for (int t = 0; t < 16; ++t) {
      if (!FULL && t >= count) break;
      int32_t word;
      std::memcpy(&word, k + t * stride + 2 * i, sizeof(word));
      s[t] = _mm512_dpbf16_ps(s[t], q, (__m512bh)_mm512_set1_epi32(word));
    }
  }
}
#endif

// One tile (rows of one sequence at consecutive positions, its queries q and outputs out [rows,
// heads, dim]), every head, head dim CHUNKS * 16, in one pass over the positions ``walk`` spans:
// each span's keys and values (every key group side by side) are read from memory once for the
// whole tile, and each row's softmax runs online (running maximum, denominator and accumulators,
// rescaled when the maximum grows). A key group's queries (rows x heads per group, row-major) are
// its "queries" here. With bfloat16 and at least 8 of them they are scored 16 at a time, one per
// lane; otherwise one at a time, keys across lanes.
template <int CHUNKS, typename T, typename Index>
void attend_tile(const Row<T, Index>& walk, const int64_t* positions, int64_t rows,
                 int64_t window, const T* q, int64_t heads, int64_t per_group, float scale, const float* sink,
                 Scratch& scratch, T* out) {
  constexpr int64_t dim = CHUNKS * 16;
  const int64_t groups = heads / per_group, queries = rows * per_group;  // queries of one group
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float>&acc = scratch.acc, &top = scratch.top, &denominator = scratch.denominator;
  acc.assign(rows * heads * dim, 0.f);  // [group, row, head of the group, dim]: a group's queries together
  top.resize(rows * heads);
  denominator.resize(rows * heads);
  for (int64_t i = 0; i < rows * heads; ++i) {  // a sink starts the maximum and adds exp(0) to the sum
    const int64_t head = i / queries * per_group + i % per_group;
    // -max, not -inf: a lane that has seen no key yet must not compute -inf - -inf
    top[i] = sink ? sink[head] : -std::numeric_limits<float>::max();
    denominator[i] = sink ? 1.f : 0.f;
  }
  const int64_t batches = (queries + 15) / 16;
  scratch.weights.resize(16 * std::max<int64_t>(per_group, 16));
  scratch.factor.resize(std::max<int64_t>(per_group, 16));
  float* weights = scratch.weights.data();
  float* factor = scratch.factor.data();
  bool lanes = false;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && CHUNKS % 2 == 0) {
    lanes = queries >= 8;
    if (lanes) {  // the queries' element pairs, a batch of 16 per (group, batch, pair)
      scratch.pairs.assign(groups * batches * (dim / 2) * 16, 0);
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t j = 0; j < queries; ++j) {
          const T* query = q + ((j / per_group) * heads + g * per_group + j % per_group) * dim;
          for (int64_t i = 0; i < dim / 2; ++i)
            std::memcpy(&scratch.pairs[((g * batches + j / 16) * (dim / 2) + i) * 16 + j % 16], query + 2 * i, 4);
        }
      scratch.range.resize(2 * batches * 16);  // each lane's first and last position, from walk.first
      for (int64_t j = 0; j < batches * 16; ++j) {
        const int64_t last = positions[std::min(j, queries - 1) / per_group];
        const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
        scratch.range[j] = static_cast<int32_t>(first - walk.first);
        scratch.range[batches * 16 + j] = static_cast<int32_t>(last - walk.first);
      }
    }
  }
#endif
  const int64_t block_size = walk.block_size, stride = walk.token_stride;
  for (int64_t p = walk.first; p <= walk.last;) {
    const int64_t in_block = p % block_size;
    const int64_t count = std::min({kSpan - in_block % kSpan, block_size - in_block, walk.last - p + 1});
    const int64_t block = static_cast<int64_t>(walk.table[p / block_size]);
    TORCH_CHECK(block >= 0 && block < walk.num_blocks, "paged_decode_attention: block_table names block ", block,
                " of a cache of ", walk.num_blocks, " blocks");
    const T* keys = walk.keys + (block * block_size + in_block) * stride;
    const T* values = walk.values + (block * block_size + in_block) * stride;
    for (const T* blocks : {walk.keys, walk.values})  // the next span's, in the next block if this one ends
      prefetch_block(blocks, walk.table, walk.num_blocks, block_size, stride, p + count, walk.last,
                     kSpan - (p + count) % block_size % kSpan);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16> && CHUNKS % 2 == 0) {
      if (lanes) {
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t b = 0; b < batches; ++b) {
            const int64_t j0 = g * queries + 16 * b, n = std::min<int64_t>(16, queries - 16 * b);
            const __mmask16 used = static_cast<__mmask16>((1u << n) - 1);
            __m512 s[16];
            const int32_t* pairs = scratch.pairs.data() + (g * batches + b) * (dim / 2) * 16;
            if (count == 16)  // keys unrolled, their scores in registers
              lane_scores<CHUNKS / 2, true>(pairs, keys + g * dim, stride, count, s);
            else
              lane_scores<CHUNKS / 2, false>(pairs, keys + g * dim, stride, count, s);
            const __m512i first = _mm512_loadu_si512(scratch.range.data() + 16 * b);
            const __m512i last = _mm512_loadu_si512(scratch.range.data() + batches * 16 + 16 * b);
            const __m512 old_top = _mm512_maskz_loadu_ps(used, top.data() + j0);
            __m512 peak = old_top;
            __mmask16 seen[16];
            for (int64_t t = 0; t < count; ++t) {
              const __m512i at = _mm512_set1_epi32(static_cast<int32_t>(p + t - walk.first));
              seen[t] = _mm512_cmple_epi32_mask(first, at) & _mm512_cmple_epi32_mask(at, last);
              s[t] = _mm512_mask_mul_ps(_mm512_set1_ps(neg_inf), seen[t], s[t], _mm512_set1_ps(scale));
              peak = _mm512_max_ps(peak, s[t]);
            }
            const __m512 f = exp16(_mm512_sub_ps(old_top, peak));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < count; ++t) {
              const __m512 e = _mm512_maskz_mov_ps(seen[t], exp16(_mm512_sub_ps(s[t], peak)));
              _mm512_storeu_ps(weights + 16 * t, e);
              sum = _mm512_add_ps(sum, e);
            }
            _mm512_storeu_ps(factor, f);
            _mm512_mask_storeu_ps(top.data() + j0, used, peak);
            _mm512_mask_storeu_ps(denominator.data() + j0, used,
                                  _mm512_fmadd_ps(_mm512_maskz_loadu_ps(used, denominator.data() + j0), f, sum));
            span_values<CHUNKS>(values + g * dim, stride, 0, count, weights, 1, 16, factor, n, acc.data() + j0 * dim);
          }
        p += count;
        continue;
      }
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t last = positions[r], first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      const int64_t hi = std::min(count, last - p + 1), lo = std::max<int64_t>(0, first - p);
      if (lo >= hi) continue;  // the row sees none of the span
      const __mmask16 seen = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t j0 = g * queries + r * per_group;  // the row's first query of the group
        span_scores<CHUNKS>(keys + g * dim, stride, hi, q + (r * heads + g * per_group) * dim, per_group, scale,
                            weights);
        for (int64_t h = 0; h < per_group; ++h) {
          const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), seen, _mm512_loadu_ps(weights + 16 * h));
          const float peak = std::max(top[j0 + h], _mm512_reduce_max_ps(s));
          const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(s, _mm512_set1_ps(peak))));
          _mm512_storeu_ps(weights + 16 * h, e);
          factor[h] = std::exp(top[j0 + h] - peak);
          denominator[j0 + h] = denominator[j0 + h] * factor[h] + _mm512_reduce_add_ps(e);
          top[j0 + h] = peak;
        }
        span_values<CHUNKS>(values + g * dim, stride, lo, hi, weights, 16, 1, factor, per_group,
                            acc.data() + j0 * dim);
      }
    }
    p += count;
  }
  for (int64_t i = 0; i < rows * heads; ++i) {
    alignas(64) float row[dim];
    store_values<CHUNKS, T>(acc.data() + i * dim, row);
    const float inverse = 1.f / denominator[i];
    const int64_t g = i / queries, r = i % queries / per_group, h = i % per_group;
    T* o = out + (r * heads + g * per_group + h) * dim;
    for (int64_t j = 0; j < dim; ++j) o[j] = static_cast<T>(row[j] * inverse);
  }
}
#endif

// Any head dim and instruction set: keys and values of a block converted to float32 at once.
template <typename T, typename Index>
void decode_row_generic(const Row<T, Index>& row, const T* q, int64_t heads, int64_t per_group, int64_t dim,
                        float scale, const float* sink, Scratch& scratch, T* out) {
  const int64_t length = row.last - row.first + 1;
  std::vector<float>&scores = scratch.scores, &acc = scratch.acc, &denominator = scratch.denominator;
  std::vector<float>&qf = scratch.query, &floats = scratch.block;
  qf.resize(heads * dim);
  acc.assign(heads * dim, 0.f);
  floats.resize(row.block_size * row.token_stride);
  denominator.resize(heads);
  to_floats(q, qf.data(), heads * dim);
  for (float& x : qf) x *= scale;
  for_each_block(row.keys, row.table, row.num_blocks, row.block_size, row.token_stride, row.first, row.last,
                 [&](const T* block_rows, int64_t p, int64_t count) {
                   to_floats(block_rows, floats.data(), count * row.token_stride);
                   for (int64_t h = 0; h < heads; ++h) {
                     const float* k = floats.data() + (h / per_group) * dim;
                     float* s = scores.data() + h * length + (p - row.first);
                     for (int64_t t = 0; t < count; ++t) s[t] = dot(qf.data() + h * dim, k + t * row.token_stride, dim);
                   }
                 });
  for (int64_t h = 0; h < heads; ++h) {  // softmax, a sink joining the denominator
    float* s = scores.data() + h * length;
    float top = sink ? sink[h] : -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < length; ++j) top = std::max(top, s[j]);
    for (int64_t j = 0; j < length; ++j) s[j] = std::exp(s[j] - top);
    float sum = sink ? std::exp(sink[h] - top) : 0.f;
    for (int64_t j = 0; j < length; ++j) sum += s[j];
    denominator[h] = sum;
  }
  for_each_block(row.values, row.table, row.num_blocks, row.block_size, row.token_stride, row.first, row.last,
                 [&](const T* block_rows, int64_t p, int64_t count) {
                   to_floats(block_rows, floats.data(), count * row.token_stride);
                   for (int64_t h = 0; h < heads; ++h) {
                     const float* v = floats.data() + (h / per_group) * dim;
                     const float* s = scores.data() + h * length + (p - row.first);
                     for (int64_t t = 0; t < count; ++t) add_scaled(s[t], v + t * row.token_stride, acc.data() + h * dim, dim);
                   }
                 });
  for (int64_t h = 0; h < heads; ++h) {
    const float inverse = 1.f / denominator[h];
    for (int64_t i = 0; i < dim; ++i) out[h * dim + i] = static_cast<T>(acc[h * dim + i] * inverse);
  }
}

#if defined(__AVX512F__)
// attend_tile for head dims of 16 to 128 in steps of 16 (false for other dims and float64).
template <typename T, typename Index>
bool attend_tile_avx512(const Row<T, Index>& walk, const int64_t* positions,
                        int64_t rows, int64_t window, const T* q, int64_t heads, int64_t per_group, int64_t dim,
                        float scale, const float* sink, Scratch& scratch, T* out) {
  if constexpr (std::is_same_v<T, double>) return false;  // float64 takes the portable path
  if (dim % 16 != 0 || dim > 128) return false;
  auto run = [&](auto chunks) {
    attend_tile<decltype(chunks)::value>(walk, positions, rows, window, q, heads, per_group, scale, sink,
                                         scratch, out);
  };
  switch (dim / 16) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 5: run(std::integral_constant<int, 5>{}); break;
    case 6: run(std::integral_constant<int, 6>{}); break;
    case 7: run(std::integral_constant<int, 7>{}); break;
    default: run(std::integral_constant<int, 8>{}); break;
  }
  return true;
}
#endif

// Rows row .. row + rows - 1: one sequence's (the same block table row) at consecutive positions,
// as a prefill chunk's rows come; a decode row is a tile of one. cost orders the tiles.
struct Tile {
  int64_t row, rows, cost;
};

constexpr int64_t kTileRows = 16;  // 32 measured slower, 8 no faster

template <typename T, typename Index>
void decode(const at::Tensor& query, const at::Tensor& key_blocks, const at::Tensor& value_blocks,
            const at::Tensor& block_table, const at::Tensor& positions, double scale, int64_t window,
            const c10::optional<at::Tensor>& sinks, at::Tensor& output) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t per_group = heads / key_blocks.size(2);
  const int64_t width = block_table.size(1), block_size = key_blocks.size(1);
  const T* q = query.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const Index* table = block_table.data_ptr<Index>();
  const float* sink = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  T* out = output.data_ptr<T>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(pos[b] >= 0 && pos[b] < width * block_size, "paged_decode_attention: position ", pos[b],
                " is outside the ", width, " blocks of its block table row");
  auto first_of = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, pos[b] - window + 1) : 0; };
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < batch;) {
    int64_t rows = 1, cost = pos[b] - first_of(b) + 1;
    while (rows < kTileRows && b + rows < batch && pos[b + rows] == pos[b + rows - 1] + 1 &&
           std::equal(table + b * width, table + (b + 1) * width, table + (b + rows) * width))
      cost += pos[b + rows] - first_of(b + rows) + 1, ++rows;
    tiles.push_back({b, rows, cost + pos[b + rows - 1] - first_of(b) + 1});  // the rows' work and the walk
    b += rows;
  }
  // Longest first, each thread taking the next tile when it is done with one: rows' lengths vary.
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  auto walk_of = [&](const Tile& tile) {
    return Row<T, Index>{key_blocks.data_ptr<T>(), value_blocks.data_ptr<T>(), table + tile.row * width,
                         key_blocks.size(0), block_size, key_blocks.size(2) * dim, first_of(tile.row),
                         pos[tile.row + tile.rows - 1]};
  };
  const int64_t count = static_cast<int64_t>(tiles.size());
  std::atomic<int64_t> taken{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = taken++; i < count; i = taken++) {
      const Tile& tile = tiles[i];
      const Row<T, Index> walk = walk_of(tile);
      const T* tile_q = q + tile.row * heads * dim;
      T* tile_out = out + tile.row * heads * dim;
#if defined(__AVX512F__)
      if (attend_tile_avx512(walk, pos + tile.row, tile.rows, window, tile_q,
                             heads, per_group, dim, static_cast<float>(scale), sink, scratch, tile_out))
        continue;
#endif
      for (int64_t r = 0; r < tile.rows; ++r) {
        Row<T, Index> row = walk;
        row.last = pos[tile.row + r];
        row.first = first_of(tile.row + r);
        scratch.scores.resize(heads * (row.last - row.first + 1));
        decode_row_generic(row, tile_q + r * heads * dim, heads, per_group, dim, static_cast<float>(scale), sink,
                           scratch, tile_out + r * heads * dim);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_blocks,
                                  const at::Tensor& value_blocks, const at::Tensor& block_table,
                                  const at::Tensor& positions, double scale, int64_t window,
                                  const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && key_blocks.dim() == 4 && key_blocks.sizes() == value_blocks.sizes(),
              "paged_decode_attention: query [B, n, d], key and value blocks [N, s, g, d]");
  TORCH_CHECK(query.size(2) == key_blocks.size(3) && query.size(1) % key_blocks.size(2) == 0,
              "paged_decode_attention: head dims differ or query heads are not a multiple of key heads");
  TORCH_CHECK(query.is_contiguous() && key_blocks.is_contiguous() && value_blocks.is_contiguous() &&
                  block_table.is_contiguous() && positions.is_contiguous(),
              "paged_decode_attention: tensors must be contiguous");
  TORCH_CHECK(key_blocks.scalar_type() == query.scalar_type() && value_blocks.scalar_type() == query.scalar_type(),
              "paged_decode_attention: query, key and value blocks share one dtype");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == query.size(0) && positions.dim() == 1 &&
                  positions.size(0) == query.size(0) && positions.scalar_type() == at::kLong,
              "paged_decode_attention: block_table [B, W] and int64 positions [B]");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->numel() == query.size(1)),
              "paged_decode_attention: sinks are float32 [n]");
  auto output = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    if (block_table.scalar_type() == at::kInt) {
      decode<scalar_t, int32_t>(query, key_blocks, value_blocks, block_table, positions, scale, window, sinks, output);
    } else {
      TORCH_CHECK(block_table.scalar_type() == at::kLong, "paged_decode_attention: block_table is int32 or int64");
      decode<scalar_t, int64_t>(query, key_blocks, value_blocks, block_table, positions, scale, window, sinks, output);
    }
  });
  return output;
}

}  // namespace

TORCH_LIBRARY(mcore_kernels_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_blocks, Tensor value_blocks, Tensor block_table, "
      "Tensor positions, float scale, int window, Tensor? sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(mcore_kernels_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
