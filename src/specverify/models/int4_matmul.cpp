// Matmuls on int4 weights with a scale and a low end per 32 values (`quant.Int4Groups`: the draft's
// min-max codes, a target's Q4_K codes), for the 1-8 rows of drafting and verification (CPU).
//
// At a few rows the matmul is bound by reading the weight, and PyTorch's `_weight_int4pack_mm_for_cpu`
// streamed it at ~14 GB/s where this machine reads ~40. Here the activations are quantized to int8 (one
// scale per 32 values) and multiplied with the unsigned 4-bit codes by AVX512-VNNI byte dot products; a
// group's integer dot is scaled in float32 and the group's low end times the group's sum of x is added:
//   sum_i w_i x_i ~ dx (scale * sum_i q_i xq_i + low * sum_i xq_i),   with x_i ~ dx * xq_i.
// Only the activations' rounding (to 8 bits per group) differs from a dense matmul on the same weights.
//
// Layout (`int4_pack`, once at load): 16 output rows share each 64-byte vector, 4 consecutive values of
// each, so the int32 lanes are output rows, the activations are broadcast and no horizontal sums are
// needed. A record per (tile of 16 rows, group of 32 values): codes [4 vectors][16 rows][4 bytes] (low
// nibble: value 4 v + j, high nibble: value 16 + 4 v + j), then scale and low as bf16 [16] each: 320
// bytes, read front to back, so the hardware prefetcher sees one stream per thread.
//
// Without AVX512-VNNI the same layout runs in AVX2: each VNNI dot product becomes maddubs / madd, over
// 8 output rows (one 32-byte half of each 64) per pass.
//
// Compiled with -march=native; without AVX2 the functions only raise (the Python side checks the CPU's
// flags before building).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx2_int8.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SPECVERIFY_INT4 512
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECVERIFY_INT4 256
#endif

namespace {

constexpr int kGroup = 32;         // values per scale / low end
constexpr int kTileRows = 16;      // output rows per packed tile: one int32 lane each
constexpr int kCodeBytes = 256;    // 16 rows x 32 values x 4 bits
constexpr int kRecordBytes = 320;  // codes, scale bf16 [16], low bf16 [16]

#if SPECVERIFY_INT4 == 512
constexpr int kMaxTile = 8;        // activation rows per pass over a tile's weights

// bf16 [16] -> float32 [16]: a bf16 is the top half of a float.
inline __m512 load_bf16(const uint8_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x [m, k] -> xq int8 [m, k], and per 32 values dx (xq's scale) and sx (dx times the sum of xq, for the
// low ends). per_row: one scale for a whole row (max |x| over the row) instead of one per group.
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, bool per_row, int8_t* xq, float* dx, float* sx) {
  const int64_t groups = k / kGroup;
  for (int64_t r = 0; r < m; ++r) {
    const T* xr = x + r * k;
    float row_top = 0.f;
    if (per_row) {
      __m512 amax = _mm512_setzero_ps();
      for (int64_t i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(xr + i)));
      row_top = _mm512_reduce_max_ps(amax);
    }
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 a = load16(xr + g * kGroup), b = load16(xr + g * kGroup + 16);
      const float top = per_row ? row_top : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // nearest, ties to even
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      int8_t* out = xq + r * k + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(qb));
      dx[r * groups + g] = top / 127.f;
      // The sum of the rounded x, not of x: then the result is the exact dot of w with the rounded x,
      // whose error is w . (x - x'), not (w - low) . (x - x') + low * sum(x - x'): with the low end near
      // -8 scales (weights centred on zero) the latter is about twice as large.
      sx[r * groups + g] = top / 127.f * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
    }
  }
}

