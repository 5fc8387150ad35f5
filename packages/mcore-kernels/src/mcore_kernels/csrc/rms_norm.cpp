// RMSNorm forward on the CPU, for inference (no autograd): each row h = x (+ residual, added and
// rounded in x's dtype), y = h * rsqrt(mean(h^2) + eps) * gamma, gamma = weight or 1 + weight.
// Statistics and arithmetic in float32, y rounded once to x's dtype, as the PyTorch reference.
//
// torch.ops.mcore_kernels_cpu.rms_norm(x [M, N], weight [N], residual [M, N]?, eps,
// zero_centered_gamma) -> (y, h); h is empty when there is no residual (it would be x).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "simd.h"

namespace {

using namespace mcore_kernels;

// One row: h (written when a residual is added), its sum of squares, then y.
template <typename T>
void norm_row(const T* x, const T* residual, T* h, const float* gamma, int64_t n, float eps, T* y) {
  const T* in = x;
  if (residual != nullptr) {
    for (int64_t i = 0; i < n; ++i) h[i] = static_cast<T>(to_float(x[i]) + to_float(residual[i]));
    in = h;
  }
  int64_t i = 0;
  float squares = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(in + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  if (i < n) {
    const __m512 v = load_partial(in + i, n - i);
    acc = _mm512_fmadd_ps(v, v, acc);
    i = n;
  }
  squares = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) squares += to_float(in[i]) * to_float(in[i]);
  const float rstd = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  i = 0;
#if defined(__AVX512F__)
  const __m512 r = _mm512_set1_ps(rstd);
  for (; i + 16 <= n; i += 16) store16(y + i, _mm512_mul_ps(_mm512_mul_ps(load16(in + i), r), _mm512_loadu_ps(gamma + i)));
  if (i < n) {
    store_partial(y + i, _mm512_mul_ps(_mm512_mul_ps(load_partial(in + i, n - i), r), load_partial(gamma + i, n - i)), n - i);
    i = n;
  }
#endif
  for (; i < n; ++i) y[i] = static_cast<T>(to_float(in[i]) * rstd * gamma[i]);
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                             const c10::optional<at::Tensor>& residual, double eps,
                                             bool zero_centered_gamma) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous [M, N] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: weight must be [N]");
  TORCH_CHECK(!residual.has_value() || (residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                                        residual->is_contiguous()),
              "rms_norm: residual must be a contiguous tensor of x's shape and dtype");
  at::Tensor gamma = weight.to(at::kFloat).contiguous();
  if (zero_centered_gamma) gamma = gamma + 1.0;
  auto y = at::empty_like(x);
  auto h = residual.has_value() ? at::empty_like(x) : at::empty({0}, x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  MCORE_DISPATCH_FLOAT_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* extra = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* hp = residual.has_value() ? h.data_ptr<scalar_t>() : nullptr;
    scalar_t* out = y.data_ptr<scalar_t>();
    const float* g = gamma.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        norm_row<scalar_t>(in + r * n, extra ? extra + r * n : nullptr, hp ? hp + r * n : nullptr, g, n,
                                  static_cast<float>(eps), out + r * n);
    });
  });
  return {y, h};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_kernels_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, Tensor? residual, float eps, bool zero_centered_gamma) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mcore_kernels_cpu, CPU, m) { m.impl("rms_norm", &rms_norm); }
