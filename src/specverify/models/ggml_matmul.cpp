// Matmuls straight from a GGUF file's Q6_K and Q4_K blocks, for the few rows of decoding and
// verification (CPU).
//
// Q6_K: at one to a few rows a matmul is bound by reading the weight. PyTorch has no kernel for Q6_K's
// 6-bit codes with a scale per 16 values, so without this the target streamed those tensors as bf16
// (2 bytes a weight against Q6_K's 0.82). Here each block is decoded in registers and multiplied with
// the activations quantized to int8 per 32 values: the weights are exactly the file's
// (d * scale * (q - 32)); see the Q6_K section below.
//
// Q4_K: the activations are quantized to int8 per 32 (or 256) values (llama.cpp does so per 256 for
// its Q4_K dot products) and multiplied with the 4-bit codes by AVX512-VNNI byte dot products, twice as
// many multiply-adds per instruction as bf16's, reading 0.58 bytes a weight; see the Q4_K section below.
//
// Without AVX-512 (an AVX2 CPU, where the dense path is float32) both kernels run in AVX2 (maddubs /
// madd in place of one VNNI dot product).
//
// Each kernel is compiled only where the compiler targets its instructions (-march=native); the Python
// side checks the CPU's flags before calling it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "avx2_int8.h"

// The Q4_K kernel (and the int8 Q6_K one) in AVX-512 VNNI, or else in AVX2 (maddubs / madd in place of
// one VNNI dot product: three instructions on half the width).
#if defined(__AVX512VNNI__)
#define SPECVERIFY_Q4K 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECVERIFY_Q4K 256
#endif

namespace {

constexpr int kBlockValues = 256;  // ggml's QK_K
constexpr int kQ6KBytes = 210;     // ql[128], qh[64], scales[16] (int8), d (fp16)


#if defined(SPECVERIFY_Q4K)
// ---------------------------------------------------------------------------------------------- Q4_K
//
// Q4_K (144 bytes per 256 values): d, dmin (fp16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of
// 32, 128 bytes of nibbles (value 64 j + l is the low nibble of qs[32 j + l], value 64 j + 32 + l its high
// nibble). w = d sc q - dmin m. With x quantized to int8 per group (x ~ dx xq), a row's dot with x is
//   sum over sub-blocks of dx (d sc sum(q xq) - dmin m sum(xq)),
// and sum(q xq) over a sub-block is 8 AVX512-VNNI dot products (u8 codes x s8 activations, 64 each).
// The codes are re-laid once at load (`q4k_pack`, the same bits): 16 output rows share a 64-byte
// vector, 4 consecutive values of each, so the int32 lanes are output rows, the activations are
// broadcast, and a sub-block's scales apply to a whole vector (lane n: row n) once per 8 dot products.

constexpr int kQ4KBytes = 144;
constexpr int kTileRows = 16;  // output rows per packed tile: one int32 lane each
// A packed (tile, block): codes [8 sub-blocks][4 vectors][16 rows][4 bytes] (low nibble: value 4 v + j
// of the sub-block, high nibble: value 16 + 4 v + j), d and dmin fp16 [16], scales and mins u8 [8][16].
constexpr int kCodeBytes = 2048, kDOffset = kCodeBytes, kDminOffset = 2080, kScOffset = 2112, kMinOffset = 2240;
constexpr int kQ4KPackedBytes = 2368;

inline int q4k_code(const uint8_t* qs, int v) {
  const int j = v / 64, l = v % 64;
  return l < 32 ? (qs[32 * j + l] & 0x0F) : (qs[32 * j + l - 32] >> 4);
}

// ggml's get_scale_min_k4: sub-block i's 6-bit scale and min from the 12 packed bytes.
inline void q4k_scale_min(const uint8_t* q, int i, uint8_t* sc, uint8_t* mn) {
  if (i < 4) {
    *sc = q[i] & 63;
    *mn = q[i + 4] & 63;
  } else {
    *sc = (q[i + 4] & 0x0F) | ((q[i - 4] >> 6) << 4);
    *mn = (q[i + 4] >> 4) | ((q[i] >> 6) << 4);
  }
}

#if SPECVERIFY_Q4K == 512
// int8 activations per `group` values (32 or 256): dx = max |x| / 127, xq = round(x / dx). Per 32 values,
// `xs` gets dx and `xm` dx times the sum of the xq (the mins' term).
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t group, int8_t* xq, float* xs, float* xm) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < k; g += group) {
      const int64_t base = r * k + g;
      __m512 amax = _mm512_setzero_ps();
      __m512 v[16];  // up to 256 values
      for (int c = 0; c < group / 16; ++c) {
        if constexpr (std::is_same_v<T, float>) {
          v[c] = _mm512_loadu_ps(x + base + 16 * c);
        } else {
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + base + 16 * c));
          v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[c]));
      }
      const float top = _mm512_reduce_max_ps(amax);
      const float dx = top / 127.f, inv = top > 0.f ? 127.f / top : 0.f;
      const __m512 scale = _mm512_set1_ps(inv);
      for (int c = 0; c < group / 16; c += 2) {
        const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(v[c], scale));  // nearest, ties to even
        const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(v[c + 1], scale));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + base + 16 * c), _mm512_cvtsepi32_epi8(a));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + base + 16 * c + 16), _mm512_cvtsepi32_epi8(b));
        const int64_t sub = base / 32 + c / 2;
        xs[sub] = dx;
        xm[sub] = dx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(a, b)));
      }
    }
  }
}