// Rows [0, M) of y (row stride n) for one tile of 16 output rows starting at row0.
template <int M>
void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, const float* dx, const float* sx, int64_t k,
               float* y, int64_t n, int64_t row0) {
  // Few rows: separate chains for the low ends and for the two nibbles, so that the dot products and
  // multiply-adds of one row do not wait on each other; more rows give the core enough independent work.
  constexpr bool kSplit = M <= 2;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[M], acc_low[M];
  for (int m = 0; m < M; ++m) acc[m] = acc_low[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* rec = tile + g * kRecordBytes;
    __m512i lo[4], hi[4];
    for (int v = 0; v < 4; ++v) {
      const __m512i w = _mm512_loadu_si512(rec + 64 * v);
      lo[v] = _mm512_and_si512(w, low4);
      hi[v] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
    }
    const __m512 scale = load_bf16(rec + kCodeBytes), low = load_bf16(rec + kCodeBytes + 32);
    for (int m = 0; m < M; ++m) {
      const int8_t* xp = xq + m * k + g * kGroup;
      __m512i dot = _mm512_setzero_si512(), dot_hi = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        // u8 codes x s8 activations, 4 products summed per int32 lane (at most 4 * 15 * 127). The 4 bytes
        // of x are broadcast straight from memory (a load), not through a general register (a shuffle).
        dot = _mm512_dpbusd_epi32(dot, lo[v], _mm512_broadcastd_epi32(_mm_loadu_si32(xp + 4 * v)));
        const __m512i xh = _mm512_broadcastd_epi32(_mm_loadu_si32(xp + 16 + 4 * v));
        if constexpr (kSplit) {
          dot_hi = _mm512_dpbusd_epi32(dot_hi, hi[v], xh);
        } else {
          dot = _mm512_dpbusd_epi32(dot, hi[v], xh);
        }
      }
      if constexpr (kSplit) dot = _mm512_add_epi32(dot, dot_hi);
      const int64_t at = m * (k / kGroup) + g;
      const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(dx[at]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[m]);
      if constexpr (kSplit) {
        acc_low[m] = _mm512_fmadd_ps(low, _mm512_set1_ps(sx[at]), acc_low[m]);
      } else {
        acc[m] = _mm512_fmadd_ps(low, _mm512_set1_ps(sx[at]), acc[m]);
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kTileRows, n - row0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  for (int m = 0; m < M; ++m) {
    const __m512 out = kSplit ? _mm512_add_ps(acc[m], acc_low[m]) : acc[m];
    _mm512_mask_storeu_ps(y + m * n + row0, mask, out);
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const float*, int64_t, float*,
                        int64_t, int64_t);
constexpr TileFn kTileFns[kMaxTile] = {tile_rows<1>, tile_rows<2>, tile_rows<3>, tile_rows<4>,
                                       tile_rows<5>, tile_rows<6>, tile_rows<7>, tile_rows<8>};

#elif SPECVERIFY_INT4 == 256
constexpr int kMaxTile = 4;  // activation rows per pass over a tile's weights (16 ymm registers)

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, bool per_row, int8_t* xq, float* dx, float* sx) {
  avx2::quantize_rows(x, m, k, per_row ? k : kGroup, xq, dx, sx);
}

// Rows [0, M) of y (row stride n) for one tile of 16 output rows starting at row0, 8 rows per pass.
template <int M>
void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, const float* dx, const float* sx, int64_t k,
               float* y, int64_t n, int64_t row0) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2 && row0 + 8 * h < n; ++h) {
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* rec = tile + g * kRecordBytes;
      __m256i lo[4], hi[4];
      for (int v = 0; v < 4; ++v) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * v + 32 * h));
        lo[v] = _mm256_and_si256(w, low4);
        hi[v] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
      }
      const __m256 scale = avx2::load_bf16x8(rec + kCodeBytes + 16 * h);
      const __m256 low = avx2::load_bf16x8(rec + kCodeBytes + 32 + 16 * h);
      for (int m = 0; m < M; ++m) {
        const int8_t* xp = xq + m * k + g * kGroup;
        // u8 codes x s8 activations in int16 pairs (4 maddubs summed: at most 8 * 15 * 127), then int32.
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
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(pairs[0], ones), _mm256_madd_epi16(pairs[1], ones));
        const int64_t at = m * (k / kGroup) + g;
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(dx[at])), acc[m]);
        acc[m] = _mm256_fmadd_ps(low, _mm256_set1_ps(sx[at]), acc[m]);
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

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const float*, int64_t, float*,
                        int64_t, int64_t);
constexpr TileFn kTileFns[kMaxTile] = {tile_rows<1>, tile_rows<2>, tile_rows<3>, tile_rows<4>};
#endif  // SPECVERIFY_INT4

}  // namespace

