// Few-row products y = x @ W on CPU, for decode steps: x [rows, in] float32, W [in, out] float32, bfloat16 or int8
// (with a float32 scale per output column), y [rows, out] float32.
//
// A decode step with few rows reads every weight once and does little arithmetic on it, so its speed is the rate
// the weights stream from memory. XLA:CPU's one-row dot reads a 576-wide float32 kernel at about two thirds of the
// rate its large dots reach, and its bf16 and int8 one-row dots are compute loops (BENCHMARKS.md, issue 28). Here
// each row of W is read exactly once, in address order within each of one or two streams (four rows at a time, so
// each pass over the accumulators in L1 takes four or eight rows' products), widened to float32 in registers: the
// loop is plain C++ that the compiler vectorizes for the CPU it is built on (jaxserve/cpu_kernels/build.py).
//
// The input rows are shared out in chunks between threads (parallel.h).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "parallel.h"
#include "widen.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kColumnBlock = 512;  // 4 weight rows x 2 KB of float32 stay in L1 across the rows of x
constexpr int64_t kMaxHelpers = 63;

using jaxserve::Widen;

// acc[m, :] += x[m, k] * w[k, :] for k in [k0, k1), every m < M: each weight is widened once, for all M rows.
// One stream: rows k, k + 1, ... in order.
template <int M, typename W>
void AccumulateRowsInOrder(const float* x, int64_t in, const W* w, int64_t out, int64_t k0, int64_t k1,
                           float* __restrict acc) {
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const W* __restrict w0 = w + k * out;
    const W* __restrict w1 = w0 + out;
    const W* __restrict w2 = w1 + out;
    const W* __restrict w3 = w2 + out;
    float a[M][4];
    for (int m = 0; m < M; ++m) {
      for (int i = 0; i < 4; ++i) a[m][i] = x[m * in + k + i];
    }
    for (int64_t j0 = 0; j0 < out; j0 += kColumnBlock) {
      const int64_t j1 = std::min(out, j0 + kColumnBlock);
      if constexpr (sizeof(W) < 4) {
        // The next four rows' block into L1 ahead of use: bf16 and int8 rows carry fewer bytes per instruction,
        // and without it their reads stall (int8, one row through the default model's weights, 2 vCPU AMD EPYC:
        // 26.5 -> 31 GB/s; float32 reads no faster with it).
        if (k + 8 <= k1) {
          const W* next = w3 + out;
          for (int64_t j = j0; j < j1; j += 64 / sizeof(W)) {
            for (int r = 0; r < 4; ++r) __builtin_prefetch(next + r * out + j, 0, 3);
          }
        }
      }
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) {
        const float v0 = Widen(w0[j]), v1 = Widen(w1[j]), v2 = Widen(w2[j]), v3 = Widen(w3[j]);
        for (int m = 0; m < M; ++m) acc[m * out + j] += a[m][0] * v0 + a[m][1] * v1 + a[m][2] * v2 + a[m][3] * v3;
      }
    }
  }
  for (; k < k1; ++k) {
    const W* __restrict wk = w + k * out;
#pragma omp simd
    for (int64_t j = 0; j < out; ++j) {
      const float v = Widen(wk[j]);
      for (int m = 0; m < M; ++m) acc[m * out + j] += x[m * in + k] * v;
    }
  }
}

// The same sum from two streams: the first and second halves of [k0, k1), four rows of each a pass. The rows of a
// narrow W (the default model's are 576 floats) lie one after another, so read in order they are one stream for the
// hardware's prefetcher; two streams keep more reads in flight. One row through the default model's weights, each
// way (2 vCPU AMD EPYC, interleaved medians of three runs): float32 +4-7% (and 4 rows +6%), bf16 +6% (2 rows +7%;
// 8 rows -4%, compute-bound), int8 -9% (its widening is compute: it keeps its prefetch, in order).
template <int M, typename W>
void AccumulateRowsInTwoStreams(const float* x, int64_t in, const W* w, int64_t out, int64_t k0, int64_t k1,
                                float* __restrict acc) {
  const int64_t half = (k1 - k0) / 8 * 4;
  for (int64_t i = 0; i < half; i += 4) {
    const int64_t ka = k0 + i, kb = k0 + half + i;
    const W* __restrict a = w + ka * out;  // rows ka .. ka + 3
    const W* __restrict b = w + kb * out;  // rows kb .. kb + 3
    float xa[M][4], xb[M][4];
    for (int m = 0; m < M; ++m) {
      for (int r = 0; r < 4; ++r) xa[m][r] = x[m * in + ka + r], xb[m][r] = x[m * in + kb + r];
    }
    for (int64_t j0 = 0; j0 < out; j0 += kColumnBlock) {
      const int64_t j1 = std::min(out, j0 + kColumnBlock);
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) {
        const float a0 = Widen(a[j]), a1 = Widen(a[out + j]), a2 = Widen(a[2 * out + j]), a3 = Widen(a[3 * out + j]);
        const float b0 = Widen(b[j]), b1 = Widen(b[out + j]), b2 = Widen(b[2 * out + j]), b3 = Widen(b[3 * out + j]);
        for (int m = 0; m < M; ++m) {
          acc[m * out + j] += (xa[m][0] * a0 + xa[m][1] * a1 + xa[m][2] * a2 + xa[m][3] * a3) +
                              (xb[m][0] * b0 + xb[m][1] * b1 + xb[m][2] * b2 + xb[m][3] * b3);
        }
      }
    }
  }
  AccumulateRowsInOrder<M>(x, in, w, out, k0 + 2 * half, k1, acc);
}