// Rows [m0, m0 + M) of y for one tile of 16 output rows starting at row0.
template <int M>
void q4k_tile(const uint8_t* tile, int64_t per_row, const int8_t* xq, const float* xs, const float* xm,
              int64_t k, float* y, int64_t n, int64_t row0) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < per_row; ++b) {
    const uint8_t* rec = tile + b * kQ4KPackedBytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kDOffset)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kDminOffset)));
    for (int i = 0; i < 8; ++i) {
      // Two records ahead, 5 of its 37 cache lines per sub-block: with the hardware prefetcher alone a
      // forward's weights (from DRAM) ran half as fast as cache-resident ones from 4 rows on.
      for (int line = 0; line < 5; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(rec + 2 * kQ4KPackedBytes + 64 * (5 * i + line)), _MM_HINT_T0);
      const __m512 sc = _mm512_mul_ps(
          d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kScOffset + 16 * i)))));
      const __m512 mn = _mm512_mul_ps(
          dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kMinOffset + 16 * i)))));
      // Two chains per row (low and high nibbles) so that one row's dot products do not wait on each other.
      __m512i dot_lo[M], dot_hi[M];
      for (int m = 0; m < M; ++m) dot_lo[m] = dot_hi[m] = _mm512_setzero_si512();
      const int64_t xoff = b * 256 + 32 * i;
      for (int v = 0; v < 4; ++v) {
        const __m512i w = _mm512_loadu_si512(rec + 256 * i + 64 * v);
        const __m512i lo = _mm512_and_si512(w, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
        for (int m = 0; m < M; ++m) {
          const int8_t* xp = xq + m * k + xoff + 4 * v;
          int32_t a, c;
          std::memcpy(&a, xp, 4);
          std::memcpy(&c, xp + 16, 4);
          dot_lo[m] = _mm512_dpbusd_epi32(dot_lo[m], lo, _mm512_set1_epi32(a));
          dot_hi[m] = _mm512_dpbusd_epi32(dot_hi[m], hi, _mm512_set1_epi32(c));
        }
      }
      const int64_t sub = (b * 256 + 32 * i) / 32;
      for (int m = 0; m < M; ++m) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(dot_lo[m], dot_hi[m]));
        const __m512 scaled = _mm512_mul_ps(dot, _mm512_set1_ps(xs[m * (k / 32) + sub]));
        acc[m] = _mm512_fmadd_ps(scaled, sc, acc[m]);
        acc[m] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(xm[m * (k / 32) + sub]), acc[m]);
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kTileRows, n - row0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * n + row0, mask, acc[m]);
}

#else  // AVX2: the same packed layout, 8 output rows (one 32-byte half of each 64) per pass
using avx2::quantize_rows;

