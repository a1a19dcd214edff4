// Matmuls straight from a GGUF file's Q6_K blocks, for the few rows of decoding (CPU).
//
// At one to a few rows a matmul is bound by reading the weight. PyTorch has no kernel for Q6_K's
// 6-bit codes with a scale per 16 values, so without this the target streamed those tensors as bf16
// (2 bytes a weight against Q6_K's 0.82). Here each block is decoded in registers and multiplied with
// the bf16 activations by AVX512-BF16 dot products, summed in float32: the weights are exactly the
// file's (d * scale * (q - 32)), and only the summation order differs from a dense matmul.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int kBlockValues = 256;  // ggml's QK_K
constexpr int kQ6KBytes = 210;     // ql[128], qh[64], scales[16] (int8), d (fp16)

// One Q6_K block's 6-bit codes (0..63), in value order (the layout gguf-py's dequantisation reads):
// value 128 h + 32 j + l takes nibble (j >= 2) of ql[64 h + 32 (j & 1) + l] and bits 2 j of qh[32 h + l].
// out[2 h] holds values 128 h + 0..63, out[2 h + 1] values 128 h + 64..127, one byte each.
inline void decode_q6k(const uint8_t* block, __m512i out[4]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  for (int half = 0; half < 2; ++half) {
    const __m512i ql = _mm512_loadu_si512(block + 64 * half);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * half));
    // Each value's two high bits moved to bits 4-5 of its byte: bits 2 j of qh for quarter j, from
    // [qh, qh >> 2] (16-bit shifts: the 0x30 mask drops what crosses in from the next byte).
    const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    const __m512i high_a = _mm512_and_si512(_mm512_slli_epi16(qh2, 4), bits45);  // quarters 0, 1
    // (a & b) | c in one instruction: 0xEA is the truth table of A & B | C.
    out[2 * half] = _mm512_ternarylogic_epi32(ql, low4, high_a, 0xEA);
    out[2 * half + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), low4, _mm512_and_si512(qh2, bits45), 0xEA);
  }
}

// y[m, n] = sum_k x[m, k] * w[n, k] for output rows [begin, end), with bf16 dot products.
//
// A code c becomes the bf16 number 128 + c by pairing its byte with 0x43 (bf16 0x43cc is 128 + cc,
// exact), so w = d s (c - 32) = d s ((128 + c) - 160): each sub-block's dot is taken with 128 + c and
// 160 times the sub-block's sum of x (`xsum`, computed once per call) is taken off. The byte unpacking
// interleaves within 128-bit lanes; `x` comes permuted to match (see `ggml.py`), and float lane i of a
// 64-value dot belongs to sub-block i / 4. M is a template parameter so the accumulators stay in registers.
template <int M>
void q6k_rows(const uint16_t* x, const float* xsum, const uint8_t* blocks, float* y, int64_t k, int64_t n,
              int64_t begin, int64_t end) {
  const int64_t per_row = k / kBlockValues;
  const __m512i tag = _mm512_set1_epi8(0x43);
  __m512i lane_sub[4];  // float lane i of the 64 values at 64 g -> the block's sub-block 4 g + i / 4
  for (int g = 0; g < 4; ++g) {
    alignas(64) int32_t idx[16];
    for (int i = 0; i < 16; ++i) idx[i] = 4 * g + i / 4;
    lane_sub[g] = _mm512_load_si512(idx);
  }
  for (int64_t row = begin; row < end; ++row) {
    __m512 acc[M], offset[M];
    for (int m = 0; m < M; ++m) acc[m] = offset[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < per_row; ++b) {
      const uint8_t* block = blocks + (row * per_row + b) * kQ6KBytes;
      __m512i codes[4];
      decode_q6k(block, codes);
      uint16_t d_bits;
      std::memcpy(&d_bits, block + 208, 2);
      const __m128i sub_scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
      const __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub_scales)),
                                          _mm512_set1_ps(_cvtsh_ss(d_bits)));
      for (int m = 0; m < M; ++m)
        offset[m] = _mm512_fmadd_ps(scales, _mm512_loadu_ps(xsum + m * (k / 16) + b * 16), offset[m]);
      for (int g = 0; g < 4; ++g) {
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi8(codes[g], tag);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi8(codes[g], tag);
        const __m512 s = _mm512_permutexvar_ps(lane_sub[g], scales);
        for (int m = 0; m < M; ++m) {
          const uint16_t* xg = x + m * k + b * kBlockValues + 64 * g;
          __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(xg));
          dot = _mm512_dpbf16_ps(dot, hi, (__m512bh)_mm512_loadu_si512(xg + 32));
          acc[m] = _mm512_fmadd_ps(s, dot, acc[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * n + row] = _mm512_reduce_add_ps(_mm512_sub_ps(acc[m], offset[m]));
  }
}

template <int M>
void q6k_dispatch(const uint16_t* x, const float* xsum, const uint8_t* blocks, float* y, int64_t k, int64_t n) {
  // ~16 rows of a 1536-wide weight per task: small enough to balance, big enough to amortise.
  const int64_t grain = std::max<int64_t>(1, 16 * 1536 / k);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    q6k_rows<M>(x, xsum, blocks, y, k, n, begin, end);
  });
}

}  // namespace

torch::Tensor q6k_matmul(torch::Tensor x, torch::Tensor xsum, torch::Tensor blocks, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bf16 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlockValues == 0, "K must be a multiple of 256, got ", k);
  TORCH_CHECK(xsum.scalar_type() == torch::kFloat32 && xsum.is_contiguous() && xsum.numel() == m * k / 16,
              "xsum must be a contiguous float32 [M, K / 16] tensor");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(), "blocks must be contiguous uint8");
  TORCH_CHECK(blocks.numel() == n * (k / kBlockValues) * kQ6KBytes, "blocks do not hold ", n, " rows of ", k);
  TORCH_CHECK(m >= 1 && m <= 8, "q6k_matmul takes 1 to 8 rows, got ", m);
  auto y = torch::empty({m, n}, xsum.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const float* sp = xsum.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (m) {
    case 1: q6k_dispatch<1>(xp, sp, bp, yp, k, n); break;
    case 2: q6k_dispatch<2>(xp, sp, bp, yp, k, n); break;
    case 3: q6k_dispatch<3>(xp, sp, bp, yp, k, n); break;
    case 4: q6k_dispatch<4>(xp, sp, bp, yp, k, n); break;
    case 5: q6k_dispatch<5>(xp, sp, bp, yp, k, n); break;
    case 6: q6k_dispatch<6>(xp, sp, bp, yp, k, n); break;
    case 7: q6k_dispatch<7>(xp, sp, bp, yp, k, n); break;
    default: q6k_dispatch<8>(xp, sp, bp, yp, k, n); break;
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q6k_matmul", &q6k_matmul, "x [M, K] bf16 (permuted) @ Q6_K blocks [N rows of K]^T -> [M, N] float32");
}
