// RMSNorm on the CPU, forward and backward: each row h = x (+ residual, added and rounded in x's
// dtype), y = h * rstd * gamma with rstd = rsqrt(mean(h^2) + eps), gamma = weight or 1 + weight.
// Statistics and arithmetic in float32, results rounded once to their dtype, as the PyTorch
// reference.
//
// torch.ops.mcore_kernels_cpu.rms_norm(x [M, N], weight [N], residual [M, N]?, eps,
// zero_centered_gamma) -> (y, h, rstd [M] float32); h is empty when there is no residual (it
// would be x).
// torch.ops.mcore_kernels_cpu.rms_norm_backward(dy [M, N], dh_out [M, N]?, h [M, N], weight [N],
// rstd [M], zero_centered_gamma) -> (dh, dweight): dh = rstd * (dy gamma - h rstd^2 mean(dy gamma h))
// (+ dh_out, the gradient of the returned residual stream), dweight = sum over rows of dy h rstd,
// summed in blocks of a fixed number of rows and then over the blocks in order, so that it does not
// depend on the number of threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "simd.h"

namespace {

using namespace mcore_kernels;

constexpr int64_t kRowsPerBlock = 32;  // dweight's partial sums: one per block of rows

// gamma in float32: weight, or 1 + weight with a zero-centred gamma.
at::Tensor float_gamma(const at::Tensor& weight, bool zero_centered_gamma) {
  const at::Tensor gamma = weight.to(at::kFloat).contiguous();
  return zero_centered_gamma ? gamma + 1.0 : gamma;
}

// One row: h (written when a residual is added), its sum of squares, then y; returns rstd.
template <typename T>
float norm_row(const T* x, const T* residual, T* h, const float* gamma, int64_t n, float eps, T* y) {
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
  return rstd;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                             const c10::optional<at::Tensor>& residual, double eps,
                                             bool zero_centered_gamma) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous [M, N] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: weight must be [N]");
  TORCH_CHECK(!residual.has_value() || (residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                                        residual->is_contiguous()),
              "rms_norm: residual must be a contiguous tensor of x's shape and dtype");
  const at::Tensor gamma = float_gamma(weight, zero_centered_gamma);
  auto y = at::empty_like(x);
  auto h = residual.has_value() ? at::empty_like(x) : at::empty({0}, x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  float* rstd_out = rstd.data_ptr<float>();
  MCORE_DISPATCH_FLOAT_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* extra = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* hp = residual.has_value() ? h.data_ptr<scalar_t>() : nullptr;
    scalar_t* out = y.data_ptr<scalar_t>();
    const float* g = gamma.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rstd_out[r] = norm_row<scalar_t>(in + r * n, extra ? extra + r * n : nullptr, hp ? hp + r * n : nullptr,
                                         g, n, static_cast<float>(eps), out + r * n);
    });
  });
  return {y, h, rstd};
}

// One row of the backward: dh (+ dh_out) written, dy h rstd added to the block's dweight sums.
template <typename T>
void norm_row_backward(const T* dy, const T* dh_out, const T* h, const float* gamma, float rstd, int64_t n,
                       T* dh, float* dweight) {
  float dot = 0.f;  // sum of dy gamma h
  for (int64_t i = 0; i < n; ++i) dot += to_float(dy[i]) * gamma[i] * to_float(h[i]);
  const float coef = -rstd * rstd * rstd * dot / static_cast<float>(n);
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_float(dy[i]), hv = to_float(h[i]);
    float value = g * gamma[i] * rstd + hv * coef;
    if (dh_out != nullptr) value += to_float(dh_out[i]);
    dh[i] = static_cast<T>(value);
    dweight[i] += g * hv * rstd;
  }
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const c10::optional<at::Tensor>& dh_out,
                                                      const at::Tensor& h, const at::Tensor& weight,
                                                      const at::Tensor& rstd, bool zero_centered_gamma) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "rms_norm_backward: h must be a contiguous [M, N] tensor");
  TORCH_CHECK(dy.sizes() == h.sizes() && dy.scalar_type() == h.scalar_type() && dy.is_contiguous(),
              "rms_norm_backward: dy must be a contiguous tensor of h's shape and dtype");
  TORCH_CHECK(!dh_out.has_value() || (dh_out->sizes() == h.sizes() && dh_out->scalar_type() == h.scalar_type() &&
                                      dh_out->is_contiguous()),
              "rms_norm_backward: dh_out must be a contiguous tensor of h's shape and dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h.size(1), "rms_norm_backward: weight must be [N]");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.dim() == 1 && rstd.size(0) == h.size(0) && rstd.is_contiguous(),
              "rms_norm_backward: rstd must be a contiguous float32 [M] tensor");
  const at::Tensor gamma = float_gamma(weight, zero_centered_gamma);
  const int64_t rows = h.size(0), n = h.size(1), blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  auto dh = at::empty_like(h);
  auto partial = at::zeros({std::max<int64_t>(blocks, 1), n}, h.options().dtype(at::kFloat));
  MCORE_DISPATCH_FLOAT_TYPES(h.scalar_type(), "rms_norm_backward", [&] {
    const scalar_t* dyp = dy.data_ptr<scalar_t>();
    const scalar_t* extra = dh_out.has_value() ? dh_out->data_ptr<scalar_t>() : nullptr;
    const scalar_t* hp = h.data_ptr<scalar_t>();
    scalar_t* out = dh.data_ptr<scalar_t>();
    const float* g = gamma.data_ptr<float>();
    const float* r = rstd.data_ptr<float>();
    float* sums = partial.data_ptr<float>();
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        for (int64_t row = b * kRowsPerBlock; row < std::min(rows, (b + 1) * kRowsPerBlock); ++row)
          norm_row_backward<scalar_t>(dyp + row * n, extra ? extra + row * n : nullptr, hp + row * n, g, r[row], n,
                                      out + row * n, sums + b * n);
    });
  });
  auto dweight = at::empty({n}, partial.options());
  float* total = dweight.data_ptr<float>();
  const float* sums = partial.data_ptr<float>();
  const int64_t partial_rows = partial.size(0);
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float value = 0.f;
      for (int64_t b = 0; b < partial_rows; ++b) value += sums[b * n + i];
      total[i] = value;
    }
  });
  return {dh, dweight.to(weight.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_kernels_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, Tensor? residual, float eps, bool zero_centered_gamma) -> (Tensor, Tensor, Tensor)");
  m.def(
      "rms_norm_backward(Tensor dy, Tensor? dh_out, Tensor h, Tensor weight, Tensor rstd, bool zero_centered_gamma)"
      " -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mcore_kernels_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
}
