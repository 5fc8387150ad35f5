// Rotary embedding on the CPU. Rows x [R, d], tables cos, sin [C, r] (r <= d even), rows
// i * group .. (i + 1) * group - 1 of x using table row i; pairs (a, b) = (j, j + r/2), or
// (2j, 2j + 1) when interleaved, become (a cos_a - b sin_a, b cos_b + a sin_b), or with transpose
// (the backward) (a cos_a + b sin_b, b cos_b - a sin_a); dimensions past r pass through. Float32
// arithmetic, one rounding, as the PyTorch reference.
//
// torch.ops.mcore_kernels_cpu.rotary(x [R, d], cos [C, r], sin [C, r], interleaved, transpose)
// -> [R, d]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

namespace {

using namespace mcore_kernels;

// One row, tables cos, sin (float32, r entries), pair (a, b) at a = first(j), b = second(j).
template <typename T>
void rotate_row(const T* x, const float* cos, const float* sin, int64_t d, int64_t r, bool interleaved,
                bool transpose, T* out) {
  const int64_t half = r / 2;
  int64_t j = 0;
#if defined(__AVX512F__)
  if (!interleaved) {
    for (; j + 16 <= half; j += 16) {
      const __m512 a = load16(x + j), b = load16(x + half + j);
      const __m512 cos_a = _mm512_loadu_ps(cos + j), cos_b = _mm512_loadu_ps(cos + half + j);
      const __m512 sin_a = _mm512_loadu_ps(sin + j), sin_b = _mm512_loadu_ps(sin + half + j);
      if (transpose) {
        store16(out + j, _mm512_fmadd_ps(a, cos_a, _mm512_mul_ps(b, sin_b)));
        store16(out + half + j, _mm512_fmsub_ps(b, cos_b, _mm512_mul_ps(a, sin_a)));
      } else {
        store16(out + j, _mm512_fmsub_ps(a, cos_a, _mm512_mul_ps(b, sin_a)));
        store16(out + half + j, _mm512_fmadd_ps(b, cos_b, _mm512_mul_ps(a, sin_b)));
      }
    }
  }
#endif
  for (; j < half; ++j) {
    const int64_t ia = interleaved ? 2 * j : j, ib = interleaved ? 2 * j + 1 : j + half;
    const float a = to_float(x[ia]), b = to_float(x[ib]);
    if (transpose) {
      out[ia] = static_cast<T>(a * cos[ia] + b * sin[ib]);
      out[ib] = static_cast<T>(b * cos[ib] - a * sin[ia]);
    } else {
      out[ia] = static_cast<T>(a * cos[ia] - b * sin[ia]);
      out[ib] = static_cast<T>(b * cos[ib] + a * sin[ib]);
    }
  }
  for (int64_t i = r; i < d; ++i) out[i] = x[i];
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                  bool transpose) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rotary: x must be a contiguous [R, d] tensor");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) % 2 == 0 && cos.size(1) <= x.size(1),
              "rotary: cos and sin must be [C, r] with r even and at most d");
  const int64_t rows = x.size(0), d = x.size(1), tables = cos.size(0), r = cos.size(1);
  TORCH_CHECK(tables > 0 && rows % tables == 0, "rotary: x's rows must be a multiple of the table rows");
  const int64_t group = rows / tables;
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  auto out = at::empty_like(x);
  MCORE_DISPATCH_FLOAT_TYPES(x.scalar_type(), "rotary", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const float* cp = c.data_ptr<float>();
    const float* sp = s.data_ptr<float>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t t = row / group;
        rotate_row(in + row * d, cp + t * r, sp + t * r, d, r, interleaved, transpose, o + row * d);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_kernels_cpu, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved, bool transpose) -> Tensor");
}

TORCH_LIBRARY_IMPL(mcore_kernels_cpu, CPU, m) { m.impl("rotary", &rotary); }
