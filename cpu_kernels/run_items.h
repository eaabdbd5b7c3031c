// Work items shared by the calling thread and XLA's intra-op thread pool (the CPU kernels' one way to go parallel).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jvllm {

// Runs work.Run(item) for every item in [0, work.num_items()) on the caller and up to `max_helpers` of the pool's
// threads, which take items from one counter; returns when all are done.
template <typename Work>
void RunItems(xla::ffi::ThreadPool& pool, const Work& work, int64_t max_helpers = INT64_MAX) {
  const int64_t total = work.num_items();
  if (total == 0) return;
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto drain = [shared, &work, total]() {
    int64_t finished = 0;
    for (int64_t item; (item = shared->next.fetch_add(1)) < total;) {
      work.Run(item);
      ++finished;
    }
    if (finished) shared->done.fetch_add(finished);
  };
  // A helper that starts after the work is gone touches only `shared` (kept alive by its copy).
  const int64_t helpers = std::min<int64_t>(std::min<int64_t>(pool.num_threads(), max_helpers), total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(drain)(drain));
  drain();
  while (shared->done.load() < total) std::this_thread::yield();
}

}  // namespace jvllm
