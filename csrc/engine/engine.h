// The CaSync task engine (HiPress paper 000, §3.1, Fig. 2).
//
// A Task has a name, a queue (compute or communication), the tasks it depends
// on, and work: a std::function that runs on that queue's dedicated thread.
// The engine never knows what the work is (native kernel, Python callable,
// transport call): strategies build the graph, the engine only runs it.
//
// Protocol, step by step:
//   1. submit(): the task is registered; for every dependency still unfinished
//      the task is added to that dependency's dependents and its pending count
//      is raised. A dependency that already failed fails the new task at once.
//      With no pending dependencies the task is pushed onto its queue.
//   2. Each queue (Q_comp, Q_commu) is drained in FIFO order by its own thread,
//      so compute and communication run at the same time.
//   3. When a task finishes, every dependent's pending count is lowered; those
//      that reach zero are pushed onto their queues. When a task fails, all its
//      transitive dependents fail with a message that names the failed task and
//      carries its original error.
//   4. Waiters are woken; completion callbacks run on the finishing thread,
//      outside the engine lock.
//
// One mutex guards the graph and both queues (as Horovod's tensor queue does):
// critical sections are a few pointer operations, and a single lock keeps the
// dependency bookkeeping obviously consistent.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/timeline.h"

namespace hipress {

enum class QueueKind : int { kCompute = 0, kComm = 1 };
constexpr int kNumQueues = 2;
const char* queue_name(QueueKind q);

// kPosted: a deferred task whose work has run (it handed its job to someone else, e.g.
// the coordinator's executor) and that waits for Engine::complete().
enum class TaskState : int { kPending = 0, kQueued, kRunning, kPosted, kDone, kFailed, kCancelled };
const char* task_state_name(TaskState s);

using Work = std::function<void()>;
class TaskNode;
// Work of a deferred task: receives its own handle, to pass to whoever completes it.
using DeferredWork = std::function<void(const std::shared_ptr<TaskNode>&)>;

struct EngineSync;

// Shared state of one task; a handle is a shared_ptr to it.
class TaskNode {
 public:
  using Callback = std::function<void(const TaskNode&)>;

  uint64_t id() const { return id_; }
  const std::string& name() const { return name_; }
  QueueKind queue() const { return queue_; }
  TaskState state() const;
  bool finished() const;
  // Error text of a failed or cancelled task ("" otherwise).
  std::string error() const;
  // Timestamps (ns, steady clock); 0 where the step did not happen.
  int64_t submit_ns() const { return submit_ns_; }
  int64_t start_ns() const;
  int64_t end_ns() const;

