// Conversions and vector helpers the C++ CPU kernels share: float32 from and to the storage dtypes
// (bfloat16 rounded to nearest even, as c10::BFloat16 does), and, with AVX-512, 16-lane loads,
// stores and exp.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Runs the lambda with scalar_t = float, c10::BFloat16 or c10::Half (the elementwise kernels'
// dtypes; float64 stays on the PyTorch reference, which computes it in float64).
#define MCORE_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                  \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace mcore_kernels {

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
void to_floats(const T* src, float* dst, int64_t n);

#if defined(__AVX512F__)
// 16 elements as float32 lanes.
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// The first ``count`` (< 16) elements as float32 lanes, the rest zero.
template <typename T>
inline __m512 load_partial(const T* p, int64_t count) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
}

// 16 float32 lanes rounded to T (bfloat16: to nearest even, NaN kept a quiet NaN).
template <typename T>
inline __m256i round16(__m512 x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(rounded);
  } else {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

template <typename T>
inline void store16(T* p, __m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, x);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round16<T>(x));
  }
}

template <typename T>
inline void store_partial(T* p, __m512 x, int64_t count) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(p, mask, x);
  } else {
    _mm256_mask_storeu_epi16(p, mask, round16<T>(x));
  }
}

// exp(x) for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial
// (relative error below 2e-7), times 2^n by scalef; arguments below -87.3 (where exp leaves
// float32's normal range) count as -87.3, above 88.7 give infinity.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

template <typename T>
void to_floats(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

}  // namespace mcore_kernels
