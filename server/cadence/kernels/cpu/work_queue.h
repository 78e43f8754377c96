// A parallel call's units of work (column blocks, pairs of them) handed out to whichever of
// its threads asks next, not split in equal shares up front. On a shared host a core can
// run at half speed for seconds at a time (another guest on its SMT sibling: 2-vCPU guests
// of a Xeon measured one core at 7 ms and the other at 14 ms for the same product, the
// roles swapping every few seconds), and the server's own router and clients take turns on
// the same cores; an equal share makes every product wait for the slower thread.
//
// Guided: each claim takes a share of what is left (1 / (2 x threads) of it, at least
// units / 8), so runs start long -- a thread's weights stream in order, as with an equal
// share -- and end short, so the threads finish together. Which thread computes a unit
// never changes its bits: every kernel using this computes each output alone.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace cadence_kernels {

class WorkQueue {
  public:
    // `multiple`: every run but the last is a multiple of it (a kernel's group of blocks).
    WorkQueue(int64_t units, int threads, int64_t multiple = 1)
        : units_(units),
          parts_(2 * std::max(1, threads)),
          least_(std::max<int64_t>(multiple, units / 8 / multiple * multiple)),
          multiple_(multiple) {}

    // The next run [first, end), or false once every unit is taken.
    bool claim(int64_t& first, int64_t& end) {
        int64_t at = next_.load(std::memory_order_relaxed);
        for (;;) {
            if (at >= units_) return false;
            const int64_t share = (units_ - at) / parts_ / multiple_ * multiple_;
            const int64_t take = std::min(units_ - at, std::max(least_, share));
            if (next_.compare_exchange_weak(at, at + take, std::memory_order_relaxed)) {
                first = at, end = at + take;
                return true;
            }
        }
    }

  private:
    std::atomic<int64_t> next_{0};
    const int64_t units_, parts_, least_, multiple_;
};

}  // namespace cadence_kernels
