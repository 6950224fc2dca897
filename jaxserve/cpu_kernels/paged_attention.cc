// The attention of a few-token step (decoding) on CPU, its cached keys read from the paged KV cache in place:
// jaxserve.attention.ragged_attention's path for steps of at most `small_step` tokens.
//
// In jnp, XLA:CPU gathers every block of pages a token reads into a new array before its dots, and a layer's
// attention is some twenty small ops, each a pass of XLA's runtime (BENCHMARKS.md, issue 28). Here each (token,
// KV head) reads its pages' [page_size, head_dim] tiles where they lie, then the step's own keys of its row up to
// its position: all its scores, one softmax, the weighted sum of the values, for the G query heads of the group
// at once. A padding token (position < 0) gets zeros.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "widen.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using F32x1 = ffi::Buffer<ffi::F32>;
using F32x3 = ffi::Buffer<ffi::F32, 3>;
using F32x4 = ffi::Buffer<ffi::F32, 4>;
using S32x1 = ffi::Buffer<ffi::S32, 1>;
using S32x2 = ffi::Buffer<ffi::S32, 2>;
using F32x4Result = ffi::ResultBuffer<ffi::F32, 4>;

constexpr float kMasked = -1e30f;
constexpr int kMaxHelpers = 63;
constexpr int64_t kMaxGroup = 64;  // query heads per KV head
constexpr int64_t kPagesAhead = 2;
constexpr int64_t kMaxSplits = 8;

using jaxserve::Widen;

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

struct Pages {
  const void* data;  // [num_pages, kv_heads, page_size, stored_head_dim]
  const float* scale;  // int8 pages: [num_pages, kv_heads, page_size]; else null
};

struct Step {
  int64_t tokens, kv_heads, group, head_dim, stored_head_dim, page_size, pages_per_token, sliding_window;
  const float* q;  // [T, kv_heads, G, D], scaled
  const float* k;  // [T, kv_heads, D]: the step's own keys
  const float* v;
  const int32_t* token_row;  // [T]
  const int32_t* positions;  // [T]
  const int32_t* cached_lens;  // [T]: the cached keys each token sees, 0 .. len - 1
  const int32_t* page_ids;  // [T, P]: each token's row's pages
  Pages k_pages, v_pages;
};

