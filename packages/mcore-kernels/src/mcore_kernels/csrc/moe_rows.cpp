// MoE token permutation on the CPU: the two row moves behind moe_permute and moe_unpermute, forward
// and backward, with the semantics of the Triton kernels. row_map [T, k] (int64) names the row of
// token t's j-th assignment, -1 where it is dropped. Arithmetic in float32, one rounding per output.
//
// torch.ops.mcore_kernels_cpu.moe_scatter_rows(src [T, h], row_map, weights [T, k]?, num_rows,
//     other [num_rows, h]?) -> (dst [num_rows, h], dots [T, k] float32, empty without other):
//     dst[row_map[t, j]] = weights[t, j] * src[t], zeros in the rows no assignment names;
//     dots[t, j] = <src[t], other[row_map[t, j]]> (zero for dropped assignments).
// torch.ops.mcore_kernels_cpu.moe_gather_rows(src [R, h], row_map, weights [T, k]?) -> [T, h]:
//     the sum over kept j of weights[t, j] * src[row_map[t, j]], in j order.
//
// Rows past the destination or the source, and (for the scatter) a row named twice, are errors
// (ValueError in Python): one pass over row_map checks them before any row moves.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <vector>

#include "simd.h"

namespace {

using namespace mcore_kernels;

// The float32 weights of row_map's assignments, or an undefined tensor.
at::Tensor float_weights(const std::optional<at::Tensor>& weights, const at::Tensor& row_map, const char* op) {
  if (!weights.has_value()) return at::Tensor();
  TORCH_CHECK(weights->sizes() == row_map.sizes(), op, ": weights must have row_map's shape");
  return weights->to(at::kFloat).contiguous();
}

// Checks that row_map's kept rows lie below limit (and, if distinct, that none repeats); returns
// which of the limit rows it names when distinct, else an empty vector.
std::vector<char> check_rows(const at::Tensor& row_map, int64_t limit, bool distinct, const char* op) {
  TORCH_CHECK(row_map.dim() == 2 && row_map.scalar_type() == at::kLong && row_map.is_contiguous(), op,
              ": row_map must be a contiguous int64 [T, k] tensor");
  const int64_t* rows = row_map.data_ptr<int64_t>();
  std::vector<char> named(distinct ? limit : 0, 0);
  for (int64_t i = 0; i < row_map.numel(); ++i) {
    const int64_t row = rows[i];
    if (row < 0) continue;
    TORCH_CHECK_VALUE(row < limit, op, ": row_map names row ", row, " of ", limit);
    if (!distinct) continue;
    TORCH_CHECK_VALUE(!named[row], op, ": row_map names row ", row, " twice");
    named[row] = 1;
  }
  return named;
}

// dst = weight * src over h columns, converted through float32.
template <typename T>
void scaled_copy(const T* src, float weight, bool weighted, int64_t h, T* dst) {
  if (!weighted) {
    std::memcpy(dst, src, h * sizeof(T));
    return;
  }
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 w = _mm512_set1_ps(weight);
  for (; i + 16 <= h; i += 16) store16(dst + i, _mm512_mul_ps(load16(src + i), w));
#endif
  for (; i < h; ++i) dst[i] = static_cast<T>(to_float(src[i]) * weight);
}

template <typename T>
float dot(const T* a, const T* b, int64_t h) {
  float total = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 lanes = _mm512_setzero_ps();
  for (; i + 16 <= h; i += 16) lanes = _mm512_fmadd_ps(load16(a + i), load16(b + i), lanes);
  total = _mm512_reduce_add_ps(lanes);
#endif
  for (; i < h; ++i) total += to_float(a[i]) * to_float(b[i]);
  return total;
}

template <typename T>
void scatter_kernel(const at::Tensor& src, const int64_t* row_map, int64_t k, const std::vector<char>& named,
                    const float* weights, const T* other, float* dots, at::Tensor& dst) {
  const int64_t tokens = src.size(0), h = src.size(1), num_rows = dst.size(0);
  const T* in = src.data_ptr<T>();
  T* out = dst.data_ptr<T>();
  at::parallel_for(0, num_rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      if (!named[r]) std::memset(out + r * h, 0, h * sizeof(T));
  });
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = row_map[t * k + j];
        if (dots) dots[t * k + j] = row >= 0 ? dot(in + t * h, other + row * h, h) : 0.f;
        if (row >= 0) scaled_copy(in + t * h, weights ? weights[t * k + j] : 1.f, weights != nullptr, h, out + row * h);
      }
    }
  });
}

