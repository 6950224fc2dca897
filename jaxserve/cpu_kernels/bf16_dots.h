// The paged-attention kernel's dots on bfloat16 pages with AVX-512-BF16's vdpbf16ps: two bf16 products a lane,
// exact, summed in float32. Widening each bf16 key to float32 for every query of its group made the kernel
// instruction-bound (a 64-row bf16 step read its KV cache at half the rate the cores stream memory); here a key's
// 32 elements meet a query in one instruction. The queries and the softmax weights are rounded to bf16 for it: the
// caller asks for this only where the model computes in bf16, whose queries are bf16 already.
//
// Built in the x86-64-v4-bf16 variant only (jaxserve/cpu_kernels/isa.py); kBf16Dots is false elsewhere.

#ifndef JAXSERVE_CPU_KERNELS_BF16_DOTS_H_
#define JAXSERVE_CPU_KERNELS_BF16_DOTS_H_

#include <cstdint>
#include <cstring>

#include "lanes16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace jaxserve {

#if defined(__AVX512BF16__)
constexpr bool kBf16Dots = true;

// Round to nearest even (the values here are finite: queries, softmax weights).
inline uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// out[g * stride + j] = scale[j] * (q[g] . key[j]) for G queries q [G, D] (bf16 bits) and count <= 16 keys,
// D = 32 * kPairs.
template <int kPairs>
void ScoreBlockBf16(const uint16_t* q, int64_t G, int64_t D, const uint16_t* const (&key)[16],
                    const float (&scale)[16], int count, float* out, int64_t stride) {
  for (int64_t g = 0; g < G; ++g) {
    __m512bh qc[kPairs];
    for (int c = 0; c < kPairs; ++c) qc[c] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c);
    F32x16 dots[16] = {};
    for (int j = 0; j < count; ++j) {
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < kPairs; ++c) a = _mm512_dpbf16_ps(a, qc[c], (__m512bh)_mm512_loadu_si512(key[j] + 32 * c));
      dots[j] = (F32x16)a;
    }
    Store16(out + g * stride, LaneSums(dots) * Load16(scale), count);
  }
}

// acc[g] += sum over j < count of p[g * stride + j] * scale[j] * value[j] for G rows of acc [G, D], D = 32 * kPairs,
// each acc row in the order vdpbf16ps leaves it: of each 32 dims d0 .. d0 + 31, lanes 0-15 hold the dims
// d0 + 8k + i and lanes 16-31 the dims d0 + 8k + 4 + i (lane 4k + i within each, k < 4, i < 4; InDimOrder restores
// it). Rows j and j + 1 are interleaved element by element, so that each lane's pair is one dim of both rows, and
// meet the pair of their weights.
template <int kPairs>
void AccumulateBlockBf16(const float* p, int64_t stride, const uint16_t* const (&value)[16], const float (&scale)[16],
                         int count, int64_t G, int64_t D, float* acc) {
  for (int64_t g = 0; g < G; ++g) {
    __m512 lo[kPairs], hi[kPairs];
    float* ag = acc + g * D;
    for (int c = 0; c < kPairs; ++c) lo[c] = _mm512_loadu_ps(ag + 32 * c), hi[c] = _mm512_loadu_ps(ag + 32 * c + 16);
    for (int j = 0; j < count; j += 2) {
      const bool pair = j + 1 < count;
      const uint32_t weights = ToBf16(p[g * stride + j] * scale[j]) |
                               (pair ? static_cast<uint32_t>(ToBf16(p[g * stride + j + 1] * scale[j + 1])) << 16 : 0u);
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(weights));
      const uint16_t* second = value[pair ? j + 1 : j];  // a weight of 0 without a pair
      for (int c = 0; c < kPairs; ++c) {
        const __m512i a = _mm512_loadu_si512(value[j] + 32 * c), b = _mm512_loadu_si512(second + 32 * c);
        lo[c] = _mm512_dpbf16_ps(lo[c], (__m512bh)_mm512_unpacklo_epi16(a, b), w);
        hi[c] = _mm512_dpbf16_ps(hi[c], (__m512bh)_mm512_unpackhi_epi16(a, b), w);
      }
    }
    for (int c = 0; c < kPairs; ++c) _mm512_storeu_ps(ag + 32 * c, lo[c]), _mm512_storeu_ps(ag + 32 * c + 16, hi[c]);
  }
}

// Adds an accumulator row of AccumulateBlockBf16's order [D] to one in dim order.
inline void AddInDimOrder(const float* permuted, int64_t D, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    for (int k = 0; k < 4; ++k) {
      for (int i = 0; i < 4; ++i) {
        acc[d0 + 8 * k + i] += permuted[d0 + 4 * k + i];
        acc[d0 + 8 * k + 4 + i] += permuted[d0 + 16 + 4 * k + i];
      }
    }
  }
}
#else
constexpr bool kBf16Dots = false;
// Declared only: called from branches that kBf16Dots discards.
uint16_t ToBf16(float f);
template <int kPairs>
void ScoreBlockBf16(const uint16_t* q, int64_t G, int64_t D, const uint16_t* const (&key)[16],
                    const float (&scale)[16], int count, float* out, int64_t stride);
template <int kPairs>
void AccumulateBlockBf16(const float* p, int64_t stride, const uint16_t* const (&value)[16], const float (&scale)[16],
                         int count, int64_t G, int64_t D, float* acc);
void AddInDimOrder(const float* permuted, int64_t D, float* acc);
#endif

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_KERNELS_BF16_DOTS_H_
