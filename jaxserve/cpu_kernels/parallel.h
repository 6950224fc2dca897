// Work shared out between the calling thread and helpers scheduled on XLA's intra-op thread pool.
//
// Chunks are claimed from one counter. A helper joins the call (takes a participant number) only while the caller
// still has chunks to claim: one that starts after the caller has claimed the last chunk finds the call closed and
// returns without touching it, so a call never waits on a thread that is busy elsewhere, and the caller waits only
// for the helpers that joined to finish their last chunk.

#ifndef JAXSERVE_CPU_KERNELS_PARALLEL_H_
#define JAXSERVE_CPU_KERNELS_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// One turn of a spin wait: tells the core it spins (x86's pause, Arm's yield), so the other hyperthread of the core
// runs at full speed and the loop does not flood the memory system with loads.
inline void SpinPause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#else
  std::this_thread::yield();
#endif
}

struct SharedChunks {
  int64_t num_chunks;
  std::function<void(int64_t chunk, int participant)> run;
  std::atomic<int64_t> next_chunk{0};
  std::atomic<int> joined{0};  // helpers that joined; -1 once the caller has closed the call
  std::atomic<int> finished{0};

  void RunChunks(int participant) {
    for (int64_t c; (c = next_chunk.fetch_add(1, std::memory_order_relaxed)) < num_chunks;) run(c, participant);
  }
};

// Runs run(chunk, participant) for every chunk in [0, num_chunks), on the calling thread (participant 0) and on at
// most max_helpers helpers (participants 1, 2, ...: each its own thread while it runs). Returns how many helpers
// joined: participants 0 .. that number ran chunks, and all of them have finished.
inline int ParallelChunks(xla::ffi::ThreadPool& pool, int64_t num_chunks, int max_helpers,
                          std::function<void(int64_t, int)> run) {
  auto shared = std::make_shared<SharedChunks>();
  shared->num_chunks = num_chunks;
  shared->run = std::move(run);  // may refer to the caller's stack: only helpers that joined call it
  const int64_t helpers = std::min<int64_t>({pool.num_threads() - 1, num_chunks - 1, max_helpers});
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([shared] {
      int joined = shared->joined.load(std::memory_order_acquire);
      do {
        if (joined < 0) return;
      } while (!shared->joined.compare_exchange_weak(joined, joined + 1, std::memory_order_acq_rel));
      shared->RunChunks(joined + 1);
      shared->finished.fetch_add(1, std::memory_order_release);
    });
  }
  shared->RunChunks(0);
  const int joined = std::max(0, shared->joined.exchange(-1, std::memory_order_acq_rel));
  while (shared->finished.load(std::memory_order_acquire) < joined) {
    SpinPause();  // each holds its last chunk: microseconds
  }
  return joined;
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_KERNELS_PARALLEL_H_