// Rows [m0, m0 + M) of y for one tile of 16 output rows starting at row0, in two passes of 8 rows.
template <int M>
void q4k_tile(const uint8_t* tile, int64_t per_row, const int8_t* xq, const float* xs, const float* xm,
              int64_t k, float* y, int64_t n, int64_t row0) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2 && row0 + 8 * h < n; ++h) {
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < per_row; ++b) {
      const uint8_t* rec = tile + b * kQ4KPackedBytes;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kDOffset + 16 * h)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kDminOffset + 16 * h)));
      for (int i = 0; i < 8; ++i) {
        if (h == 0) {  // the second pass finds the tile in cache
          for (int line = 0; line < 5; ++line)
            _mm_prefetch(reinterpret_cast<const char*>(rec + 2 * kQ4KPackedBytes + 64 * (5 * i + line)), _MM_HINT_T0);
        }
        const __m256 sc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + kScOffset + 16 * i + 8 * h)))));
        const __m256 mn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + kMinOffset + 16 * i + 8 * h)))));
        __m256i lo[4], hi[4];
        for (int v = 0; v < 4; ++v) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256 * i + 64 * v + 32 * h));
          lo[v] = _mm256_and_si256(w, low4);
          hi[v] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
        }
        const int64_t xoff = b * 256 + 32 * i;
        __m256i dot[M];
        for (int m = 0; m < M; ++m) {
          const int8_t* xp = xq + m * k + xoff;
          // maddubs / madd: AVX2's stand-in for VNNI dot products; 4 maddubs summed in int16 (at most
          // 8 * 15 * 127: no saturation) before one madd to int32.
          __m256i pairs[2];
          for (int p = 0; p < 2; ++p) {
            int32_t a0, a1, c0, c1;
            std::memcpy(&a0, xp + 8 * p, 4);
            std::memcpy(&a1, xp + 8 * p + 4, 4);
            std::memcpy(&c0, xp + 16 + 8 * p, 4);
            std::memcpy(&c1, xp + 16 + 8 * p + 4, 4);
            pairs[p] = _mm256_add_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(lo[2 * p], _mm256_set1_epi32(a0)),
                                 _mm256_maddubs_epi16(lo[2 * p + 1], _mm256_set1_epi32(a1))),
                _mm256_add_epi16(_mm256_maddubs_epi16(hi[2 * p], _mm256_set1_epi32(c0)),
                                 _mm256_maddubs_epi16(hi[2 * p + 1], _mm256_set1_epi32(c1))));
          }
          dot[m] = _mm256_add_epi32(_mm256_madd_epi16(pairs[0], ones), _mm256_madd_epi16(pairs[1], ones));
        }
        const int64_t sub = (b * 256 + 32 * i) / 32;
        for (int m = 0; m < M; ++m) {
          const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_set1_ps(xs[m * (k / 32) + sub]));
          acc[m] = _mm256_fmadd_ps(scaled, sc, acc[m]);
          acc[m] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(xm[m * (k / 32) + sub]), acc[m]);
        }
      }
    }
    const int64_t first = row0 + 8 * h, valid = std::min<int64_t>(8, n - first);
    for (int m = 0; m < M; ++m) {
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[m]);
      std::memcpy(y + m * n + first, out, valid * sizeof(float));
    }
  }
}
#endif

// Rows of x per call of q4k_tile: its accumulators stay in registers (32 of AVX-512, 16 of AVX2).
constexpr int kPassRows = SPECVERIFY_Q4K == 512 ? 8 : 4;

