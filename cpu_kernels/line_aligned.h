// Vectors whose data starts on a 64-byte cache line. glibc's malloc puts large blocks 16 bytes past a page start, so
// every 64-byte row of a plain std::vector's tiles would straddle two lines: AMX's tile loads (16 rows of 64 bytes)
// would then touch twice the lines, which costs the products ~40% of their speed (docs/design/cpu_amx.md).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace jvllm {

template <typename T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kLine{64};

  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}

  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kLine)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kLine); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};

template <typename T>
using LineAlignedVector = std::vector<T, LineAllocator<T>>;

// Makes a reused buffer (a thread's, kept between calls) hold at least n elements. Never shrinks it: calls of
// different shapes would otherwise zero-fill the regrown part every time (resize value-initializes), a pass over up
// to a megabyte that the call then overwrites anyway.
template <typename Vector>
inline void GrowTo(Vector& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

}  // namespace jvllm
