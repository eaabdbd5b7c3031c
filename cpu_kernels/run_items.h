// Work items shared by the calling thread and the kernels' own helper threads (one per other core).
//
// A decode step makes hundreds of kernel calls of tens of microseconds each. Helpers that slept between calls took
// longer to wake than such a call lasts, so the helpers here spin for a while after each job (kSpinNanos) and only
// then sleep; within a step they stay awake and pick up the next call's items at once. A spinning helper yields
// its core each round, so the Python and XLA threads that dispatch the next call are not kept waiting for it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JVLLM_PAUSE() _mm_pause()
#else
#define JVLLM_PAUSE() std::this_thread::yield()
#endif

namespace jvllm {

class HelperPool {
 public:
  static constexpr int64_t kSpinNanos = 300000;  // a helper sleeps after this long without a job

  static HelperPool& Get() {
    static HelperPool* pool = new HelperPool();  // never destroyed: helpers may still spin at exit
    return *pool;
  }

  int64_t num_helpers() const { return static_cast<int64_t>(threads_.size()); }

  // Runs fn(ctx) on up to `helpers` helper threads while the caller runs it too; returns when all are done.
  void Run(void (*fn)(void*), void* ctx, int64_t helpers) {
    helpers = std::min<int64_t>(helpers, num_helpers());
    if (helpers <= 0) {
      fn(ctx);
      return;
    }
    std::lock_guard<std::mutex> one_job(run_mutex_);  // concurrent callers take turns
    fn_ = fn;
    ctx_ = ctx;
    busy_.store(helpers, std::memory_order_relaxed);
    {
      // under the sleepers' lock: a helper about to sleep either sees the slots or gets the notification
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wanted_.store(helpers, std::memory_order_release);  // a helper that takes a slot sees this job's fn_, ctx_
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    fn(ctx);
    // Slots no helper has claimed yet are withdrawn: the caller waits only for helpers already at work, never for
    // one the OS has not scheduled (where the cores also run the Python thread, that can take longer than a short
    // call lasts).
    const int64_t unclaimed = wanted_.exchange(0, std::memory_order_acq_rel);
    if (unclaimed > 0) busy_.fetch_sub(unclaimed, std::memory_order_acq_rel);
    while (busy_.load(std::memory_order_acquire) > 0) JVLLM_PAUSE();
  }

 private:
  HelperPool() {
    const int64_t cores = std::max<unsigned>(1, std::thread::hardware_concurrency());
    for (int64_t i = 0; i + 1 < cores; ++i) threads_.emplace_back([this] { Loop(); });
    for (auto& thread : threads_) thread.detach();
  }

  void Loop() {
    auto last_job = std::chrono::steady_clock::now();
    while (true) {
      // a job wants this helper while a slot is left (a job may want fewer helpers than there are)
      int64_t left = wanted_.load(std::memory_order_acquire);
      if (left > 0) {
        if (wanted_.compare_exchange_weak(left, left - 1, std::memory_order_acq_rel)) {
          fn_(ctx_);
          busy_.fetch_sub(1, std::memory_order_acq_rel);
          last_job = std::chrono::steady_clock::now();
        }
        continue;
      }
      if (std::chrono::steady_clock::now() - last_job < std::chrono::nanoseconds(kSpinNanos)) {
        std::this_thread::yield();
        continue;
      }
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleepers_.fetch_add(1, std::memory_order_acq_rel);
      wake_.wait(lock, [&] { return wanted_.load(std::memory_order_acquire) > 0; });
      sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      last_job = std::chrono::steady_clock::now();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex run_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<int64_t> wanted_{0}, busy_{0}, sleepers_{0};
  void (*fn_)(void*) = nullptr;
  void* ctx_ = nullptr;
};

// Units of work per item such that the threads' shares are as even as whole units allow: 1 to 4 items per thread,
// the most items among the most even splits (a thread that starts late still finds work). 18 units on 2 threads:
// 6 items of 3, where 4 items of 5 would leave one thread 10 units and the other 8.
inline int64_t BalancedUnits(int64_t units, int64_t threads) {
  int64_t best = units, best_share = INT64_MAX;
  for (int64_t per_thread = 1; per_thread <= 4; ++per_thread) {
    const int64_t size = (units + threads * per_thread - 1) / (threads * per_thread);
    const int64_t items = (units + size - 1) / size;
    const int64_t share = size * ((items + threads - 1) / threads);  // the busiest thread's units, at most
    if (share <= best_share) best = size, best_share = share;
  }
  return best;
}

// Whether Work has RunWithNext(item, next): it is told the item its thread runs next (-1: none), to prefetch for it.
template <typename Work, typename = void>
struct RunsWithNext : std::false_type {};
template <typename Work>
struct RunsWithNext<Work, std::void_t<decltype(std::declval<const Work&>().RunWithNext(int64_t{}, int64_t{}))>>
    : std::true_type {};

// Runs work.Run(item) for every item in [0, work.num_items()) on the caller and up to `max_helpers` helper threads,
// which take items from one counter; returns when all are done. A Work with RunWithNext(item, next) is called that
// way instead: each thread claims its next item before it runs the current one.
template <typename Work>
void RunItems(const Work& work, int64_t max_helpers = INT64_MAX) {
  const int64_t total = work.num_items();
  if (total == 0) return;
  struct Job {
    const Work* work;
    int64_t total;
    std::atomic<int64_t> next{0};
  } job{&work, total};
  auto drain = [](void* ctx) {
    Job* j = static_cast<Job*>(ctx);
    if constexpr (RunsWithNext<Work>::value) {
      for (int64_t item = j->next.fetch_add(1, std::memory_order_relaxed); item < j->total;) {
        const int64_t next = j->next.fetch_add(1, std::memory_order_relaxed);
        j->work->RunWithNext(item, next < j->total ? next : -1);
        item = next;
      }
    } else {
      for (int64_t item; (item = j->next.fetch_add(1, std::memory_order_relaxed)) < j->total;) j->work->Run(item);
    }
  };
  HelperPool::Get().Run(drain, &job, std::min<int64_t>(max_helpers, total - 1));
}

// Runs tiles.Run(n0, n1) over output columns [0, n) in items of whole `unit`s of columns (a tiled product's tiles or
// tile pairs), as evenly split over the caller and the helper threads as they allow.
template <typename Tiles>
void RunColumnItems(const Tiles& tiles, int64_t n, int64_t unit) {
  struct Items {
    const Tiles& tiles;
    int64_t n, columns_per_item;
    int64_t num_items() const { return (n + columns_per_item - 1) / columns_per_item; }
    void Run(int64_t item) const { tiles.Run(item * columns_per_item, std::min(n, (item + 1) * columns_per_item)); }
  };
  const int64_t threads = HelperPool::Get().num_helpers() + 1;
  RunItems(Items{tiles, n, BalancedUnits((n + unit - 1) / unit, threads) * unit});
}

// Runs a tiled product over the caller and the helper threads: by output columns (RunColumnItems), or, where
// tiles.SplitsRows(), by rows, one contiguous share of whole `row_unit`s per thread (each share makes its own tiles
// of every column, so it is made once: no more items than threads).
template <typename Tiles>
void RunTileItems(const Tiles& tiles, int64_t m, int64_t n, int64_t column_unit, int64_t row_unit) {
  if (!tiles.SplitsRows()) {
    RunColumnItems(tiles, n, column_unit);
    return;
  }
  struct Items {
    const Tiles& tiles;
    int64_t m, rows_per_item;
    int64_t num_items() const { return (m + rows_per_item - 1) / rows_per_item; }
    void Run(int64_t item) const { tiles.RunRows(item * rows_per_item, std::min(m, (item + 1) * rows_per_item)); }
  };
  const int64_t threads = HelperPool::Get().num_helpers() + 1, units = (m + row_unit - 1) / row_unit;
  RunItems(Items{tiles, m, (units + threads - 1) / threads * row_unit});
}

}  // namespace jvllm