void q4k_tile_rows(int rows, const uint8_t* tile, int64_t per_row, const int8_t* xq, const float* xs,
                   const float* xm, int64_t k, float* y, int64_t n, int64_t row0) {
  switch (rows) {
    case 1: q4k_tile<1>(tile, per_row, xq, xs, xm, k, y, n, row0); break;
    case 2: q4k_tile<2>(tile, per_row, xq, xs, xm, k, y, n, row0); break;
    case 3: q4k_tile<3>(tile, per_row, xq, xs, xm, k, y, n, row0); break;
#if SPECVERIFY_Q4K == 512
    case 4: q4k_tile<4>(tile, per_row, xq, xs, xm, k, y, n, row0); break;
    case 5: q4k_tile<5>(tile, per_row, xq, xs, xm, k, y, n, row0); break;
    case 6: q4k_tile<6>(tile, per_row, xq, xs, xm, k, y, n, row0); break;
    case 7: q4k_tile<7>(tile, per_row, xq, xs, xm, k, y, n, row0); break;
#endif
    default: q4k_tile<kPassRows>(tile, per_row, xq, xs, xm, k, y, n, row0); break;
  }
}
// ------------------------------------------------------------------------------ Q6_K, int8 x, AVX2
//
// The codes c (0..63) against x quantized to int8 per 32 values (as for Q4_K), so w = d s (c - 32)
// gives, per 16-value sub-block,
//   dx d s (sum(c xq) - 32 sum(xq));
// the second term (`xoff`: 32 dx sum(xq) per 16 values, computed once per call) is taken off per block
// with the 16 sub-block scales. The blocks as stored, one output row at a time, the rows of x four at a
// time against it. (AVX-512 VNNI has a tiled layout of its own, below.)
#if SPECVERIFY_Q4K == 256
template <int M>
void q6k_int8_rows(const int8_t* xq, const float* xs, const float* xoff, const uint8_t* blocks, float* y,
                   int64_t k, int64_t n, int64_t begin, int64_t end) {
  const int64_t per_row = k / kBlockValues;
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  __m256i lane_sub[4];  // int32 lane t of values 32 j .. 32 j + 31 of a half -> its sub-block 2 j + t / 4
  for (int j = 0; j < 4; ++j) lane_sub[j] = _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1);
  for (int64_t row = begin; row < end; ++row) {
    __m256 acc[M], off[M];
    for (int m = 0; m < M; ++m) acc[m] = off[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < per_row; ++b) {
      const uint8_t* block = blocks + (row * per_row + b) * kQ6KBytes;
      _mm_prefetch(reinterpret_cast<const char*>(block + 2 * kQ6KBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(block + 2 * kQ6KBytes + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(block + 2 * kQ6KBytes + 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(block + 2 * kQ6KBytes + 192), _MM_HINT_T0);
      uint16_t d_bits;
      std::memcpy(&d_bits, block + 208, 2);
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(d_bits));
      const __m128i sub_scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
      const __m256 scales[2] = {
          _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub_scales))),
          _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sub_scales, 8))))};
      for (int m = 0; m < M; ++m) {
        const float* o = xoff + m * (k / 16) + b * 16;
        off[m] = _mm256_fmadd_ps(scales[0], _mm256_loadu_ps(o), off[m]);
        off[m] = _mm256_fmadd_ps(scales[1], _mm256_loadu_ps(o + 8), off[m]);
      }
      for (int h = 0; h < 2; ++h) {
        // Value 128 h + 32 j + l: nibble (j >= 2) of ql[64 h + 32 (j & 1) + l], bits 2 j of qh[32 h + l].
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
        const __m256i codes[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45)),
            _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, bits45)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45))};
        for (int j = 0; j < 4; ++j) {
          const __m256 s = _mm256_permutevar8x32_ps(scales[h], lane_sub[j]);
          const int64_t g = b * 8 + 4 * h + j;  // the 32 values' activation group
          for (int m = 0; m < M; ++m) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k + 32 * g));
            // pair sums <= 2 * 63 * 127: maddubs cannot saturate
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes[j], xv), ones);
            const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xs[m * (k / 32) + g]));
            acc[m] = _mm256_fmadd_ps(scaled, s, acc[m]);
          }
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * n + row] = avx2::hsum8(_mm256_sub_ps(acc[m], off[m]));
  }
}

void q6k_int8_pass(int rows, const int8_t* xq, const float* xs, const float* xoff, const uint8_t* blocks,
                   float* y, int64_t k, int64_t n, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: q6k_int8_rows<1>(xq, xs, xoff, blocks, y, k, n, begin, end); break;
    case 2: q6k_int8_rows<2>(xq, xs, xoff, blocks, y, k, n, begin, end); break;
    case 3: q6k_int8_rows<3>(xq, xs, xoff, blocks, y, k, n, begin, end); break;
    default: q6k_int8_rows<4>(xq, xs, xoff, blocks, y, k, n, begin, end); break;
  }
}
#endif  // SPECVERIFY_Q4K == 256

#if SPECVERIFY_Q4K == 512
// ------------------------------------------------------------------------ Q6_K, int8 x, 16-row tiles
//
// The blocks as stored put 4 sub-blocks in each 64-byte vector, so each lane of a dot product needs its
// own sub-block and activation scales in float: 6 instructions per 64 weights and row of x, bound by
// arithmetic from 2 rows on (a row-major VNNI kernel ran the LM head at 15.0 ms for 6 rows, this one
// 7.7, dense bf16 13.8; 5.6 / 5.8 ms at 1 row). As for Q4_K, the codes are re-laid once at load (`q6k_pack`,
// the same bits, the same 0.83 bytes a weight): 16 output rows share a vector, 4 consecutive values of
// each, so the int32 lanes are output rows, the activations are broadcast, and a sub-block's integer
// dot (4 dot products) is scaled once for all 16 rows.
//
// A record per (tile of 16 rows, block of 256 values): d fp16 [16], 32 bytes free, the sub-block scales
// int8 [16 sub-blocks][16 rows], then per 32-value group i: 4 code vectors [16 rows][4 bytes] (low
// nibble: value 32 i + 4 v + j, sub-block 2 i; high nibble: value 32 i + 16 + 4 v + j, sub-block 2 i + 1)
// and 2 vectors of their top bits: byte (row, j) of vector a holds, 2 bits each from bit 0, those of
// vector 2 a's low nibble's value, vector 2 a + 1's, then vector 2 a's high nibble's, 2 a + 1's.
constexpr int kQ6KScOffset = 64, kQ6KGroupOffset = 320, kQ6KGroupBytes = 384;
constexpr int kQ6KPackedBytes = kQ6KGroupOffset + 8 * kQ6KGroupBytes;  // 3392: 53 cache lines

