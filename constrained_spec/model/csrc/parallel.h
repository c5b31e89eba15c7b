// parallel_for over [begin, end) on the number of threads the caller passed in (compiled.py
// passes torch.get_num_threads()): OpenMP's threads split as ATen's at::parallel_for splits them
// (aten/src/ATen/ParallelOpenMP.h: one chunk of ⌈n / threads⌉ per thread, no more threads than
// ⌈n / grain⌉, the caller alone where n ≤ grain or inside a parallel region), or, built without
// OpenMP (Apple's clang has none), the same chunks on a pool of std::threads, the caller taking
// the first. Every chunk computes what it would on any thread: no result depends on the split.

#pragma once

#include <algorithm>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#else
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#endif

namespace parallel {

inline thread_local int64_t threads = 1;  // set by Threads at each call into the library

inline int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }

#ifdef _OPENMP

inline bool in_region() { return omp_in_parallel(); }

// The calling thread's OpenMP team size for this call (torch keeps the same libgomp's per-thread
// setting at torch.get_num_threads(): set again only where they differ).
struct Threads {
  explicit Threads(int64_t count) {
    threads = std::max<int64_t>(1, count);
    if (omp_get_max_threads() != threads) omp_set_num_threads(static_cast<int>(threads));
  }
};

template <class F>
void run_chunks(int64_t begin, int64_t end, int64_t grain, const F& f) {
#pragma omp parallel
  {
    int64_t count = omp_get_num_threads();
    if (grain > 0) count = std::min(count, divup(end - begin, grain));
    const int64_t chunk = divup(end - begin, count), from = begin + omp_get_thread_num() * chunk;
    if (from < end) f(from, std::min(end, from + chunk));
  }
}

#else

inline thread_local bool inside = false;  // a pool worker, or a caller running its chunk

inline bool in_region() { return inside; }

struct Threads {
  explicit Threads(int64_t count) { threads = std::max<int64_t>(1, count); }
};

// Workers that wait for a job, take their chunk index and run it; one job at a time (a second
// caller waits for the first's to end).
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: workers may outlive static destructors
    return *pool;
  }

  // job(t) for t in [0, count), t = 0 on the calling thread
  void run(int64_t count, const std::function<void(int64_t)>& job) {
    std::lock_guard<std::mutex> one_job(running_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int64_t>(workers_.size()) < count - 1)
        workers_.emplace_back([this] { work(); });
      job_ = &job, next_ = 1, count_ = count, left_ = count - 1, ++generation_;
    }
    wake_.notify_all();
    inside = true;
    job(0);
    inside = false;
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return left_ == 0; });
    job_ = nullptr;
  }

 private:
  void work() {
    inside = true;
    int64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen && next_ < count_; });
      seen = generation_;
      while (next_ < count_) {
        const int64_t t = next_++;
        const auto* job = job_;
        lock.unlock();
        (*job)(t);
        lock.lock();
        if (--left_ == 0) done_.notify_one();
      }
    }
  }

  std::mutex running_, mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t generation_ = 0, next_ = 0, count_ = 0, left_ = 0;
};

template <class F>
void run_chunks(int64_t begin, int64_t end, int64_t grain, const F& f) {
  int64_t count = threads;
  if (grain > 0) count = std::min(count, divup(end - begin, grain));
  const int64_t chunk = divup(end - begin, count);
  Pool::get().run(count, [&](int64_t t) {
    const int64_t from = begin + t * chunk;
    if (from < end) f(from, std::min(end, from + chunk));
  });
}

#endif

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  if (n > grain && n > 1 && !in_region() && threads > 1)
    run_chunks(begin, end, grain, f);
  else
    f(begin, end);
}

}  // namespace parallel
