// Decode attention over a paged KV cache on the CPU: one query per sequence, keys and values read
// in place from the cache blocks its block table names (no gather into a padded copy).
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
  std::vector<float> scores, acc, denominator, query, block;
};

// Asks the CPU to start loading the cache rows of positions p..last that share p's block (the
// blocks of a sequence are scattered, so the hardware prefetcher restarts at every block).
template <typename T, typename Index>
inline void prefetch_block(const T* blocks, const Index* row_table, int64_t num_blocks, int64_t block_size,
                           int64_t token_stride, int64_t p, int64_t last) {
  if (p > last) return;
  const int64_t in_block = p % block_size;
  const int64_t block = static_cast<int64_t>(row_table[p / block_size]);
  if (block < 0 || block >= num_blocks) return;  // the visit of that block reports it
  const char* start = reinterpret_cast<const char*>(blocks + (block * block_size + in_block) * token_stride);
  const int64_t bytes = std::min(block_size - in_block, last - p + 1) * token_stride * int64_t(sizeof(T));
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset);
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
    prefetch_block(blocks, row_table, num_blocks, block_size, token_stride, p + count, last);
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
// Softmax numerators in place and their sum; a sink joins the maximum and the sum.
inline float softmax_numerators(float* s, int64_t length, const float* sink) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 top16 = _mm512_set1_ps(sink ? *sink : neg_inf);
  int64_t j = 0;
  for (; j + 16 <= length; j += 16) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(s + j));
  float top = _mm512_reduce_max_ps(top16);
  for (; j < length; ++j) top = std::max(top, s[j]);
  const __m512 top_v = _mm512_set1_ps(top);
  __m512 sum16 = _mm512_setzero_ps();
  for (j = 0; j + 16 <= length; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), top_v));
    _mm512_storeu_ps(s + j, e);
    sum16 = _mm512_add_ps(sum16, e);
  }
  if (j < length) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (length - j)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), top_v));
    _mm512_mask_storeu_ps(s + j, tail, e);
    sum16 = _mm512_add_ps(sum16, _mm512_maskz_mov_ps(tail, e));
  }
  return _mm512_reduce_add_ps(sum16) + (sink ? std::exp(*sink - top) : 0.f);
}

#if defined(__AVX512BF16__)
// The sums of eight float32 vectors' lanes, in order.
inline __m256 sums8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// One head's scores over keys k, k + stride, ... (count of them): the bfloat16 dot-product
// instruction (keys not converted, products exact in float32, float32 sums), eight keys' lane
// sums reduced at once.
template <int PAIRS>
void bf16_head_scores(const __m512bh* qh, const c10::BFloat16* k, int64_t stride, int64_t count, float scale,
                      float* out) {
  auto partial = [&](const c10::BFloat16* key) {
    __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[0], (__m512bh)_mm512_loadu_si512(key));
    for (int c = 1; c < PAIRS; ++c) sum = _mm512_dpbf16_ps(sum, qh[c], (__m512bh)_mm512_loadu_si512(key + c * 32));
    return sum;
  };
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    __m256 halves[8];
    for (int j = 0; j < 8; ++j) {
      const __m512 sum = partial(k + (t + j) * stride);
      halves[j] = _mm256_add_ps(_mm512_castps512_ps256(sum), _mm512_extractf32x8_ps(sum, 1));
    }
    _mm256_storeu_ps(out + t, _mm256_mul_ps(sums8(halves), _mm256_set1_ps(scale)));
  }
  for (; t < count; ++t) out[t] = _mm512_reduce_add_ps(partial(k + t * stride)) * scale;
}
#endif

