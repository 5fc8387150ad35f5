// SwiGLU on the CPU, forward and backward: rows x [M, 2K] = [gate, up] halves, out [M, K] =
// silu(gate) * up in float32, rounded once to x's dtype, as the PyTorch reference.
//
// torch.ops.mcore_kernels_cpu.swiglu(x [M, 2K]) -> [M, K]
// torch.ops.mcore_kernels_cpu.swiglu_backward(dout [M, K], x [M, 2K]) -> dx [M, 2K]: with
// s = sigmoid(gate), dgate = dout up s (1 + gate (1 - s)) and dup = dout gate s, recomputed from x.
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

template <typename T>
void swiglu_row_backward(const T* dout, const T* gate, const T* up, int64_t k, T* dgate, T* dup) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  auto step = [&](__m512 d, __m512 g, __m512 u, __m512& dg, __m512& du) {
    const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    const __m512 ds = _mm512_mul_ps(d, s);
    du = _mm512_mul_ps(ds, g);
    dg = _mm512_mul_ps(_mm512_mul_ps(ds, u), _mm512_fmadd_ps(g, _mm512_sub_ps(one, s), one));
  };
  __m512 dg, du;
  for (; i + 16 <= k; i += 16) {
    step(load16(dout + i), load16(gate + i), load16(up + i), dg, du);
    store16(dgate + i, dg);
    store16(dup + i, du);
  }
  if (i < k) {
    const int64_t rest = k - i;
    step(load_partial(dout + i, rest), load_partial(gate + i, rest), load_partial(up + i, rest), dg, du);
    store_partial(dgate + i, dg, rest);
    store_partial(dup + i, du, rest);
    i = k;
  }
#endif
  for (; i < k; ++i) {
    const float d = to_float(dout[i]), g = to_float(gate[i]), u = to_float(up[i]);
    const float s = 1.f / (1.f + std::exp(-g));
    dup[i] = static_cast<T>(d * s * g);
    dgate[i] = static_cast<T>(d * s * u * (1.f + g * (1.f - s)));
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

at::Tensor swiglu_backward(const at::Tensor& dout, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "swiglu_backward: x must be a contiguous [M, 2K] tensor");
  TORCH_CHECK(dout.dim() == 2 && dout.is_contiguous() && dout.size(0) == x.size(0) && 2 * dout.size(1) == x.size(1) &&
                  dout.scalar_type() == x.scalar_type(),
              "swiglu_backward: dout must be a contiguous [M, K] tensor of x's dtype");
  const int64_t rows = x.size(0), k = x.size(1) / 2;
  auto dx = at::empty_like(x);
  MCORE_DISPATCH_FLOAT_TYPES(x.scalar_type(), "swiglu_backward", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* d = dout.data_ptr<scalar_t>();
    scalar_t* o = dx.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        swiglu_row_backward(d + r * k, in + r * 2 * k, in + r * 2 * k + k, k, o + r * 2 * k, o + r * 2 * k + k);
    });
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_kernels_cpu, m) {
  m.def("swiglu(Tensor x) -> Tensor");
  m.def("swiglu_backward(Tensor dout, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(mcore_kernels_cpu, CPU, m) {
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
}