// Value v (0..255) of a Q6_K block's 6-bit codes, as gguf-py reads them: value 128 h + 32 j + l takes
// nibble (j >= 2) of ql[64 h + 32 (j & 1) + l] and bits 2 j of qh[32 h + l].
inline int q6k_code(const uint8_t* block, int v) {
  const int h = v / 128, j = (v % 128) / 32, l = v % 32;
  const int ql = block[64 * h + 32 * (j & 1) + l];
  const int nibble = j >= 2 ? ql >> 4 : ql & 0x0F;
  return nibble | (((block[128 + 32 * h + l] >> (2 * j)) & 3) << 4);
}

// Rows [0, M) of y (row stride n) for one tile of 16 output rows starting at row0.
template <int M>
void q6k_tile(const uint8_t* tile, int64_t per_row, const int8_t* xq, const float* xs, const float* xoff,
              int64_t k, float* y, int64_t n, int64_t row0) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < per_row; ++b) {
    const uint8_t* rec = tile + b * kQ6KPackedBytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
    for (int i = 0; i < 8; ++i) {
      // Two records ahead, 7 of its 53 cache lines per group (the last group takes the 53rd's place).
      for (int line = 0; line < 7 && 7 * i + line < 53; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(rec + 2 * kQ6KPackedBytes + 64 * (7 * i + line)), _MM_HINT_T0);
      const uint8_t* group = rec + kQ6KGroupOffset + kQ6KGroupBytes * i;
      __m512i dot_a[M], dot_b[M];  // sub-blocks 2 i and 2 i + 1
      for (int m = 0; m < M; ++m) dot_a[m] = dot_b[m] = _mm512_setzero_si512();
      const int64_t at = b * kBlockValues + 32 * i;
      for (int v = 0; v < 4; ++v) {
        const __m512i w = _mm512_loadu_si512(group + 64 * v);
        const __m512i top = _mm512_loadu_si512(group + 256 + 64 * (v / 2));
        // (a & b) | c in one instruction (0xEA); 16-bit shifts, the masks drop what crosses bytes.
        const __m512i lo = _mm512_ternarylogic_epi32(
            w, low4, _mm512_and_si512(_mm512_sll_epi16(top, _mm_cvtsi32_si128(4 - 2 * (v & 1))), bits45), 0xEA);
        const __m512i hi = _mm512_ternarylogic_epi32(
            _mm512_srli_epi16(w, 4), low4, _mm512_and_si512(_mm512_srl_epi16(top, _mm_cvtsi32_si128(2 * (v & 1))), bits45), 0xEA);
        for (int m = 0; m < M; ++m) {
          const int8_t* xp = xq + m * k + at + 4 * v;
          int32_t a, c;
          std::memcpy(&a, xp, 4);
          std::memcpy(&c, xp + 16, 4);
          dot_a[m] = _mm512_dpbusd_epi32(dot_a[m], lo, _mm512_set1_epi32(a));
          dot_b[m] = _mm512_dpbusd_epi32(dot_b[m], hi, _mm512_set1_epi32(c));
        }
      }
      const __m512 sc_a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kQ6KScOffset + 32 * i)))));
      const __m512 sc_b = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kQ6KScOffset + 32 * i + 16)))));
      const int64_t sub = at / 16;  // sub-block 2 i of row m of x: xoff[m * k / 16 + sub]
      for (int m = 0; m < M; ++m) {
        __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot_a[m]), sc_a);
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_b[m]), sc_b, t);
        acc[m] = _mm512_fmadd_ps(t, _mm512_set1_ps(xs[m * (k / 32) + at / 32]), acc[m]);
        acc[m] = _mm512_fnmadd_ps(sc_a, _mm512_set1_ps(xoff[m * (k / 16) + sub]), acc[m]);
        acc[m] = _mm512_fnmadd_ps(sc_b, _mm512_set1_ps(xoff[m * (k / 16) + sub + 1]), acc[m]);
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kTileRows, n - row0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * n + row0, mask, acc[m]);
}

