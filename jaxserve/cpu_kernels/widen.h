// Weights and cached keys as the kernels read them: float32, bfloat16 (its bits: the high half of a float32) or
// int8 (scaled by the caller), widened to float32 in registers.

#ifndef JAXSERVE_CPU_KERNELS_WIDEN_H_
#define JAXSERVE_CPU_KERNELS_WIDEN_H_

#include <cstdint>
#include <cstring>

namespace jaxserve {

inline float Widen(float v) { return v; }
inline float Widen(int8_t v) { return static_cast<float>(v); }
inline float Widen(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_KERNELS_WIDEN_H_