template <typename T>
void gather_kernel(const T* src, const int64_t* row_map, int64_t tokens, int64_t k, const float* weights, int64_t h,
                   T* out) {
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> total(h);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = row_map[t * k + j];
        if (row < 0) continue;
        const float w = weights ? weights[t * k + j] : 1.f;
        const T* x = src + row * h;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 wv = _mm512_set1_ps(w);
        for (; i + 16 <= h; i += 16)
          _mm512_storeu_ps(total.data() + i, _mm512_fmadd_ps(load16(x + i), wv, _mm512_loadu_ps(total.data() + i)));
#endif
        for (; i < h; ++i) total[i] += to_float(x[i]) * w;
      }
      T* o = out + t * h;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= h; i += 16) store16(o + i, _mm512_loadu_ps(total.data() + i));
#endif
      for (; i < h; ++i) o[i] = static_cast<T>(total[i]);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> moe_scatter_rows(const at::Tensor& src, const at::Tensor& row_map,
                                                    const std::optional<at::Tensor>& weights, int64_t num_rows,
                                                    const std::optional<at::Tensor>& other) {
  constexpr const char* op = "moe_permute";  // and moe_unpermute's backward
  TORCH_CHECK(src.dim() == 2 && src.is_contiguous(), op, ": src must be a contiguous [T, h] tensor");
  TORCH_CHECK(row_map.dim() == 2 && row_map.size(0) == src.size(0), op, ": row_map must be [T, k] for src's T");
  TORCH_CHECK(num_rows >= 0, op, ": num_rows must be non-negative");
  const std::vector<char> named = check_rows(row_map, num_rows, /*distinct=*/true, op);
  const at::Tensor w = float_weights(weights, row_map, op);
  at::Tensor dst = at::empty({num_rows, src.size(1)}, src.options());
  at::Tensor dots;
  if (other.has_value()) {
    TORCH_CHECK(other->dim() == 2 && other->is_contiguous() && other->size(0) == num_rows &&
                    other->size(1) == src.size(1) && other->scalar_type() == src.scalar_type(),
                op, ": other must be a contiguous [num_rows, h] tensor of src's dtype");
    dots = at::empty(row_map.sizes(), src.options().dtype(at::kFloat));
  }
  MCORE_DISPATCH_FLOAT_TYPES(src.scalar_type(), op, [&] {
    scatter_kernel<scalar_t>(src, row_map.data_ptr<int64_t>(), row_map.size(1), named,
                             w.defined() ? w.data_ptr<float>() : nullptr,
                             other.has_value() ? other->data_ptr<scalar_t>() : nullptr,
                             dots.defined() ? dots.data_ptr<float>() : nullptr, dst);
  });
  if (!dots.defined()) dots = at::empty({0}, src.options().dtype(at::kFloat));
  return {dst, dots};
}

at::Tensor moe_gather_rows(const at::Tensor& src, const at::Tensor& row_map, const std::optional<at::Tensor>& weights) {
  constexpr const char* op = "moe_unpermute";  // and moe_permute's backward
  TORCH_CHECK(src.dim() == 2 && src.is_contiguous(), op, ": src must be a contiguous [R, h] tensor");
  check_rows(row_map, src.size(0), /*distinct=*/false, op);
  const at::Tensor w = float_weights(weights, row_map, op);
  const int64_t tokens = row_map.size(0), h = src.size(1);
  at::Tensor out = at::empty({tokens, h}, src.options());
  MCORE_DISPATCH_FLOAT_TYPES(src.scalar_type(), op, [&] {
    gather_kernel<scalar_t>(src.data_ptr<scalar_t>(), row_map.data_ptr<int64_t>(), tokens, row_map.size(1),
                            w.defined() ? w.data_ptr<float>() : nullptr, h, out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_kernels_cpu, m) {
  m.def(
      "moe_scatter_rows(Tensor src, Tensor row_map, Tensor? weights, int num_rows, Tensor? other) -> (Tensor, "
      "Tensor)");
  m.def("moe_gather_rows(Tensor src, Tensor row_map, Tensor? weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(mcore_kernels_cpu, CPU, m) {
  m.impl("moe_scatter_rows", &moe_scatter_rows);
  m.impl("moe_gather_rows", &moe_gather_rows);
}
