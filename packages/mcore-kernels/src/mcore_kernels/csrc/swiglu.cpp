// SwiGLU forward on the CPU, for inference (no autograd): rows x [M, 2K] = [gate, up] halves,
// out [M, K] = silu(gate) * up in float32, rounded once to x's dtype, as the PyTorch reference.
//
// torch.ops.mcore_kernels_cpu.swiglu(x [M, 2K]) -> [M, K]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "simd.h"

namespace {

using namespace mcore_kernels;

template <typename T>
void swiglu_row(const T* gate, const T* up, int64_t k, T* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  auto value = [&](__m512 g, __m512 u) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u);
  };
  for (; i + 16 <= k; i += 16) store16(out + i, value(load16(gate + i), load16(up + i)));
  if (i < k) {
    store_partial(out + i, value(load_partial(gate + i, k - i), load_partial(up + i, k - i)), k - i);
    i = k;
  }
#endif
  for (; i < k; ++i) {
    const float g = to_float(gate[i]);
    out[i] = static_cast<T>(g / (1.f + std::exp(-g)) * to_float(up[i]));
  }
}

at::Tensor swiglu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "swiglu: x must be a contiguous [M, 2K] tensor");
  const int64_t rows = x.size(0), k = x.size(1) / 2;
  auto out = at::empty({rows, k}, x.options());
  MCORE_DISPATCH_FLOAT_TYPES(x.scalar_type(), "swiglu", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) swiglu_row(in + r * 2 * k, in + r * 2 * k + k, k, o + r * k);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_kernels_cpu, m) { m.def("swiglu(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(mcore_kernels_cpu, CPU, m) { m.impl("swiglu", &swiglu); }