template <int M, typename W>
void AccumulateRows(const float* x, int64_t in, const W* w, int64_t out, int64_t k0, int64_t k1, float* acc) {
  if constexpr (sizeof(W) == 4 || (sizeof(W) == 2 && M <= 4)) {
    AccumulateRowsInTwoStreams<M>(x, in, w, out, k0, k1, acc);
  } else {
    AccumulateRowsInOrder<M>(x, in, w, out, k0, k1, acc);
  }
}

template <typename W>
void AccumulateRows(int64_t rows, const float* x, int64_t in, const W* w, int64_t out, int64_t k0, int64_t k1,
                    float* acc) {
  switch (rows) {
    case 1: return AccumulateRows<1>(x, in, w, out, k0, k1, acc);
    case 2: return AccumulateRows<2>(x, in, w, out, k0, k1, acc);
    case 3: return AccumulateRows<3>(x, in, w, out, k0, k1, acc);
    case 4: return AccumulateRows<4>(x, in, w, out, k0, k1, acc);
    case 5: return AccumulateRows<5>(x, in, w, out, k0, k1, acc);
    case 6: return AccumulateRows<6>(x, in, w, out, k0, k1, acc);
    case 7: return AccumulateRows<7>(x, in, w, out, k0, k1, acc);
    default: return AccumulateRows<8>(x, in, w, out, k0, k1, acc);
  }
}

// y = (x @ w) * scale (per output column; none: 1).
// Why x [rows, in], w [in, out], scale (int8: [out]; else null) and y [rows, out] do not go together (naming the
// operand), or success: the loops read and write by these sizes, so an operand smaller than they say is an access
// past its end.
ffi::Error CheckOperands(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, const ffi::Buffer<ffi::F32>* scale,
                         ffi::Span<const int64_t> yd) {
  if (xd.size() != 2 || xd[0] > kMaxRows) {
    return ffi::Error::InvalidArgument("jaxserve matmul: x must be [rows <= 8, in]");
  }
  if (wd.size() != 2 || wd[0] != xd[1]) {
    return ffi::Error::InvalidArgument("jaxserve matmul: w must be [in, out], in = " + std::to_string(xd[1]) +
                                       " (x's columns)");
  }
  if (scale != nullptr && (scale->dimensions().size() != 1 || scale->dimensions()[0] != wd[1])) {
    return ffi::Error::InvalidArgument("jaxserve matmul: scale must be [out] = [" + std::to_string(wd[1]) + "]");
  }
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("jaxserve matmul: the result must be [rows, out] = [" + std::to_string(xd[0]) +
                                       ", " + std::to_string(wd[1]) + "]");
  }
  return ffi::Error::Success();
}

template <typename W>
ffi::Error Matmul(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const void* w, ffi::Span<const int64_t> wd,
                  const ffi::Buffer<ffi::F32>* scale_buffer, ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  if (auto error = CheckOperands(xd, wd, scale_buffer, y->dimensions()); error.failure()) return error;
  const int64_t rows = xd[0], in = xd[1], out = wd[1];
  if (rows == 0) return ffi::Error::Success();  // AccumulateRows has a case for 1 to 8 rows
  const float* scale = scale_buffer == nullptr ? nullptr : scale_buffer->typed_data();
  float* y_data = y->typed_data();
  std::fill(y_data, y_data + rows * out, 0.0f);

  const float* x_data = x.typed_data();
  const W* w_data = static_cast<const W*>(w);
  // The input rows in a fixed number of chunks, each summed into its own partial product, and the partials added
  // in chunk order: the same result whichever thread ran which chunk (a sum per thread would change with the
  // threads' timing). A few chunks per thread, so a helper that starts late still finds work.
  const int64_t num_chunks =
      std::max<int64_t>(1, std::min<int64_t>(std::max<int64_t>(8, 2 * pool.num_threads()), (in + 3) / 4));
  const int64_t chunk = std::max<int64_t>(4, (in / num_chunks + 3) / 4 * 4);
  thread_local std::vector<float> partials;  // [num_chunks - 1, rows, out]: chunk 0 sums into y itself
  partials.resize(std::max<size_t>(partials.size(), (num_chunks - 1) * rows * out));
  float* partial = partials.data();
  jaxserve::ParallelChunks(pool, num_chunks, kMaxHelpers, [&](int64_t c, int) {
    float* acc = c == 0 ? y_data : partial + (c - 1) * rows * out;
    if (c > 0) std::fill(acc, acc + rows * out, 0.0f);
    const int64_t k0 = std::min(in, c * chunk), k1 = c + 1 == num_chunks ? in : std::min(in, (c + 1) * chunk);
    AccumulateRows(rows, x_data, in, w_data, out, k0, k1, acc);
  });
  for (int64_t c = 1; c < num_chunks; ++c) {
    const float* acc = partial + (c - 1) * rows * out;
    for (int64_t j = 0; j < rows * out; ++j) y_data[j] += acc[j];
  }
  if (scale != nullptr) {
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t j = 0; j < out; ++j) y_data[m * out + j] *= scale[j];
    }
  }
  return ffi::Error::Success();
}

ffi::Error FloatMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                       ffi::ResultBuffer<ffi::F32> y) {
  switch (w.element_type()) {
    case ffi::DataType::F32:
      return Matmul<float>(pool, x, w.untyped_data(), w.dimensions(), nullptr, y);
    case ffi::DataType::BF16:
      return Matmul<uint16_t>(pool, x, w.untyped_data(), w.dimensions(), nullptr, y);
    default:
      return ffi::Error::InvalidArgument("jaxserve matmul: weights must be float32 or bfloat16");
  }
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  return Matmul<int8_t>(pool, x, w.typed_data(), w.dimensions(), &scale, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFloatMatmul, FloatMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
