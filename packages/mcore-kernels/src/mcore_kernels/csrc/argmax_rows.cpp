// Greedy tokens on the CPU: for each row of logits [R, V] (float32, bfloat16 or float16), the index
// of its first maximum and whether that maximum is finite. A row holding a NaN, a +inf, or only
// -inf is not finite (no token can be sampled from it); its index is then unspecified. One pass
// finds the row's maximum (16 lanes at a time with AVX-512), a second the first column holding it,
// read straight from the storage dtype: no float32 copy of the logits.
//
// torch.ops.mcore_kernels_cpu.argmax_rows(logits [R, V]) -> (indices int64 [R], finite bool [R])
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "simd.h"

namespace {

using namespace mcore_kernels;

// The row's maximum, NaN if it holds one.
template <typename T>
float row_max(const T* row, int64_t width) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 lanes = _mm512_set1_ps(best);
  __mmask16 unordered = 0;
  for (; i + 16 <= width; i += 16) {
    const __m512 x = load16(row + i);
    unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    lanes = _mm512_max_ps(lanes, x);
  }
  best = _mm512_reduce_max_ps(lanes);
  nan = unordered != 0;
#endif
  for (; i < width; ++i) {
    const float x = to_float(row[i]);
    nan |= std::isnan(x);
    best = x > best ? x : best;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

template <typename T>
void argmax_rows_kernel(const T* logits, int64_t rows, int64_t width, int64_t* indices, bool* finite) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits + r * width;
      const float best = row_max(row, width);
      finite[r] = std::isfinite(best);
      int64_t index = 0;
      if (finite[r]) {
        while (to_float(row[index]) != best) ++index;
      }
      indices[r] = index;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows: logits must be [R, V] with V > 0");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor indices = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor finite = at::empty({rows}, x.options().dtype(at::kBool));
  MCORE_DISPATCH_FLOAT_TYPES(x.scalar_type(), "argmax_rows", [&] {
    argmax_rows_kernel(x.data_ptr<scalar_t>(), rows, width, indices.data_ptr<int64_t>(), finite.data_ptr<bool>());
  });
  return {indices, finite};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_kernels_cpu, m) { m.def("argmax_rows(Tensor logits) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(mcore_kernels_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