bool has_int4() {
#if defined(SPECVERIFY_INT4)
  return true;
#else
  return false;
#endif
}

// codes [N, K] uint8 (0..15), scale and low [N, K / 32] bf16 -> the kernel's records, N padded to 16
// rows with zeros (scale = low = 0: those rows add nothing and are never stored).
torch::Tensor int4_pack(torch::Tensor codes, torch::Tensor scale, torch::Tensor low) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8 && codes.is_contiguous(),
              "codes must be a contiguous uint8 [N, K] tensor");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(n >= 1 && k >= kGroup && k % kGroup == 0, "K must be a positive multiple of ", kGroup, ", got ", k);
  const int64_t groups = k / kGroup, tiles = (n + kTileRows - 1) / kTileRows;
  for (const auto* t : {&scale, &low}) {
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                    t->size(1) == groups,
                "scale and low must be contiguous bf16 [N, K / 32] tensors");
  }
  auto out = torch::zeros({tiles * groups * kRecordBytes}, codes.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  const auto* lp = reinterpret_cast<const uint16_t*>(low.data_ptr<at::BFloat16>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r = 0; r < kTileRows && t * kTileRows + r < n; ++r) {
        const int64_t row = t * kTileRows + r;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* c = cp + row * k + g * kGroup;
          uint8_t* rec = dst + (t * groups + g) * kRecordBytes;
          for (int v = 0; v < 4; ++v) {
            for (int j = 0; j < 4; ++j) {
              rec[64 * v + 4 * r + j] = static_cast<uint8_t>((c[4 * v + j] & 0x0F) | ((c[16 + 4 * v + j] & 0x0F) << 4));
            }
          }
          std::memcpy(rec + kCodeBytes + 2 * r, sp + row * groups + g, 2);
          std::memcpy(rec + kCodeBytes + 32 + 2 * r, lp + row * groups + g, 2);
        }
      }
    }
  });
  return out;
}

// x [M, K] bf16 or float32 @ the packed weight [n rows of K]^T -> float32 [M, n].
torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor packed, int64_t n, bool per_row) {
#if defined(SPECVERIFY_INT4)
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "x must be a contiguous bf16 or float32 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1, "x has no rows");
  TORCH_CHECK(k >= kGroup && k % kGroup == 0, "K must be a positive multiple of ", kGroup, ", got ", k);
  const int64_t groups = k / kGroup, tiles = (n + kTileRows - 1) / kTileRows;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be contiguous uint8");
  TORCH_CHECK(n >= 1 && packed.numel() == tiles * groups * kRecordBytes, "packed does not hold ", n, " rows of ",
              k, " values (int4_pack's layout)");
  std::vector<int8_t> xq(m * k);
  std::vector<float> dx(m * groups), sx(m * groups);
  if (x.scalar_type() == torch::kFloat32) {
    quantize_rows(x.data_ptr<float>(), m, k, per_row, xq.data(), dx.data(), sx.data());
  } else {
    quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m, k, per_row, xq.data(),
                  dx.data(), sx.data());
  }
  auto y = torch::empty({m, n}, x.options().dtype(torch::kFloat32));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // ~8 tiles of a 896-wide weight per task: small enough to balance, big enough to amortise the call.
  const int64_t grain = std::max<int64_t>(1, 8 * 896 / k);
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = wp + t * groups * kRecordBytes;
      // More rows than a pass takes: more passes over the tile, whose weights are then in cache.
      for (int64_t m0 = 0; m0 < m; m0 += kMaxTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxTile, m - m0));
        kTileFns[rows - 1](tile, groups, xq.data() + m0 * k, dx.data() + m0 * groups, sx.data() + m0 * groups, k,
                           yp + m0 * n, n, t * kTileRows);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "this build has no int4 kernel (the compiler did not target AVX2)");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_int4", &has_int4, "whether this build has the int4 kernel (AVX512-VNNI)");
  m.def("int4_pack", &int4_pack, "codes [N, K] u8, scale / low [N, K / 32] bf16 -> the kernel's 16-row tiles");
  m.def("int4_matmul", &int4_matmul, "x [M, K] bf16 / float32 @ packed int4 [N rows of K]^T -> [M, N] float32");
}
