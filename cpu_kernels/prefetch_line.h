// One cache line asked for ahead of its use, in a form the compiler keeps.
#pragma once

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

}  // namespace jvllm
