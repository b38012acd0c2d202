#include "engine/engine_bench.h"

#include "common/clock.h"
#include "engine/engine.h"
#include "engine/native_work.h"

namespace hipress {

EngineBenchResult bench_native_tasks(uint64_t tasks, int queues, bool chained) {
  Engine engine;
  TaskHandle prev;
  const int64_t t0 = now_ns();
  for (uint64_t i = 0; i < tasks; ++i) {
    auto q = (queues > 1 && (i & 1)) ? QueueKind::kComm : QueueKind::kCompute;
    std::vector<TaskHandle> deps;
    if (chained && prev) deps.push_back(prev);
    prev = engine.submit("noop", q, native_work::noop(), deps);
  }
  engine.shutdown(/*drain=*/true);
  EngineBenchResult r;
  r.seconds = (now_ns() - t0) / 1e9;
  r.tasks = tasks;
  return r;
}

}  // namespace hipress