// Scores of the heads of one key group over ``count`` keys k, k + stride, ...: head h's scores go
// to out + h * length. bfloat16 with an even chunk count uses the dot-product instruction; other
// dtypes convert the keys to float32 and hold four heads' (pre-scaled) queries in registers.
template <int CHUNKS, typename T>
void group_scores(const T* k, int64_t stride, int64_t count, const T* q, int64_t per_group, float scale, float* out,
                  int64_t length) {
  constexpr int64_t dim = CHUNKS * 16;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && CHUNKS % 2 == 0) {
    for (int64_t h = 0; h < per_group; ++h) {
      __m512bh qh[CHUNKS / 2];
      for (int c = 0; c < CHUNKS / 2; ++c) qh[c] = (__m512bh)_mm512_loadu_si512(q + h * dim + c * 32);
      bf16_head_scores<CHUNKS / 2>(qh, k, stride, count, scale, out + h * length);
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
        out[(h0 + h) * length + t] = _mm512_reduce_add_ps(sum);
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

// Adds the weighted values of ``count`` keys v, v + stride, ... to the accumulators of one key
// group's heads (acc + h * dim, laid out as load_values loads; weights at weights + h * length),
// four heads' accumulators in registers at a time.
template <int CHUNKS, typename T>
void group_values(const T* v, int64_t stride, int64_t count, const float* weights, int64_t length,
                  int64_t per_group, float* acc) {
  constexpr int64_t dim = CHUNKS * 16;
  for (int64_t h0 = 0; h0 < per_group; h0 += 4) {
    const int64_t heads = std::min<int64_t>(4, per_group - h0);
    __m512 a[4][CHUNKS];
    for (int64_t h = 0; h < heads; ++h)
      for (int c = 0; c < CHUNKS; ++c) a[h][c] = _mm512_loadu_ps(acc + (h0 + h) * dim + c * 16);
    for (int64_t t = 0; t < count; ++t) {
      __m512 vc[CHUNKS];
      load_values<CHUNKS>(v + t * stride, vc);
      for (int64_t h = 0; h < heads; ++h) {
        const __m512 weight = _mm512_set1_ps(weights[(h0 + h) * length + t]);
        for (int c = 0; c < CHUNKS; ++c) a[h][c] = _mm512_fmadd_ps(weight, vc[c], a[h][c]);
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(acc + (h0 + h) * dim + c * 16, a[h][c]);
  }
}

// One sequence, every head, head dim CHUNKS * 16. The cache is walked a block run at a time with
// every key group inside it, so each position's keys and values (all groups side by side) are
// read from memory once: a group at a time would stride through the cache once per group.
template <int CHUNKS, typename T, typename Index>
void decode_row_blocked(const Row<T, Index>& row, const T* q, int64_t heads, int64_t per_group, float scale,
                        const float* sink, Scratch& scratch, T* out) {
  constexpr int64_t dim = CHUNKS * 16;
  std::vector<float>&scores = scratch.scores, &acc = scratch.acc, &denominator = scratch.denominator;
  const int64_t groups = heads / per_group, first = row.first, length = row.last - first + 1;
  for_each_block(row.keys, row.table, row.num_blocks, row.block_size, row.token_stride, first, row.last,
                 [&](const T* rows, int64_t p, int64_t count) {
                   for (int64_t g = 0; g < groups; ++g)
                     group_scores<CHUNKS>(rows + g * dim, row.token_stride, count, q + g * per_group * dim, per_group,
                                          scale, scores.data() + g * per_group * length + p - first, length);
                 });
  denominator.resize(heads);
  for (int64_t h = 0; h < heads; ++h)
    denominator[h] = softmax_numerators(scores.data() + h * length, length, sink ? sink + h : nullptr);
  acc.assign(heads * dim, 0.f);
  for_each_block(row.values, row.table, row.num_blocks, row.block_size, row.token_stride, first, row.last,
                 [&](const T* rows, int64_t p, int64_t count) {
                   for (int64_t g = 0; g < groups; ++g)
                     group_values<CHUNKS>(rows + g * dim, row.token_stride, count,
                                          scores.data() + g * per_group * length + p - first, length, per_group,
                                          acc.data() + g * per_group * dim);
                 });
  for (int64_t h = 0; h < heads; ++h) {
    alignas(64) float values[dim];
    store_values<CHUNKS, T>(acc.data() + h * dim, values);
    const float inverse = 1.f / denominator[h];
    for (int64_t i = 0; i < dim; ++i) out[h * dim + i] = static_cast<T>(values[i] * inverse);
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
// Head dims of 16 to 128 in steps of 16, with AVX-512.
template <typename T, typename Index>
bool decode_row_avx512(const Row<T, Index>& row, const T* q, int64_t heads, int64_t per_group, int64_t dim,
                       float scale, const float* sink, Scratch& scratch, T* out) {
  if constexpr (std::is_same_v<T, double>) return false;  // float64 takes the portable path
  if (dim % 16 != 0 || dim > 128) return false;
  auto run = [&](auto chunks) {
    decode_row_blocked<decltype(chunks)::value>(row, q, heads, per_group, scale, sink, scratch, out);
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

template <typename T, typename Index>
void decode(const at::Tensor& query, const at::Tensor& key_blocks, const at::Tensor& value_blocks,
            const at::Tensor& block_table, const at::Tensor& positions, double scale, int64_t window,
            const c10::optional<at::Tensor>& sinks, at::Tensor& output) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t per_group = heads / key_blocks.size(2);
  const int64_t width = block_table.size(1), block_size = key_blocks.size(1);
  const T* q = query.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* sink = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  T* out = output.data_ptr<T>();
  Row<T, Index> shared{key_blocks.data_ptr<T>(), value_blocks.data_ptr<T>(), block_table.data_ptr<Index>(),
                       key_blocks.size(0), block_size, key_blocks.size(2) * dim, 0, 0};
  // Rows dealt to the threads in turn (thread i takes rows i, i + threads, ...): the rows of a
  // prefill chunk see more keys the later they are, and contiguous ranges would load one thread.
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), batch);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t lane = begin; lane < end; ++lane) {
      for (int64_t b = lane; b < batch; b += threads) {
        TORCH_CHECK(pos[b] >= 0 && pos[b] < width * block_size, "paged_decode_attention: position ", pos[b],
                    " is outside the ", width, " blocks of its block table row");
        Row<T, Index> row = shared;
        row.table += b * width;
        row.last = pos[b];
        row.first = window > 0 ? std::max<int64_t>(0, row.last - window + 1) : 0;
        scratch.scores.resize(heads * (row.last - row.first + 1));
        const T* row_q = q + b * heads * dim;
        T* row_out = out + b * heads * dim;
#if defined(__AVX512F__)
        if (decode_row_avx512(row, row_q, heads, per_group, dim, static_cast<float>(scale), sink, scratch, row_out))
          continue;
#endif
        decode_row_generic(row, row_q, heads, per_group, dim, static_cast<float>(scale), sink, scratch, row_out);
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