void q6k_tile_rows(int rows, const uint8_t* tile, int64_t per_row, const int8_t* xq, const float* xs,
                   const float* xoff, int64_t k, float* y, int64_t n, int64_t row0) {
  switch (rows) {
    case 1: q6k_tile<1>(tile, per_row, xq, xs, xoff, k, y, n, row0); break;
    case 2: q6k_tile<2>(tile, per_row, xq, xs, xoff, k, y, n, row0); break;
    case 3: q6k_tile<3>(tile, per_row, xq, xs, xoff, k, y, n, row0); break;
    case 4: q6k_tile<4>(tile, per_row, xq, xs, xoff, k, y, n, row0); break;
    case 5: q6k_tile<5>(tile, per_row, xq, xs, xoff, k, y, n, row0); break;
    case 6: q6k_tile<6>(tile, per_row, xq, xs, xoff, k, y, n, row0); break;
    case 7: q6k_tile<7>(tile, per_row, xq, xs, xoff, k, y, n, row0); break;
    default: q6k_tile<8>(tile, per_row, xq, xs, xoff, k, y, n, row0); break;
  }
}
#endif  // SPECVERIFY_Q4K == 512
#endif  // SPECVERIFY_Q4K

}  // namespace

#if defined(SPECVERIFY_Q4K)
namespace {
void check_blocks(const torch::Tensor& blocks, int64_t n, int64_t k, int64_t block_bytes, const char* type) {
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(), "blocks must be contiguous uint8");
  TORCH_CHECK(n >= 1 && k >= kBlockValues && k % kBlockValues == 0, "K must be a positive multiple of 256, got ", k);
  TORCH_CHECK(blocks.numel() == n * (k / kBlockValues) * block_bytes, "blocks do not hold ", n, " rows of ", k, " ",
              type, " values");
}

// Row-major blocks [n][K / 256][block_bytes] -> records [tiles of 16 rows][K / 256][record_bytes], once at
// load: fill(block, record, r) writes row r's share of one record. Rows past n in the last tile stay zero
// (scales 0: they add nothing and are never stored).
template <typename Fill>
torch::Tensor pack_tiles(const torch::Tensor& blocks, int64_t n, int64_t k, int64_t block_bytes,
                         int64_t record_bytes, const char* type, Fill fill) {
  check_blocks(blocks, n, k, block_bytes, type);
  const int64_t per_row = k / kBlockValues, tiles = (n + kTileRows - 1) / kTileRows;
  auto out = torch::zeros({tiles * per_row * record_bytes}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < kTileRows && t * kTileRows + r < n; ++r)
        for (int64_t b = 0; b < per_row; ++b)
          fill(src + ((t * kTileRows + r) * per_row + b) * block_bytes, dst + (t * per_row + b) * record_bytes,
               static_cast<int>(r));
  });
  return out;
}
}  // namespace

torch::Tensor q4k_pack(torch::Tensor blocks, int64_t n, int64_t k) {
  return pack_tiles(blocks, n, k, kQ4KBytes, kQ4KPackedBytes, "Q4_K", [](const uint8_t* block, uint8_t* rec, int r) {
    std::memcpy(rec + kDOffset + 2 * r, block, 2);
    std::memcpy(rec + kDminOffset + 2 * r, block + 2, 2);
    for (int i = 0; i < 8; ++i) {
      q4k_scale_min(block + 4, i, rec + kScOffset + 16 * i + r, rec + kMinOffset + 16 * i + r);
      for (int v = 0; v < 4; ++v) {
        for (int j = 0; j < 4; ++j) {
          const int lo = q4k_code(block + 16, 32 * i + 4 * v + j);
          const int hi = q4k_code(block + 16, 32 * i + 16 + 4 * v + j);
          rec[256 * i + 64 * v + 4 * r + j] = static_cast<uint8_t>(lo | (hi << 4));
        }
      }
    }
  });
}

namespace {
void check_q4k_activations(const torch::Tensor& x, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "x must be a contiguous bf16 or float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) >= kBlockValues && x.size(1) % kBlockValues == 0, "K must be a positive multiple of 256, got ",
              x.size(1));
  TORCH_CHECK(group == 32 || group == 256, "the activations' group must be 32 or 256 values, got ", group);
}

