// Native tests of the task engine, with no Python in the loop.
// Built and run by tests/unit/test_engine_cpp.py; prints "N passed, N failed".
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "engine/engine.h"
#include "engine/native_work.h"

using namespace hipress;

static int g_failed = 0, g_passed = 0;
#define CHECK(cond)                                                             \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      throw std::runtime_error("check failed");                                 \
    }                                                                           \
  } while (0)

static void run(const char* name, const std::function<void()>& fn) {
  try {
    fn();
    ++g_passed;
    std::printf("PASS %s\n", name);
  } catch (const std::exception& e) {
    ++g_failed;
    std::printf("FAIL %s: %s\n", name, e.what());
  }
}

// Records the order in which task bodies ran.
struct OrderLog {
  std::mutex mu;
  std::vector<int> order;
  Work record(int id) {
    return [this, id] {
      std::lock_guard<std::mutex> l(mu);
      order.push_back(id);
    };
  }
  std::vector<int> position(size_t n) {
    std::vector<int> pos(n, -1);
    for (size_t i = 0; i < order.size(); ++i) pos[order[i]] = static_cast<int>(i);
    return pos;
  }
};

// A one-shot flag a task body can wait on, with a bound so a broken engine fails, not hangs.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  void set() {
    { std::lock_guard<std::mutex> l(mu); open = true; }
    cv.notify_all();
  }
  bool wait(double seconds) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, std::chrono::duration<double>(seconds), [this] { return open; });
  }
};

static void test_diamond() {
  Engine e;
  OrderLog log;
  auto a = e.submit("a", QueueKind::kCompute, log.record(0));
  auto b = e.submit("b", QueueKind::kComm, log.record(1), {a});
  auto c = e.submit("c", QueueKind::kCompute, log.record(2), {a});
  auto d = e.submit("d", QueueKind::kComm, log.record(3), {b, c});
  CHECK(Engine::wait(d, 5.0));
  CHECK(d->state() == TaskState::kDone);
  auto pos = log.position(4);
  CHECK(pos[0] < pos[1] && pos[0] < pos[2] && pos[1] < pos[3] && pos[2] < pos[3]);
}

static void test_random_dags() {
  for (int seed = 0; seed < 50; ++seed) {
    std::mt19937 rng(seed);
    const int n = 1000;
    Engine e;
    OrderLog log;
    std::vector<TaskHandle> tasks;
    std::vector<std::vector<int>> deps(n);
    for (int i = 0; i < n; ++i) {
      std::vector<TaskHandle> d;
      int k = i == 0 ? 0 : static_cast<int>(rng() % 4);
      for (int j = 0; j < k; ++j) {
        int p = static_cast<int>(rng() % i);
        deps[i].push_back(p);
        d.push_back(tasks[p]);
      }
      auto q = (rng() & 1) ? QueueKind::kComm : QueueKind::kCompute;
      tasks.push_back(e.submit("t" + std::to_string(i), q, log.record(i), d));
    }
    e.shutdown(/*drain=*/true, 30.0);
    CHECK(log.order.size() == static_cast<size_t>(n));
    auto pos = log.position(n);
    for (int i = 0; i < n; ++i) {
      CHECK(tasks[i]->state() == TaskState::kDone);
      for (int p : deps[i]) CHECK(pos[p] < pos[i]);
    }
  }
}

// Load-proof: no durations are compared (a 25 ms overlap of two 50 ms tasks once stood here;
// a loaded machine can start the second queue late). Each body says it runs, then waits
// (up to 30 s) until the other one runs: both see the other only if they ran at once.
static void test_overlap() {
  Engine e;
  Gate comp_runs, comm_runs;
  std::atomic<bool> comp_saw{false}, comm_saw{false};
  auto comp = e.submit("comp", QueueKind::kCompute, [&] { comp_runs.set(); comp_saw = comm_runs.wait(30.0); });
  auto comm = e.submit("comm", QueueKind::kComm, [&] { comm_runs.set(); comm_saw = comp_runs.wait(30.0); });
  CHECK(Engine::wait(comp, 60.0) && Engine::wait(comm, 60.0));
  CHECK(comp_saw.load() && comm_saw.load());
  int64_t overlap = std::min(comp->end_ns(), comm->end_ns()) - std::max(comp->start_ns(), comm->start_ns());
  CHECK(overlap > 0);  // and the recorded times say so
}

static void test_failure_propagates() {
  Engine e;
  auto a = e.submit("encode.w", QueueKind::kCompute, native_work::fail("kernel exploded"));
  auto b = e.submit("send.w", QueueKind::kComm, native_work::noop(), {a});
  auto c = e.submit("decode.w", QueueKind::kCompute, native_work::noop(), {b});
  CHECK(Engine::wait(c, 5.0));
  CHECK(a->state() == TaskState::kFailed && a->error() == "kernel exploded");
  CHECK(c->state() == TaskState::kFailed);
  CHECK(c->error().find("'send.w'") != std::string::npos);
  CHECK(c->error().find("kernel exploded") != std::string::npos);
  // A task submitted after its dependency failed fails at once.
  auto late = e.submit("late", QueueKind::kCompute, native_work::noop(), {a});
  CHECK(late->state() == TaskState::kFailed);
  CHECK(e.counters().queue[0].tasks_failed == 1);
}

// Load-proof: the slow task cannot finish before its gate opens, so a false from wait(0.05)
// shows the timeout ended the wait (a wait that ignored it would block until the task gave
// up after 30 s, then return true); no elapsed time is compared. The gate opens only once
// shutdown has cancelled the task queued behind it, however late shutdown is called.
static void test_wait_timeout_and_shutdown() {
  Engine e;
  Gate gate;
  auto slow = e.submit("slow", QueueKind::kComm, [&] { gate.wait(30.0); });
  CHECK(!Engine::wait(slow, 0.05));
  CHECK(!slow->finished());
  auto behind = e.submit("behind", QueueKind::kComm, native_work::noop());
  auto dependent = e.submit("dependent", QueueKind::kCompute, native_work::noop(), {slow});
  std::thread opener([&] {
    for (int i = 0; i < 30000 && behind->state() != TaskState::kCancelled; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    gate.set();
  });
  e.shutdown(/*drain=*/false);
  opener.join();
  CHECK(slow->state() == TaskState::kDone);  // running tasks finish
  CHECK(behind->state() == TaskState::kCancelled);
  CHECK(dependent->state() == TaskState::kCancelled);
  bool threw = false;
  try {
    e.submit("after", QueueKind::kCompute, native_work::noop());
  } catch (const EngineShutdownError&) {
    threw = true;
  }
  CHECK(threw);
}

static void test_callbacks() {
  Engine e;
  std::atomic<int> calls{0};
  auto a = e.submit("a", QueueKind::kCompute, native_work::sleep(2000));
  Engine::add_callback(a, [&](const TaskNode& t) { calls += (t.state() == TaskState::kDone); });
  CHECK(Engine::wait(a, 5.0));
  e.shutdown();
  Engine::add_callback(a, [&](const TaskNode&) { calls += 1; });  // already finished: runs at once
  CHECK(calls.load() == 2);
}

int main() {
  run("diamond", test_diamond);
  run("random_dags", test_random_dags);
  run("overlap", test_overlap);
  run("failure_propagates", test_failure_propagates);
  run("wait_timeout_and_shutdown", test_wait_timeout_and_shutdown);
  run("callbacks", test_callbacks);
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
