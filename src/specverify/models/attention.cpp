// Attention for the short chunks of a ragged batch (CPU): every sequence in one call per layer, its new
// keys and values written into its cache first.
//
// The Python loop it replaces ran ~10 tensor ops per sequence and layer (cache writes, views, SDPA, the
// copy out), ~60 us each on a 2-core CPU. Here the work items are (sequence, kv head) pairs, spread over
// torch's threads; each item writes its new rows into the cache, then for its query heads (the kv
// head's group, times the chunk's rows): scores against every key it may see (causal within the
// chunk), softmax and the weighted sum of values, all in float32. `attention.py` sends it one-row
// chunks only: at 6 rows PyTorch's SDPA (a GEMM) was 2x faster.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// e^x for x <= 0 (scores less their row's max), vectorizable: 2^n e^r with |r| <= ln2 / 2 and the
// Cephes polynomial for e^r (relative error ~2e-7); below -87 it returns 0 (e^-87 ~ 1.6e-38).
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// Rows of bf16 / float32 into float32, in a loop the compiler vectorizes (bf16 is float's top half).
inline void load_floats(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_floats(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

struct Item {
  int64_t start, rows, past, seq, head;
};

// D: the head dim when known at compile time (64, 128: the loops over it unroll), 0 for any other, read
// at run time.
template <typename T, int64_t D>
void attend_item(const Item& it, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& cache_k, const at::Tensor& cache_v, int64_t layer, int64_t groups,
                 at::Tensor& out, std::vector<float>& buf) {
  const int64_t d = D ? D : q.size(2), kv_heads = k.size(1), capacity = cache_k.size(2);
  const int64_t total = it.past + it.rows, queries = groups * it.rows;
  T* kc = cache_k.data_ptr<T>() + ((layer * kv_heads + it.head) * capacity) * d;
  T* vc = cache_v.data_ptr<T>() + ((layer * kv_heads + it.head) * capacity) * d;
  for (int64_t i = 0; i < it.rows; ++i) {  // the chunk's keys and values into the cache
    const T* ks = k.data_ptr<T>() + (it.start + i) * k.stride(0) + it.head * d;
    const T* vs = v.data_ptr<T>() + (it.start + i) * v.stride(0) + it.head * d;
    std::memcpy(kc + (it.past + i) * d, ks, d * sizeof(T));
    std::memcpy(vc + (it.past + i) * d, vs, d * sizeof(T));
  }
  // Query (i, j): row i of the chunk, head j of the group; it sees keys 0 .. past + i. Keys and values
  // are converted to float a row at a time, each row serving all the item's queries.
  buf.resize(queries * (2 * d + total + 1) + d);
  float* qf = buf.data();                 // [queries][d], scaled by 1 / sqrt(d)
  float* scores = qf + queries * d;       // [queries][total]
  float* acc = scores + queries * total;  // [queries][d]
  float* sums = acc + queries * d;        // [queries]
  float* row = sums + queries;            // [d]
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t i = 0; i < it.rows; ++i) {
    for (int64_t j = 0; j < groups; ++j) {
      const T* qs = q.data_ptr<T>() + (it.start + i) * q.stride(0) + (it.head * groups + j) * d;
      float* qd = qf + (i * groups + j) * d;
      load_floats(qs, qd, d);
      for (int64_t c = 0; c < d; ++c) qd[c] *= scale;
    }
  }
  for (int64_t t = 0; t < total; ++t) {
    load_floats(kc + t * d, row, d);
    // Rows of the chunk before t - past do not see key t; their scores are never read.
    for (int64_t qi = std::max<int64_t>(0, t - it.past) * groups; qi < queries; ++qi) {
      const float* qd = qf + qi * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < d; ++c) dot += qd[c] * row[c];
      scores[qi * total + t] = dot;
    }
  }
  for (int64_t qi = 0; qi < queries; ++qi) {  // softmax over the keys query qi sees
    const int64_t seen = it.past + qi / groups + 1;
    float* s = scores + qi * total;
    float top = s[0];
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < seen; ++t) top = std::max(top, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < seen; ++t) {
      s[t] = exp_nonpositive(s[t] - top);
      sum += s[t];
    }
    sums[qi] = sum;
    for (int64_t c = 0; c < d; ++c) acc[qi * d + c] = 0.0f;
  }
  for (int64_t t = 0; t < total; ++t) {
    load_floats(vc + t * d, row, d);
    for (int64_t qi = std::max<int64_t>(0, t - it.past) * groups; qi < queries; ++qi) {
      const float pt = scores[qi * total + t];
      float* a = acc + qi * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) a[c] += pt * row[c];
    }
  }
  for (int64_t i = 0; i < it.rows; ++i) {
    for (int64_t j = 0; j < groups; ++j) {
      const int64_t qi = i * groups + j;
      T* o = out.data_ptr<T>() + (it.start + i) * out.stride(0) + (it.head * groups + j) * d;
      const float inv = 1.0f / sums[qi];
      for (int64_t c = 0; c < d; ++c) o[c] = static_cast<T>(acc[qi * d + c] * inv);
    }
  }
}