void quantize_any(const torch::Tensor& x, int64_t group, int8_t* xq, float* xs, float* xm) {
  const int64_t m = x.size(0), k = x.size(1);
  if (x.scalar_type() == torch::kFloat32) {
    quantize_rows(x.data_ptr<float>(), m, k, group, xq, xs, xm);
  } else {
    quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m, k, group, xq, xs, xm);
  }
}

// Q6_K's -32 bias per 16 values of x: 32 dx sum(xq) (x in int8 per 32 values, scale dx).
std::vector<float> q6k_offsets(const std::vector<int8_t>& xq, const std::vector<float>& xs) {
  std::vector<float> xoff(xq.size() / 16);
  for (size_t i = 0; i < xoff.size(); ++i) {
    int32_t sum = 0;
    for (int j = 0; j < 16; ++j) sum += xq[16 * i + j];
    xoff[i] = 32.f * xs[i / 2] * static_cast<float>(sum);
  }
  return xoff;
}

// x [m, K] @ tiled records [n rows of K]^T -> y [m, n] float32, x in int8 per `group` values (and, for
// Q6_K, its per-16 offsets). Each task's tiles are read once and serve every row of x, `pass_rows` at a
// time: pass(rows, tile, per_row, xq, xs, xm, xoff, k, y, n, row0) for the rows from m0 on.
template <typename Pass>
torch::Tensor tiled_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t group,
                           int64_t record_bytes, const char* layout, bool offsets, int pass_rows, Pass pass) {
  check_q4k_activations(x, group);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1, "x has no rows");
  const int64_t per_row = k / kBlockValues, tiles = (n + kTileRows - 1) / kTileRows;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be contiguous uint8");
  TORCH_CHECK(n >= 1 && packed.numel() == tiles * per_row * record_bytes, "packed does not hold ", n, " rows of ", k,
              " (", layout, "'s layout)");
  std::vector<int8_t> xq(m * k);
  std::vector<float> xs(m * k / 32), xm(m * k / 32);
  quantize_any(x, group, xq.data(), xs.data(), xm.data());
  const std::vector<float> xoff = offsets ? q6k_offsets(xq, xs) : std::vector<float>();
  auto y = torch::empty({m, n}, x.options().dtype(torch::kFloat32));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // ~16 tiles of a 1536-wide weight per task.
  const int64_t grain = std::max<int64_t>(1, 16 * 1536 / k);
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = wp + t * per_row * record_bytes;
      for (int64_t m0 = 0; m0 < m; m0 += pass_rows) {
        pass(static_cast<int>(std::min<int64_t>(pass_rows, m - m0)), tile, per_row, xq.data() + m0 * k,
             xs.data() + m0 * (k / 32), xm.data() + m0 * (k / 32), offsets ? xoff.data() + m0 * (k / 16) : nullptr,
             k, yp + m0 * n, n, t * kTileRows);
      }
    }
  });
  return y;
}
}  // namespace

std::vector<torch::Tensor> q4k_quantize(torch::Tensor x, int64_t group) {
  check_q4k_activations(x, group);
  const int64_t m = x.size(0), k = x.size(1);
  auto xq = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  auto xs = torch::empty({m, k / 32}, x.options().dtype(torch::kFloat32));
  auto xm = torch::empty({m, k / 32}, x.options().dtype(torch::kFloat32));
  quantize_any(x, group, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xm.data_ptr<float>());
  return {xq, xs, xm};
}

torch::Tensor q4k_matmul(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t group) {
  return tiled_matmul(x, packed, n, group, kQ4KPackedBytes, "q4k_pack", false, kPassRows,
                      [](int rows, const uint8_t* tile, int64_t per_row, const int8_t* xq, const float* xs,
                         const float* xm, const float*, int64_t k, float* y, int64_t n, int64_t row0) {
                        q4k_tile_rows(rows, tile, per_row, xq, xs, xm, k, y, n, row0);
                      });
}
#if SPECVERIFY_Q4K == 256
// AVX2 reads the Q6_K blocks as stored: checked, not copied.
torch::Tensor q6k_pack(torch::Tensor blocks, int64_t n, int64_t k) {
  check_blocks(blocks, n, k, kQ6KBytes, "Q6_K");
  return blocks;
}

