// e^x in plain float arithmetic, so the loops that call it vectorize (std::exp does not).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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