 private:
  friend class Engine;
  uint64_t id_ = 0;
  std::string name_;
  QueueKind queue_ = QueueKind::kCompute;
  uint64_t batch_key_ = 0;  // != 0: may run in one batch with queued tasks of the same key
  Work work_;
  DeferredWork deferred_work_;  // set instead of work_ for deferred tasks
  bool is_deferred_ = false;
  // complete() may arrive while the deferred work is still running on its queue thread.
  bool early_complete_ = false;
  bool early_ok_ = true;
  std::string early_error_;
  std::shared_ptr<EngineSync> sync_;
  // Guarded by sync_->mu.
  TaskState state_ = TaskState::kPending;
  std::string error_;
  // The task whose own work failed first along the dependency chain ("" if this one),
  // and its message: dependents report the root cause, not a chain of wrappers.
  std::string root_name_;
  std::string root_error_;
  int pending_deps_ = 0;
  std::vector<std::shared_ptr<TaskNode>> dependents_;
  std::vector<Callback> callbacks_;
  int64_t submit_ns_ = 0, ready_ns_ = 0, start_ns_ = 0, end_ns_ = 0;
};

using TaskHandle = std::shared_ptr<TaskNode>;

struct QueueCounters {
  uint64_t tasks_run = 0;     // finished on this queue (ok or failed)
  uint64_t tasks_failed = 0;  // whose own work threw
  uint64_t batches = 0;       // batch executions of more than one task
  int64_t wait_ns = 0;        // sum of (start - ready): time spent queued
  int64_t busy_ns = 0;        // sum of (end - start): time the thread worked
};

struct EngineCounters {
  QueueCounters queue[kNumQueues];
  uint64_t submitted = 0;
  uint64_t cancelled = 0;
  uint64_t dependency_failed = 0;  // failed because a dependency failed
  uint64_t live = 0;               // submitted, not yet finished
};

class EngineShutdownError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct EngineOptions {
  std::string timeline_path;  // "" disables the timeline
  int rank = 0;               // Chrome-trace pid, so per-rank traces can be merged
};

class Engine {
 public:
  explicit Engine(EngineOptions options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Returns at once. Throws EngineShutdownError after shutdown().
  // batch_key != 0: batch execution (paper §3.2, "batch compression"): when the queue
  // thread takes this task, it also takes the tasks directly behind it in the queue
  // that carry the same key (up to kMaxBatch) and runs them as one batch: one hand-off,
  // one lock to finish them all, one timeline slice.
  TaskHandle submit(std::string name, QueueKind queue, Work work,
                    const std::vector<TaskHandle>& deps = {}, uint64_t batch_key = 0);
  static constexpr size_t kMaxBatch = 64;

  // A deferred task: when ready, its work runs on the queue thread with its own handle
  // and must arrange for complete() to be called later (from any thread). Until then
  // the task is kPosted and its dependents wait. Used for communication that another
  // component (the coordinator's executor) carries out in bulk.
  TaskHandle submit_deferred(std::string name, QueueKind queue, DeferredWork work,
                             const std::vector<TaskHandle>& deps = {});
  // Finishes a posted deferred task: ok, or failed with error. Throws std::logic_error
  // if the task is not posted (never started, or completed already).
  void complete(const TaskHandle& task, bool ok = true, const std::string& error = "");

  // Blocks until the task finished or timeout_s passed (timeout_s < 0: forever).
  // Returns whether it finished.
  static bool wait(const TaskHandle& task, double timeout_s = -1);

  // Runs cb(task) once the task has finished, on the thread that finished it;
  // at once on the caller's thread if it already has.
  static void add_callback(const TaskHandle& task, TaskNode::Callback cb);

  // drain=true: run everything already submitted (up to timeout_s), then
  // cancel whatever is left. drain=false: cancel all tasks not yet running.
  // Joins both queue threads. Idempotent.
  void shutdown(bool drain = true, double timeout_s = -1);
  bool is_shut_down() const { return stopped_.load(); }

  EngineCounters counters() const;
  Timeline* timeline() { return timeline_.get(); }

 private:
  void worker_loop(QueueKind q);
  void run_batch(int qi, const TaskHandle& first, std::vector<TaskHandle>& rest);
  TaskHandle submit_node(std::shared_ptr<TaskNode> t, const std::vector<TaskHandle>& deps);
  void enqueue_locked(const TaskHandle& t, int64_t now);
  // Marks t finished and releases or fails its dependents. Collects every
  // node that finished so that callbacks run outside the lock.
  void finish_locked(const TaskHandle& t, TaskState state, const std::string& error,
                     std::vector<TaskHandle>* finished);
  void run_callbacks(std::vector<TaskHandle>& finished);
  // Message of a task failing because `dep` failed or was cancelled; records the
  // root cause on `dependent`. Under the lock.
  static std::string dependency_error(const TaskNode& dep, TaskNode* dependent);

  std::shared_ptr<EngineSync> sync_;
  std::deque<TaskHandle> queues_[kNumQueues];
  std::condition_variable queue_cv_[kNumQueues];
  std::unordered_map<uint64_t, TaskHandle> live_;
  EngineCounters counters_;
  uint64_t next_id_ = 1;
  bool stopping_ = false;
  std::mutex shutdown_mu_;  // serialises shutdown() callers; never taken with sync_->mu held
  std::atomic<bool> stopped_{false};
  std::unique_ptr<Timeline> timeline_;
  std::thread threads_[kNumQueues];
};

}  // namespace hipress
