// Decode attention over a paged KV cache on the CPU: one query per sequence, keys and values read
// in place from the cache blocks its block table names (no gather into a padded copy).
//
// Registered as torch.ops.mcore_kernels_cpu.paged_decode_attention; mcore_kernels.native_build
// compiles this file at first use and mcore_kernels.paged_attention calls it. Shapes:
//   query [B, n, d]; key_blocks, value_blocks [num_blocks, block_size, g, d]; block_table [B, W]
//   (int32 or int64); positions [B] (int64, the query's position; it sees keys first..position,
//   first = position - window + 1 with a window > 0, else 0); sinks [n] float32 or None.
// Scores and the softmax are in float32; the output is rounded once to the query's dtype.
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
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
void to_floats(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + 16 <= n; i += 16) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16);
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(wide));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void add_scaled(float w, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

// The cache rows of one sequence, a block at a time: calls visit(row pointer, first position,
// count) for consecutive runs of positions first..last that share a block.
template <typename T, typename Index, typename Visit>
void for_each_block(const T* blocks, const Index* row_table, int64_t num_blocks, int64_t block_size,
                    int64_t token_stride, int64_t first, int64_t last, Visit visit) {
  for (int64_t p = first; p <= last;) {
    const int64_t in_block = p % block_size;
    const int64_t count = std::min(block_size - in_block, last - p + 1);
    const int64_t block = static_cast<int64_t>(row_table[p / block_size]);
    TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block_table names block ",
                block, " of a cache of ", num_blocks, " blocks");
    visit(blocks + (block * block_size + in_block) * token_stride, p, count);
    p += count;
  }
}

template <typename T, typename Index>
void decode(const at::Tensor& query, const at::Tensor& key_blocks, const at::Tensor& value_blocks,
            const at::Tensor& block_table, const at::Tensor& positions, double scale, int64_t window,
            const c10::optional<at::Tensor>& sinks, at::Tensor& output) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = key_blocks.size(0), block_size = key_blocks.size(1);
  const int64_t per_group = heads / key_blocks.size(2);
  const int64_t width = block_table.size(1);
  const int64_t token_stride = key_blocks.size(2) * dim;  // one position of a block: [g, d]
  const T* q = query.data_ptr<T>();
  const T* keys = key_blocks.data_ptr<T>();
  const T* values = value_blocks.data_ptr<T>();
  const Index* table = block_table.data_ptr<Index>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* sink = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  T* out = output.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * dim), acc(heads * dim), rows(block_size * token_stride), scores;
    std::vector<float> denominator(heads);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t last = pos[b];
      TORCH_CHECK(last >= 0 && last < width * block_size, "paged_decode_attention: position ", last,
                  " is outside the ", width, " blocks of its block table row");
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      const int64_t length = last - first + 1;
      const Index* row_table = table + b * width;
      scores.resize(heads * length);
      to_floats(q + b * heads * dim, qf.data(), heads * dim);
      for (float& x : qf) x *= fscale;
      for_each_block(keys, row_table, num_blocks, block_size, token_stride, first, last,
                     [&](const T* block_rows, int64_t p, int64_t count) {
                       to_floats(block_rows, rows.data(), count * token_stride);
                       for (int64_t h = 0; h < heads; ++h) {
                         const float* k = rows.data() + (h / per_group) * dim;
                         float* s = scores.data() + h * length + (p - first);
                         for (int64_t t = 0; t < count; ++t) s[t] = dot(qf.data() + h * dim, k + t * token_stride, dim);
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
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_block(values, row_table, num_blocks, block_size, token_stride, first, last,
                     [&](const T* block_rows, int64_t p, int64_t count) {
                       to_floats(block_rows, rows.data(), count * token_stride);
                       for (int64_t h = 0; h < heads; ++h) {
                         const float* v = rows.data() + (h / per_group) * dim;
                         const float* s = scores.data() + h * length + (p - first);
                         for (int64_t t = 0; t < count; ++t) add_scaled(s[t], v + t * token_stride, acc.data() + h * dim, dim);
                       }
                     });
      for (int64_t h = 0; h < heads; ++h) {
        T* o = out + (b * heads + h) * dim;
        const float inverse = 1.f / denominator[h];
        for (int64_t i = 0; i < dim; ++i) o[i] = static_cast<T>(acc[h * dim + i] * inverse);
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