// Part `split` of `splits` of one (token t, KV head h)'s attention: its G queries' scores against that part's keys
// (a share of the cached pages; the last part also the step's own keys), one softmax, the values' weighted sum.
// Writes the part's largest score m [G], sum of exp(score - m) l [G] and unnormalized acc [G, D].
template <typename K>
void AttendPart(const Step& s, int64_t t, int64_t h, int64_t split, int64_t splits, std::vector<float>& scores,
                std::vector<int32_t>& own, float* m_out, float* l_out, float* acc) {
  const int64_t G = s.group, D = s.head_dim, Ds = s.stored_head_dim, ps = s.page_size;
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(m_out, m_out + G, kMasked);
  std::fill(l_out, l_out + G, 0.0f);
  const int64_t pos = s.positions[t];
  if (pos < 0) return;
  // A sliding window shows the keys after position - window (the rule of jaxserve.attention).
  const int64_t first = s.sliding_window > 0 ? std::max<int64_t>(0, pos - s.sliding_window + 1) : 0;
  const int64_t cached_end = std::max<int64_t>(first, s.cached_lens[t]);
  const int64_t first_page = first / ps, pages = (cached_end + ps - 1) / ps - first_page;
  const int64_t lo = std::max(first, (first_page + pages * split / splits) * ps);
  const int64_t hi = std::min(cached_end, (first_page + pages * (split + 1) / splits) * ps);
  own.clear();
  for (int64_t u = 0; u < s.tokens && split + 1 == splits; ++u) {
    if (s.token_row[u] == s.token_row[t] && s.positions[u] >= first && s.positions[u] <= pos) own.push_back(u);
  }
  const int64_t n = std::max<int64_t>(0, hi - lo) + static_cast<int64_t>(own.size());
  if (n == 0) return;
  scores.resize(G * n);  // [G, n]: cached keys lo .. hi - 1, then the own keys
  const int32_t* ids = s.page_ids + t * s.pages_per_token;
  const float* q = s.q + (t * s.kv_heads + h) * G * D;
  auto score = [&](int64_t i, auto key_at, float scale) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * Widen(key_at[d]);
      scores[g * n + i] = dot * scale;
    }
  };
  // The cache is read from memory (a step's weights pass through the caches between one layer's reads and the
  // next), a [page_size, head_dim] tile a page: each page's tile is asked for a few pages ahead, the values' while
  // the keys are scored. The default model after 512 tokens, one row, a layer's call in the step (traced, median):
  // 120 us as first written, 95 with this and page-by-page loops, 78 split in parts.
  const int64_t tile_bytes = ps * Ds * static_cast<int64_t>(sizeof(K));
  auto prefetch = [&](const Pages& pages, int64_t page_index, int locality) {
    if (page_index * ps >= hi) return;
    const char* tile = static_cast<const char*>(pages.data) + (ids[page_index] * s.kv_heads + h) * tile_bytes;
    for (int64_t b = 0; b < tile_bytes; b += 64) __builtin_prefetch(tile + b, 0, locality);
  };
  for (int64_t i = lo / ps; i < lo / ps + kPagesAhead; ++i) prefetch(s.k_pages, i, 3);
  // Page by page: a page's keys are rows base .. base + page_size - 1 of [pages * heads * page_size, head_dim].
  auto for_each_key = [&](auto visit) {
    for (int64_t page = lo / ps; page * ps < hi; ++page) {
      const int64_t base = (ids[page] * s.kv_heads + h) * ps - page * ps;
      visit(page, std::max(lo, page * ps), std::min(hi, (page + 1) * ps), base);
    }
  };
  for_each_key([&](int64_t page, int64_t k0, int64_t k1, int64_t base) {
    prefetch(s.k_pages, page + kPagesAhead, 3);
    prefetch(s.v_pages, page, 2);
    for (int64_t key = k0; key < k1; ++key) {
      score(key - lo, static_cast<const K*>(s.k_pages.data) + (base + key) * Ds,
            s.k_pages.scale ? s.k_pages.scale[base + key] : 1.0f);
    }
  });
  const int64_t own_at = std::max<int64_t>(0, hi - lo);  // the own keys' scores follow the cached ones'
  for (size_t i = 0; i < own.size(); ++i) score(own_at + i, s.k + (own[i] * s.kv_heads + h) * D, 1.0f);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * n;
    float m = kMasked;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = ExpNonPositive(sg[i] - m);
      sum += sg[i];
    }
    m_out[g] = m, l_out[g] = sum;
  }
  auto accumulate = [&](int64_t i, auto value_at, float scale) {
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + i] * scale;
      float* o = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += p * Widen(value_at[d]);
    }
  };
  for_each_key([&](int64_t, int64_t k0, int64_t k1, int64_t base) {
    for (int64_t key = k0; key < k1; ++key) {
      accumulate(key - lo, static_cast<const K*>(s.v_pages.data) + (base + key) * Ds,
                 s.v_pages.scale ? s.v_pages.scale[base + key] : 1.0f);
    }
  });
  for (size_t i = 0; i < own.size(); ++i) accumulate(own_at + i, s.v + (own[i] * s.kv_heads + h) * D, 1.0f);
}

