// The attention of a few-token step (decoding) on CPU, its cached keys read from the paged KV cache in place:
// jaxserve.model.attention.ragged_attention's path for steps of at most `small_step` tokens.
//
// In jnp, XLA:CPU gathers every block of pages a token reads into a new array before its dots, and a layer's
// attention is some twenty small ops, each a pass of XLA's runtime (BENCHMARKS.md, issue 28). Here each token reads
// its pages where they lie, every KV head of a page at once, then the step's own keys of its row up to its
// position: all its scores, one softmax per query head, the weighted sum of the values. A padding token
// (position < 0) gets zeros.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16_dots.h"
#include "exp_non_positive.h"
#include "lanes16.h"
#include "parallel.h"
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

using jaxserve::ExpNonPositive;
using jaxserve::F32x16;
using jaxserve::Load16;
using jaxserve::LaneSums;
using jaxserve::Store16;

struct Pages {
  const void* data;  // [num_pages, kv_heads, page_size, stored_head_dim]
  const float* scale;  // int8 pages: [num_pages, kv_heads, page_size]; else null
};

struct Step {
  int64_t tokens, kv_heads, group, head_dim, stored_head_dim, page_size, pages_per_token, sliding_window;
  bool bf16_dots;  // may round q and the softmax weights to bf16 for bf16 pages' products (bf16_dots.h)
  const float* q;  // [T, kv_heads, G, D], scaled
  const float* k;  // [T, kv_heads, D]: the step's own keys
  const float* v;
  const int32_t* token_row;  // [T]
  const int32_t* positions;  // [T]
  const int32_t* cached_lens;  // [T]: the cached keys each token sees, 0 .. len - 1
  const int32_t* page_ids;  // [T, P]: each token's row's pages
  Pages k_pages, v_pages;
};

// Blocks of up to 16 keys against a group's G queries. kChunks = head_dim / 16 where the head_dim is one of the
// common multiples of 16 (a loop the compiler unrolls, its sums in registers); 0: any head_dim, a slower loop.

// out[g * stride + j] = scale[j] * (q[g] . key[j]) for each of G queries q [G, D] and count <= 16 keys.
template <int kChunks, typename K>
void ScoreBlock(const float* q, int64_t G, int64_t D, const K* const (&key)[16], const float (&scale)[16], int count,
                float* out, int64_t stride) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    F32x16 dots[16] = {};  // key j's products, still in 16 lanes
    if constexpr (kChunks > 0) {
      F32x16 qc[kChunks];
      for (int c = 0; c < kChunks; ++c) qc[c] = Load16(qg + 16 * c);
      for (int j = 0; j < count; ++j) {
        F32x16 a[2] = {};  // two sums, so that each addition waits on the one before the last
        for (int c = 0; c < kChunks; ++c) a[c % 2] += qc[c] * Load16(key[j] + 16 * c);
        dots[j] = a[0] + a[1];
      }
    } else {
      for (int j = 0; j < count; ++j) {
        for (int64_t d = 0; d < D; d += 16) {
          const int w = static_cast<int>(std::min<int64_t>(16, D - d));
          dots[j] += Load16(qg + d, w) * Load16(key[j] + d, w);
        }
      }
    }
    Store16(out + g * stride, LaneSums(dots) * Load16(scale), count);
  }
}

// acc[g] += sum over j < count of p[g * stride + j] * scale[j] * value[j], for each of G rows of acc [G, D].
template <int kChunks, typename K>
void AccumulateBlock(const float* p, int64_t stride, const K* const (&value)[16], const float (&scale)[16], int count,
                     int64_t G, int64_t D, float* acc) {
  for (int64_t g = 0; g < G; ++g) {
    float weight[16];
    for (int j = 0; j < count; ++j) weight[j] = p[g * stride + j] * scale[j];
    float* ag = acc + g * D;
    if constexpr (kChunks > 0) {
      F32x16 a[kChunks];
      for (int c = 0; c < kChunks; ++c) a[c] = Load16(ag + 16 * c);
      for (int j = 0; j < count; ++j) {
        for (int c = 0; c < kChunks; ++c) a[c] += weight[j] * Load16(value[j] + 16 * c);
      }
      for (int c = 0; c < kChunks; ++c) Store16(ag + 16 * c, a[c]);
    } else {
      for (int64_t d = 0; d < D; d += 16) {
        const int w = static_cast<int>(std::min<int64_t>(16, D - d));
        F32x16 a = Load16(ag + d, w);
        for (int j = 0; j < count; ++j) a += weight[j] * Load16(value[j] + d, w);
        Store16(ag + d, a, w);
      }
    }
  }
}

