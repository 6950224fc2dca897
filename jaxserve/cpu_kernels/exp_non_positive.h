// exp of a softmax's shifted scores, as a loop the compiler vectorizes (paged_attention.cc).

#ifndef JAXSERVE_CPU_KERNELS_EXP_NON_POSITIVE_H_
#define JAXSERVE_CPU_KERNELS_EXP_NON_POSITIVE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace jaxserve {

// exp(x) for x <= 0 (a score minus its row's max), within ~2 float32 ulp; a loop of it vectorizes (std::exp would
// be a scalar call per key).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);  // x = n ln2 + r, |r| <= ln2 / 2
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_KERNELS_EXP_NON_POSITIVE_H_
