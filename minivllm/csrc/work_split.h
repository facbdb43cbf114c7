// Splitting one kernel call's units of work (row groups of a linear) over its OpenMP threads,
// with stealing.
//
// A static split gives each thread an equal share, but on the 2-vCPU VMs the two cores do not
// stream at equal speed (the hypervisor, the other tenant of the core's cache): in a decode step
// the faster thread then waited at the closing barrier for ~10% of the step. Here each thread
// owns a contiguous range (so its weight rows stay one sequential stream, which the hardware
// prefetcher follows) and takes chunks from its front; a thread whose range is empty takes
// chunks from the back of the others' ranges, so all threads finish within about one chunk.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace minivllm {

class WorkSplit {
 public:
  // units [0, units) over `threads` ranges; `chunks` per range sets the grain of a take.
  WorkSplit(int64_t units, int threads, int64_t chunks = 8)
      : threads_(std::max(1, threads)), slots_(new Slot[std::max(1, threads)]) {
    for (int t = 0; t < threads_; ++t) {
      const int64_t begin = units * t / threads_, end = units * (t + 1) / threads_;
      slots_[t].range.store(pack(begin, end), std::memory_order_relaxed);
    }
    grain_ = std::max<int64_t>(1, (units / threads_ + chunks - 1) / chunks);
  }

  // The next units [*begin, *end) for thread t: its own range's front, else another range's
  // back. false: nothing left anywhere.
  bool next(int t, int64_t* begin, int64_t* end) {
    if (take(t, true, begin, end)) return true;
    for (int i = 1; i < threads_; ++i)
      if (take((t + i) % threads_, false, begin, end)) return true;
    return false;
  }

 private:
  // [front, back) of one range in one atomic word (32 bits each), so an owner's take and a
  // thief's take never both get the same units.
  struct alignas(64) Slot {
    std::atomic<uint64_t> range{0};
  };

  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }

  bool take(int slot, bool from_front, int64_t* begin, int64_t* end) {
    std::atomic<uint64_t>& range = slots_[slot].range;
    uint64_t v = range.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(v & 0xFFFFFFFFu);
      const int64_t back = static_cast<int64_t>(v >> 32);
      if (front >= back) return false;
      const int64_t lo = from_front ? front : std::max(front, back - grain_);
      const int64_t hi = from_front ? std::min(back, front + grain_) : back;
      const uint64_t left = from_front ? pack(hi, back) : pack(front, lo);
      if (range.compare_exchange_weak(v, left, std::memory_order_relaxed)) {
        *begin = lo;
        *end = hi;
        return true;
      }
    }
  }

  int threads_;
  int64_t grain_;
  std::unique_ptr<Slot[]> slots_;
};

}  // namespace minivllm
