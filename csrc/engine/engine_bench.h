// Measures engine overhead from C++, so the figure excludes Python entirely.
#pragma once

#include <cstdint>

namespace hipress {

struct EngineBenchResult {
  double seconds = 0;  // wall time from first submit to last completion
  uint64_t tasks = 0;
};

// Submits `tasks` no-op native tasks spread round-robin over `queues` (1 or 2)
// queues; chained=true makes each task depend on the previous one (so every
// task pays a hand-off between threads), else they are independent.
EngineBenchResult bench_native_tasks(uint64_t tasks, int queues, bool chained);

}  // namespace hipress