template <typename T>
void attend(const Item& it, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const at::Tensor& cache_k, const at::Tensor& cache_v, int64_t layer, int64_t groups, at::Tensor& out,
            std::vector<float>& buf) {
  switch (q.size(2)) {
    case 64: return attend_item<T, 64>(it, q, k, v, cache_k, cache_v, layer, groups, out, buf);
    case 128: return attend_item<T, 128>(it, q, k, v, cache_k, cache_v, layer, groups, out, buf);
    default: return attend_item<T, 0>(it, q, k, v, cache_k, cache_v, layer, groups, out, buf);
  }
}

void check_rows(const at::Tensor& t, const char* name, int64_t heads, int64_t d) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == heads && t.size(2) == d, name, " must be [N, ", heads, ", ",
              d, "]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == d, name, "'s heads must be contiguous");
}

}  // namespace

// q [N, heads, d], k / v [N, kv_heads, d] (rows may be strided, each row's heads contiguous); caches: per
// sequence, the whole [layers, kv_heads, capacity, d] key and value tensors; sequence s owns rows
// starts[s] .. ends[s], and past[s] positions are already in its cache (its new rows go after them).
// Writes out [N, heads * d] (rows may be strided).
void chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::vector<at::Tensor>& cache_k, const std::vector<at::Tensor>& cache_v,
                     const at::Tensor& starts, const at::Tensor& ends, const at::Tensor& past,
                     int64_t layer, at::Tensor& out) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), d = q.size(2), seqs = past.numel();
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of kv heads");
  check_rows(q, "q", heads, d);
  check_rows(k, "k", kv_heads, d);
  check_rows(v, "v", kv_heads, d);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "q, k, v and out must share a dtype");
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == at::kFloat, "chunk attention takes bfloat16 or float32");
  for (const at::Tensor* t : {&starts, &ends, &past})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == seqs,
                "starts, ends and past must be contiguous int64, one per sequence");
  TORCH_CHECK(out.dim() == 2 && out.size(1) == heads * d && out.stride(1) == 1, "out must be [N, heads * d]");
  TORCH_CHECK(static_cast<int64_t>(cache_k.size()) == seqs && static_cast<int64_t>(cache_v.size()) == seqs,
              "one cache pair per sequence");
  const int64_t* b = starts.data_ptr<int64_t>();
  const int64_t* e = ends.data_ptr<int64_t>();
  const int64_t* p = past.data_ptr<int64_t>();
  std::vector<Item> items;
  for (int64_t s = 0; s < seqs; ++s) {
    const at::Tensor& ck = cache_k[s];
    TORCH_CHECK(ck.dim() == 4 && ck.is_contiguous() && cache_v[s].is_contiguous() &&
                    ck.sizes() == cache_v[s].sizes() && ck.size(1) == kv_heads && ck.size(3) == d &&
                    layer >= 0 && layer < ck.size(0) && ck.scalar_type() == q.scalar_type(),
                "caches must be contiguous [layers, kv_heads, capacity, d] in q's dtype");
    TORCH_CHECK(0 <= b[s] && b[s] <= e[s] && e[s] <= q.size(0) && e[s] <= k.size(0) && e[s] <= v.size(0) &&
                    e[s] <= out.size(0),
                "a chunk's rows are out of range");
    TORCH_CHECK(p[s] >= 0 && p[s] + e[s] - b[s] <= ck.size(2), "a chunk does not fit its cache");
    for (int64_t h = 0; h < kv_heads && e[s] > b[s]; ++h) items.push_back({b[s], e[s] - b[s], p[s], s, h});
  }
  const int64_t groups = heads / kv_heads;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      if (bf16)
        attend<c10::BFloat16>(it, q, k, v, cache_k[it.seq], cache_v[it.seq], layer, groups, out, buf);
      else
        attend<float>(it, q, k, v, cache_k[it.seq], cache_v[it.seq], layer, groups, out, buf);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("chunk_attention", &chunk_attention,
        "every short chunk's keys and values into its cache, then its causal attention over the cache");
}
