// AVX2 pieces shared by the kernels' versions for CPUs without AVX-512 (ggml_matmul.cpp, int4_matmul.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX2__)
namespace avx2 {

// 8 values of x (float32, or bf16 as uint16) as float32.
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// 8 bf16 -> float32 (a bf16 is the top half of a float).
inline __m256 load_bf16x8(const uint8_t* p) { return load8(reinterpret_cast<const uint16_t*>(p)); }

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// x [m, k] -> int8 codes xq with one scale dx = max |x| / 127 per `group` values (a multiple of 32 that
// divides k; k: one per row), xq = round(x / dx); per 32 values, xs gets dx and xm dx times the sum of
// those 32 xq (the sum of the rounded x: the low ends' / mins' term is then exact for the rounded x).
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t group, int8_t* xq, float* xs, float* xm) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // packs_epi32 then packs_epi16 interleave 128-bit lanes; this puts the 32 bytes back in value order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < k; g += group) {
      const int64_t base = r * k + g;
      __m256 amax = _mm256_setzero_ps();
      for (int64_t c = 0; c < group; c += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(load8(x + base + c), abs_mask));
      const float top = hmax8(amax);
      const float dx = top / 127.f, inv = top > 0.f ? 127.f / top : 0.f;
      const __m256 scale = _mm256_set1_ps(inv);
      for (int64_t c = 0; c < group; c += 32) {
        __m256i a[4];
        for (int i = 0; i < 4; ++i) a[i] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + base + c + 8 * i), scale));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + base + c), _mm256_permutevar8x32_epi32(bytes, order));
        const int64_t sub = (base + c) / 32;
        xs[sub] = dx;
        xm[sub] = dx * static_cast<float>(hsum8i(_mm256_add_epi32(_mm256_add_epi32(a[0], a[1]), _mm256_add_epi32(a[2], a[3]))));
      }
    }
  }
}

}  // namespace avx2
#endif  // __AVX2__
