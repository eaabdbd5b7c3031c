// Cache lines asked for ahead of their use, in a form the compiler keeps.
#pragma once

#include <cstdint>

namespace jvllm {

// Asks the memory system for the cache line holding p. Inline assembly on x86, which the compiler keeps: GCC removes
// __builtin_prefetch calls from some of the paged attention's loops (those over the bf16 pages).
inline void PrefetchLine(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

// PrefetchLine into L2 only: for lines asked for further ahead than L1 holds (Zen 4's L1 is 32 KB), which would
// otherwise evict each other, and the work's own data, before their use.
inline void PrefetchLineToL2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Contiguous cache lines asked for a few at a time while products run (the weights they read next): `count`
// lines from `first`, per_step of them a call.
struct LinesAhead {
  const char* first = nullptr;
  int64_t count = 0, next = 0, per_step = 0;

  void Ask() {
    for (int64_t i = 0; i < per_step && next < count; ++i, ++next) PrefetchLine(first + next * 64);
  }
};

}  // namespace jvllm
