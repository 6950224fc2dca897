// Sixteen float32 lanes as one value (GCC and Clang vector extensions: one AVX-512 register, two AVX2 or four NEON
// registers; the compiler picks for the CPU it builds for), loaded from float32, bfloat16 bits or int8 and widened
// in registers.

#ifndef JAXSERVE_CPU_KERNELS_LANES16_H_
#define JAXSERVE_CPU_KERNELS_LANES16_H_

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxserve {

typedef float F32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef int8_t I8x16 __attribute__((vector_size(16)));

// The first `count` (<= 16) elements at p, the rest zeros; count = 16 is one plain load.
template <typename V, typename T>
inline V LoadFirst(const T* p, int count) {
  V v{};
  if (count == 16) {
    std::memcpy(&v, p, sizeof v);  // a constant size: one load
  } else {
    std::memcpy(&v, p, count * sizeof(T));
  }
  return v;
}

// Narrow lanes widened to int32. GCC 12 lowers __builtin_convertvector between these widths in per-half pieces on
// AVX-512 (five instructions where vpmovzxwd is one) and in scalar conversions for int8, which made the widening,
// not the memory, the bound of the paged-attention kernel on bf16 and int8 pages: x86's own conversions are named
// where the target has them.
#if defined(__AVX512F__)
// (maskz: the plain forms start from _mm512_undefined_epi32, which GCC 12 warns of as uninitialized)
inline I32x16 WidenLanes(U16x16 v) { return (I32x16)_mm512_maskz_cvtepu16_epi32(0xffff, (__m256i)v); }
inline I32x16 WidenLanes(I8x16 v) { return (I32x16)_mm512_maskz_cvtepi8_epi32(0xffff, (__m128i)v); }
#elif defined(__AVX2__)
typedef int32_t I32x8 __attribute__((vector_size(32)));
inline I32x16 Join(__m256i lo, __m256i hi) {
  return __builtin_shufflevector((I32x8)lo, (I32x8)hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline I32x16 WidenLanes(U16x16 v) {
  const __m256i w = (__m256i)v;
  return Join(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(w)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(w, 1)));
}
inline I32x16 WidenLanes(I8x16 v) {
  const __m128i w = (__m128i)v;
  return Join(_mm256_cvtepi8_epi32(w), _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(w, w)));
}
#else
inline I32x16 WidenLanes(U16x16 v) { return __builtin_convertvector(v, I32x16); }
inline I32x16 WidenLanes(I8x16 v) { return __builtin_convertvector(v, I32x16); }
#endif

inline F32x16 Load16(const float* p, int count = 16) { return LoadFirst<F32x16>(p, count); }
inline F32x16 Load16(const int8_t* p, int count = 16) {
  return __builtin_convertvector(WidenLanes(LoadFirst<I8x16>(p, count)), F32x16);
}
inline F32x16 Load16(const uint16_t* p, int count = 16) {  // bfloat16 bits: the high half of a float32
  return (F32x16)(WidenLanes(LoadFirst<U16x16>(p, count)) << 16);
}

inline void Store16(float* p, F32x16 v, int count = 16) {
  if (count == 16) {
    std::memcpy(p, &v, sizeof v);
  } else {
    std::memcpy(p, &v, count * sizeof(float));
  }
}

// Lane j of the result is the sum of v[j]'s lanes: a 16 x 16 transpose folded into its additions (15 additions
// and 30 two-register shuffles for 16 sums, where summing each register's lanes one by one takes 16 x 15).
inline F32x16 LaneSums(const F32x16 (&v)[16]) {
  F32x16 w[8], u[4], x[2];
  for (int i = 0; i < 8; ++i) {  // w[i]: lanes 0-7 sum into v[i]'s, 8-15 into v[i + 8]'s
    w[i] = __builtin_shufflevector(v[i], v[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[i], v[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // u[i]: lanes 4k .. 4k + 3 into v[i + 4k]'s
    u[i] = __builtin_shufflevector(w[i], w[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(w[i], w[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // x[i]: lanes 2k, 2k + 1 into v[i + 2k]'s
    x[i] = __builtin_shufflevector(u[i], u[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(u[i], u[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  return __builtin_shufflevector(x[0], x[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(x[0], x[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_KERNELS_LANES16_H_