// Part `split` of `splits` of token t's attention, every KV head: its queries' scores against that part's keys
// (a share of the cached pages; the last part also the step's own keys), one softmax per query, the values'
// weighted sum. Writes m [H, G], l [H, G] and the unnormalized acc [H, G, D].
//
// The cache is read from memory (a step's weights pass through the caches between one layer's reads and the next).
// A page's tiles of every head lie together ([kv_heads, page_size, D] in a page) and are read in address order, so
// the pages of a row that lie in order (a fresh cache hands them out so) are one stream for the hardware's
// prefetcher; each page is also asked for two pages ahead. Keys and values go by blocks of 16: the dots of 16 keys
// summed together (LaneSums), each value row read once for all G queries. The default model after 512 tokens, one
// row, a layer's call in the step (traced, median; 2 vCPU AMD EPYC): 120 us as first written, 84 by (KV head,
// part) with a dot at a time, 44 now (a layer's 830 KB of K and V; 20 us when they are in the caches).
// kDots: bf16 pages' products by bf16_dots.h (head_dim 32 * kChunks / 2); the step's own keys stay float32.
template <typename K, int kChunks, bool kDots>
void AttendPart(const Step& s, int64_t t, int64_t split, int64_t splits, std::vector<float>& scores,
                std::vector<int32_t>& own, float* m_out, float* l_out, float* acc) {
  const int64_t H = s.kv_heads, G = s.group, D = s.head_dim, Ds = s.stored_head_dim, ps = s.page_size;
  std::fill(acc, acc + H * G * D, 0.0f);
  std::fill(m_out, m_out + H * G, kMasked);
  std::fill(l_out, l_out + H * G, 0.0f);
  const int64_t pos = s.positions[t];
  if (pos < 0) return;
  // A sliding window shows the keys after position - window (the rule of jaxserve.model.attention).
  const int64_t first = s.sliding_window > 0 ? std::max<int64_t>(0, pos - s.sliding_window + 1) : 0;
  const int64_t cached_end = std::max<int64_t>(first, s.cached_lens[t]);
  // A window past every cached key reads no page (not even the one `first` falls in: the table may end before it).
  const int64_t first_page = first / ps, pages = first < cached_end ? (cached_end + ps - 1) / ps - first_page : 0;
  const int64_t lo = std::max(first, (first_page + pages * split / splits) * ps);
  const int64_t hi = std::min(cached_end, (first_page + pages * (split + 1) / splits) * ps);
  own.clear();
  for (int64_t u = 0; u < s.tokens && split + 1 == splits; ++u) {
    if (s.token_row[u] == s.token_row[t] && s.positions[u] >= first && s.positions[u] <= pos) own.push_back(u);
  }
  const int64_t n = std::max<int64_t>(0, hi - lo) + static_cast<int64_t>(own.size());
  if (n == 0) return;
  scores.resize(H * G * n);  // [H, G, n]: cached keys lo .. hi - 1, then the own keys
  const int32_t* ids = s.page_ids + t * s.pages_per_token;
  const int64_t page_bytes = H * ps * Ds * static_cast<int64_t>(sizeof(K));
  auto prefetch = [&](const Pages& pages, int64_t page_index) {
    if (page_index * ps >= hi) return;
    const char* p = static_cast<const char*>(pages.data) + ids[page_index] * page_bytes;
    for (int64_t b = 0; b < page_bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
  };
  // Visits blocks of up to 16 keys (cached by pages, then the own ones) with their rows' addresses and scales, and
  // where their scores start: visit(h, i, rows, scale, count) for keys i .. i + count - 1 of head h.
  auto for_each_block = [&](const Pages& pages, const float* own_rows, auto visit) {
    const K* rows[16];
    float scale[16];
    for (int64_t page = lo / ps; page * ps < hi; ++page) {
      prefetch(pages, page + kPagesAhead);
      const int64_t k0 = std::max(lo, page * ps), k1 = std::min(hi, (page + 1) * ps);
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row0 = (ids[page] * H + h) * ps - page * ps;  // + key: its row of [.., Ds]
        for (int64_t key = k0; key < k1; key += 16) {
          const int count = static_cast<int>(std::min<int64_t>(16, k1 - key));
          for (int j = 0; j < count; ++j) {
            rows[j] = static_cast<const K*>(pages.data) + (row0 + key + j) * Ds;
            scale[j] = pages.scale ? pages.scale[row0 + key + j] : 1.0f;
          }
          std::fill(scale + count, scale + 16, 0.0f);
          visit(h, key - lo, rows, scale, count);
        }
      }
    }
    const float* own_k[16];
    for (int64_t h = 0; h < H; ++h) {
      for (size_t i = 0; i < own.size(); i += 16) {
        const int count = static_cast<int>(std::min<size_t>(16, own.size() - i));
        for (int j = 0; j < 16; ++j) {
          own_k[j] = own_rows + (own[i + std::min(j, count - 1)] * H + h) * D;
          scale[j] = j < count ? 1.0f : 0.0f;
        }
        visit(h, std::max<int64_t>(0, hi - lo) + i, own_k, scale, count);
      }
    }
  };
  for (int64_t i = lo / ps; i < lo / ps + kPagesAhead; ++i) prefetch(s.k_pages, i);
  const float* q = s.q + t * H * G * D;
  thread_local std::vector<uint16_t> q_bf16;  // kDots: [H, G, D]
  thread_local std::vector<float> acc_dots;  // kDots: [H, G, D], the cached keys' share in AccumulateBlockBf16's order
  if constexpr (kDots) {
    q_bf16.resize(H * G * D), acc_dots.assign(H * G * D, 0.0f);
    for (int64_t i = 0; i < H * G * D; ++i) q_bf16[i] = jaxserve::ToBf16(q[i]);
  }
  for_each_block(s.k_pages, s.k, [&](int64_t h, int64_t i, const auto& rows, const float(&scale)[16], int count) {
    if constexpr (kDots && std::is_same_v<std::decay_t<decltype(rows[0])>, const K*>) {  // a cached block
      jaxserve::ScoreBlockBf16<kChunks / 2>(q_bf16.data() + h * G * D, G, D, rows, scale, count,
                                            scores.data() + h * G * n + i, n);
    } else {
      ScoreBlock<kChunks>(q + h * G * D, G, D, rows, scale, count, scores.data() + h * G * n + i, n);
    }
  });
  for (int64_t i = lo / ps; i < lo / ps + kPagesAhead; ++i) prefetch(s.v_pages, i);
  for (int64_t hg = 0; hg < H * G; ++hg) {
    float* sg = scores.data() + hg * n;
    float m = kMasked;  // a vector loop: std::max's order of comparisons would chain one scalar max per score
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; ++i) m = sg[i] > m ? sg[i] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = ExpNonPositive(sg[i] - m);
      sum += sg[i];
    }
    m_out[hg] = m, l_out[hg] = sum;
  }
  for_each_block(s.v_pages, s.v, [&](int64_t h, int64_t i, const auto& rows, const float(&scale)[16], int count) {
    if constexpr (kDots && std::is_same_v<std::decay_t<decltype(rows[0])>, const K*>) {  // a cached block
      jaxserve::AccumulateBlockBf16<kChunks / 2>(scores.data() + h * G * n + i, n, rows, scale, count, G, D,
                                                 acc_dots.data() + h * G * D);
    } else {
      AccumulateBlock<kChunks>(scores.data() + h * G * n + i, n, rows, scale, count, G, D, acc + h * G * D);
    }
  });
  if constexpr (kDots) {
    for (int64_t hg = 0; hg < H * G; ++hg) jaxserve::AddInDimOrder(acc_dots.data() + hg * D, D, acc + hg * D);
  }
}