// x [M, K] (bf16 / float32) @ Q6_K blocks [N rows of K]^T -> [M, N] float32, with x in int8 (AVX2).
torch::Tensor q6k_matmul(torch::Tensor x, torch::Tensor blocks, int64_t n) {
  check_q4k_activations(x, 32);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1, "x has no rows");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(), "blocks must be contiguous uint8");
  TORCH_CHECK(n >= 1 && blocks.numel() == n * (k / kBlockValues) * kQ6KBytes, "blocks do not hold ", n, " rows of ", k);
  std::vector<int8_t> xq(m * k);
  std::vector<float> xs(m * k / 32), xm(m * k / 32);
  quantize_any(x, 32, xq.data(), xs.data(), xm.data());
  const std::vector<float> xoff = q6k_offsets(xq, xs);
  auto y = torch::empty({m, n}, x.options().dtype(torch::kFloat32));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16 * 1536 / k);
  // Rows of x a pass at a time within each task's output rows, whose weights stay in cache meanwhile.
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += 4) {
      q6k_int8_pass(static_cast<int>(std::min<int64_t>(4, m - m0)), xq.data() + m0 * k,
                    xs.data() + m0 * (k / 32), xoff.data() + m0 * (k / 16), bp, yp + m0 * n, k, n, begin, end);
    }
  });
  return y;
}
#endif  // SPECVERIFY_Q4K == 256

#if SPECVERIFY_Q4K == 512
// Q6_K blocks [N rows of K] -> the tiled kernel's records, N padded to 16 rows with zeros (d = 0).
torch::Tensor q6k_pack(torch::Tensor blocks, int64_t n, int64_t k) {
  return pack_tiles(blocks, n, k, kQ6KBytes, kQ6KPackedBytes, "Q6_K", [](const uint8_t* block, uint8_t* rec, int r) {
    std::memcpy(rec + 2 * r, block + 208, 2);
    for (int sub = 0; sub < 16; ++sub) rec[kQ6KScOffset + 16 * sub + r] = block[192 + sub];
    for (int i = 0; i < 8; ++i) {
      uint8_t* group = rec + kQ6KGroupOffset + kQ6KGroupBytes * i;
      for (int v = 0; v < 4; ++v) {
        for (int j = 0; j < 4; ++j) {
          const int lo = q6k_code(block, 32 * i + 4 * v + j), hi = q6k_code(block, 32 * i + 16 + 4 * v + j);
          group[64 * v + 4 * r + j] = static_cast<uint8_t>((lo & 0x0F) | ((hi & 0x0F) << 4));
          group[256 + 64 * (v / 2) + 4 * r + j] |=
              static_cast<uint8_t>(((lo >> 4) << (2 * (v & 1))) | ((hi >> 4) << (4 + 2 * (v & 1))));
        }
      }
    }
  });
}

// x [M, K] (bf16 / float32) @ q6k_pack's records [n rows of K]^T -> [M, n] float32, with x in int8.
torch::Tensor q6k_matmul(torch::Tensor x, torch::Tensor packed, int64_t n) {
  return tiled_matmul(x, packed, n, 32, kQ6KPackedBytes, "q6k_pack", true, 8,
                      [](int rows, const uint8_t* tile, int64_t per_row, const int8_t* xq, const float* xs,
                         const float*, const float* xoff, int64_t k, float* y, int64_t n, int64_t row0) {
                        q6k_tile_rows(rows, tile, per_row, xq, xs, xoff, k, y, n, row0);
                      });
}
#endif  // SPECVERIFY_Q4K == 512
#endif  // SPECVERIFY_Q4K

bool has_q4k() {
#if defined(SPECVERIFY_Q4K)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_q4k", &has_q4k, "whether this build has the Q4_K kernel (AVX512-VNNI)");
#if defined(SPECVERIFY_Q4K)
  m.def("q4k_pack", &q4k_pack, "Q4_K blocks [N rows of K] -> the Q4_K kernel's layout (16-row tiles)");
  m.def("q4k_quantize", &q4k_quantize, "x [M, K] -> int8 codes, per-32 scale, per-32 scale * code sum");
  m.def("q4k_matmul", &q4k_matmul, "x [M, K] bf16 / float32 @ packed Q4_K [N rows of K]^T -> [M, N] float32");
  m.def("q6k_pack", &q6k_pack, "Q6_K blocks [N rows of K] -> the Q6_K kernel's layout (VNNI: 16-row tiles; AVX2: as stored)");
  m.def("q6k_matmul", &q6k_matmul, "x [M, K] bf16 / float32 @ q6k_pack's Q6_K [N rows of K]^T -> [M, N] float32, x in int8");
#endif
}