ffi::Error PagedAttention(ffi::ThreadPool pool, F32x4 q, F32x3 k, F32x3 v, S32x1 token_row, S32x1 positions,
                          S32x1 cached_lens, S32x2 page_ids, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                          F32x1 k_scale, F32x1 v_scale, int64_t sliding_window, F32x4Result out) {
  auto qd = q.dimensions(), pd = k_pages.dimensions(), vd = v_pages.dimensions();
  if (pd.size() != 4 || vd.size() != 4 || !std::equal(pd.begin(), pd.end(), vd.begin()) ||
      k_pages.element_type() != v_pages.element_type()) {
    return ffi::Error::InvalidArgument("jaxserve paged attention: K and V pages must be alike, 4-D");
  }
  const int64_t T = qd[0], P = page_ids.dimensions()[1];
  Step s{T, qd[1], qd[2], qd[3], pd[3], pd[2], P, sliding_window, q.typed_data(), k.typed_data(), v.typed_data(),
         token_row.typed_data(), positions.typed_data(), cached_lens.typed_data(), page_ids.typed_data(),
         {k_pages.untyped_data(), nullptr}, {v_pages.untyped_data(), nullptr}};
  auto kd = k.dimensions();
  if (pd[1] != s.kv_heads || s.head_dim > s.stored_head_dim || s.group > kMaxGroup || kd[0] != T ||
      kd[1] != s.kv_heads || kd[2] != s.head_dim || page_ids.dimensions()[0] != T ||
      token_row.dimensions()[0] != T || positions.dimensions()[0] != T || cached_lens.dimensions()[0] != T) {
    return ffi::Error::InvalidArgument(
        "jaxserve paged attention: q [T, kv_heads, G <= 64, D], k and v [T, kv_heads, D], token_row, positions "
        "and cached_lens [T], page_ids [T, P], pages [num_pages, kv_heads, page_size, >= D]");
  }
  for (int64_t t = 0; t < T; ++t) {  // a bad table would read outside the cache
    if (s.positions[t] < 0) continue;
    if (s.cached_lens[t] > P * s.page_size) {
      return ffi::Error::InvalidArgument("jaxserve paged attention: a token's cached length exceeds its pages");
    }
    for (int64_t i = 0; i < (s.cached_lens[t] + s.page_size - 1) / s.page_size; ++i) {
      if (s.page_ids[t * P + i] < 0 || s.page_ids[t * P + i] >= pd[0]) {
        return ffi::Error::InvalidArgument("jaxserve paged attention: a page id outside the cache");
      }
    }
  }
  if (k_pages.element_type() == ffi::DataType::S8) {
    s.k_pages.scale = k_scale.typed_data(), s.v_pages.scale = v_scale.typed_data();
  }
  // Each (token, KV head) in parts of its cached pages, enough parts for a few per thread (one decode row has only
  // kv_heads pairs), each part a chunk of its own; the parts are merged in order after, so the result does not
  // depend on which thread ran which.
  const int64_t pairs = T * s.kv_heads, G = s.group, D = s.head_dim;
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(kMaxSplits, 4 * pool.num_threads() / pairs));
  thread_local std::vector<float> part_m, part_l, part_acc;  // [pairs, splits, G (, D)]
  part_m.resize(pairs * splits * G), part_l.resize(pairs * splits * G), part_acc.resize(pairs * splits * G * D);
  float *pm = part_m.data(), *pl = part_l.data(), *pacc = part_acc.data();  // the caller's: helpers write them too
  auto run = [&](auto tag) {
    using K = decltype(tag);
    jaxserve::ParallelChunks(pool, pairs * splits, kMaxHelpers, [&](int64_t item, int) {
      thread_local std::vector<float> scores;
      thread_local std::vector<int32_t> own;
      const int64_t pair = item / splits;
      AttendPart<K>(s, pair / s.kv_heads, pair % s.kv_heads, item % splits, splits, scores, own,
                    pm + item * G, pl + item * G, pacc + item * G * D);
    });
  };
  switch (k_pages.element_type()) {
    case ffi::DataType::F32:
      run(float{});
      break;
    case ffi::DataType::BF16:
    case ffi::DataType::U16:  // bf16 pages stored as their bits (jaxserve.cache.kv_cache)
      run(uint16_t{});
      break;
    case ffi::DataType::S8:
      run(int8_t{});
      break;
    default:
      return ffi::Error::InvalidArgument("jaxserve paged attention: pages must be float32, bfloat16 or int8");
  }
  float* o = out->typed_data();  // [T, kv_heads, G, D]
  for (int64_t pair = 0; pair < pairs; ++pair) {
    for (int64_t g = 0; g < G; ++g) {
      float m = kMasked, l = 0.0f;
      for (int64_t p = 0; p < splits; ++p) m = std::max(m, part_m[(pair * splits + p) * G + g]);
      float* og = o + (pair * G + g) * D;
      std::fill(og, og + D, 0.0f);
      for (int64_t p = 0; p < splits; ++p) {
        const int64_t i = (pair * splits + p) * G + g;
        const float c = part_l[i] > 0.0f ? std::exp(part_m[i] - m) : 0.0f;
        l += part_l[i] * c;
        for (int64_t d = 0; d < D; ++d) og[d] += part_acc[i * D + d] * c;
      }
      for (int64_t d = 0; d < D && l > 0.0f; ++d) og[d] /= l;  // l = 0: a padding token, zeros
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32x4>()  // q [T, kv_heads, G, D], scaled
                                  .Arg<F32x3>()  // k [T, kv_heads, D]: the step's own keys
                                  .Arg<F32x3>()  // v
                                  .Arg<S32x1>()  // token_row [T]
                                  .Arg<S32x1>()  // positions [T]
                                  .Arg<S32x1>()  // cached_lens [T]
                                  .Arg<S32x2>()  // page_ids [T, P]: each token's row's pages
                                  .Arg<ffi::AnyBuffer>()  // k_pages
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<F32x1>()  // k_scale (int8 pages; else empty)
                                  .Arg<F32x1>()  // v_scale
                                  .Attr<int64_t>("sliding_window")  // 0: none
                                  .Ret<F32x4>());  // out [T, kv_heads, G, D]