// Why the operands cannot be attended over (naming the operand), or success. Each shape is checked against q's and
// the pages': a kernel reads by the sizes it is told, so one operand smaller than they say is a read past its end.
ffi::Error CheckOperands(F32x4& q, F32x3& k, F32x3& v, S32x1& token_row, S32x1& positions, S32x1& cached_lens,
                         S32x2& page_ids, ffi::AnyBuffer& k_pages, ffi::AnyBuffer& v_pages, F32x1& k_scale,
                         F32x1& v_scale, F32x4Result& out) {
  auto bad = [](const char* operand, const std::string& want, ffi::Span<const int64_t> got) {
    std::string shape = "[";
    for (size_t i = 0; i < got.size(); ++i) shape += (i ? ", " : "") + std::to_string(got[i]);
    return ffi::Error::InvalidArgument(std::string("jaxserve paged attention: ") + operand + " must be " + want +
                                       ", got " + shape + "]");
  };
  auto is = [](ffi::Span<const int64_t> got, std::initializer_list<int64_t> want) {
    return std::equal(got.begin(), got.end(), want.begin(), want.end());
  };
  auto qd = q.dimensions(), pd = k_pages.dimensions();
  const int64_t T = qd[0], H = qd[1], G = qd[2], D = qd[3];
  const std::string thd = "[T, kv_heads, head_dim] = [" + std::to_string(T) + ", " + std::to_string(H) + ", " +
                          std::to_string(D) + "]";
  if (G < 1 || G > kMaxGroup) return bad("q", "[T, kv_heads, G (1 to 64), head_dim]", qd);
  if (!is(k.dimensions(), {T, H, D})) return bad("k", thd, k.dimensions());
  if (!is(v.dimensions(), {T, H, D})) return bad("v", thd, v.dimensions());
  if (!is(token_row.dimensions(), {T})) return bad("token_row", "[T]", token_row.dimensions());
  if (!is(positions.dimensions(), {T})) return bad("positions", "[T]", positions.dimensions());
  if (!is(cached_lens.dimensions(), {T})) return bad("cached_lens", "[T]", cached_lens.dimensions());
  if (page_ids.dimensions()[0] != T) return bad("page_ids", "[T, pages]", page_ids.dimensions());
  if (pd.size() != 4 || pd[1] != H || pd[2] < 1 || pd[3] < D) {
    return bad("k_pages", "[num_pages, kv_heads, page_size >= 1, >= head_dim]", pd);
  }
  if (!is(v_pages.dimensions(), {pd[0], pd[1], pd[2], pd[3]}) || v_pages.element_type() != k_pages.element_type()) {
    return bad("v_pages", "k_pages' shape and dtype", v_pages.dimensions());
  }
  switch (k_pages.element_type()) {
    case ffi::DataType::F32:
    case ffi::DataType::BF16:
    case ffi::DataType::U16:  // bf16 pages stored as their bits (jaxserve.cache.kv_cache)
      break;
    case ffi::DataType::S8: {  // a scale per page, head and slot
      const int64_t n = pd[0] * H * pd[2];
      const std::string scales = "a float32 scale per page, head and slot (" + std::to_string(n) + ")";
      if (static_cast<int64_t>(k_scale.element_count()) != n) return bad("k_scale", scales, k_scale.dimensions());
      if (static_cast<int64_t>(v_scale.element_count()) != n) return bad("v_scale", scales, v_scale.dimensions());
      break;
    }
    default:
      return ffi::Error::InvalidArgument("jaxserve paged attention: pages must be float32, bfloat16 or int8");
  }
  if (!is(out->dimensions(), {T, H, G, D})) return bad("out", "q's shape", out->dimensions());
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::ThreadPool pool, F32x4 q, F32x3 k, F32x3 v, S32x1 token_row, S32x1 positions,
                          S32x1 cached_lens, S32x2 page_ids, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                          F32x1 k_scale, F32x1 v_scale, int64_t sliding_window, bool bf16_dots, F32x4Result out) {
  if (auto error = CheckOperands(q, k, v, token_row, positions, cached_lens, page_ids, k_pages, v_pages, k_scale,
                                 v_scale, out);
      error.failure()) {
    return error;
  }
  auto qd = q.dimensions(), pd = k_pages.dimensions();
  const int64_t T = qd[0], P = page_ids.dimensions()[1];
  if (T == 0) return ffi::Error::Success();
  Step s{T, qd[1], qd[2], qd[3], pd[3], pd[2], P, sliding_window, bf16_dots, q.typed_data(), k.typed_data(),
         v.typed_data(), token_row.typed_data(), positions.typed_data(), cached_lens.typed_data(),
         page_ids.typed_data(), {k_pages.untyped_data(), nullptr}, {v_pages.untyped_data(), nullptr}};
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
  // Each token in parts of its cached pages, enough parts for a few per thread (a decode step may have one token),
  // each part a chunk of its own; the parts are merged in order after, so the result does not depend on which
  // thread ran which.
  const int64_t H = s.kv_heads, G = s.group, D = s.head_dim;
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(kMaxSplits, 4 * pool.num_threads() / T));
  thread_local std::vector<float> part_m, part_l, part_acc;  // [T, splits, H, G (, D)]
  part_m.resize(T * splits * H * G), part_l.resize(T * splits * H * G), part_acc.resize(T * splits * H * G * D);
  float *pm = part_m.data(), *pl = part_l.data(), *pacc = part_acc.data();
  auto attend = [&](auto key_type, auto chunks) {
    using K = decltype(key_type);
    auto each = [&](auto dots) {
      jaxserve::ParallelChunks(pool, T * splits, kMaxHelpers, [&](int64_t item, int) {
        thread_local std::vector<float> scores;
        thread_local std::vector<int32_t> own;
        AttendPart<K, decltype(chunks)::value, decltype(dots)::value>(
            s, item / splits, item % splits, splits, scores, own, pm + item * H * G, pl + item * H * G,
            pacc + item * H * G * D);
      });
    };
    if constexpr (std::is_same_v<K, uint16_t> && jaxserve::kBf16Dots && decltype(chunks)::value > 0) {
      if (s.bf16_dots) return each(std::true_type{});
    }
    each(std::false_type{});
  };
  auto run = [&](auto key_type) {
    switch (D) {  // the head_dims with loops of their own (kChunks)
      case 64: return attend(key_type, std::integral_constant<int, 4>{});
      case 128: return attend(key_type, std::integral_constant<int, 8>{});
      case 256: return attend(key_type, std::integral_constant<int, 16>{});
      default: return attend(key_type, std::integral_constant<int, 0>{});
    }
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
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t hg = 0; hg < H * G; ++hg) {
      auto at = [&](int64_t p) { return (t * splits + p) * H * G + hg; };
      float m = kMasked, l = 0.0f;
      for (int64_t p = 0; p < splits; ++p) m = std::max(m, part_m[at(p)]);
      float* og = o + (t * H * G + hg) * D;
      std::fill(og, og + D, 0.0f);
      for (int64_t p = 0; p < splits; ++p) {
        const float c = part_l[at(p)] > 0.0f ? std::exp(part_m[at(p)] - m) : 0.0f;
        l += part_l[at(p)] * c;
        for (int64_t d = 0; d < D; ++d) og[d] += part_acc[at(p) * D + d] * c;
      }
      for (int64_t d = 0; d < D && l > 0.0f; ++d) og[d] /= l;
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
                                  .Attr<bool>("bf16_dots")  // bf16 pages' products may round q and weights to bf16
                                  .Ret<F32x4>());  // out [T, kv_heads, G, D]
