#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#ifdef __linux__
#include <pthread.h>
#endif

#include "common/clock.h"

namespace hipress {

// The lock and the "something finished" signal shared by an engine and its
// task nodes, so a handle stays waitable even after its engine is gone.
struct EngineSync {
  std::mutex mu;
  std::condition_variable done_cv;
};

const char* queue_name(QueueKind q) { return q == QueueKind::kCompute ? "Q_comp" : "Q_commu"; }

const char* task_state_name(TaskState s) {
  switch (s) {
    case TaskState::kPending: return "pending";
    case TaskState::kQueued: return "queued";
    case TaskState::kRunning: return "running";
    case TaskState::kPosted: return "posted";
    case TaskState::kDone: return "done";
    case TaskState::kFailed: return "failed";
    case TaskState::kCancelled: return "cancelled";
  }
  return "unknown";
}

static bool is_final(TaskState s) {
  return s == TaskState::kDone || s == TaskState::kFailed || s == TaskState::kCancelled;
}

TaskState TaskNode::state() const {
  std::lock_guard<std::mutex> lock(sync_->mu);
  return state_;
}
bool TaskNode::finished() const { return is_final(state()); }
std::string TaskNode::error() const {
  std::lock_guard<std::mutex> lock(sync_->mu);
  return error_;
}
int64_t TaskNode::start_ns() const {
  std::lock_guard<std::mutex> lock(sync_->mu);
  return start_ns_;
}
int64_t TaskNode::end_ns() const {
  std::lock_guard<std::mutex> lock(sync_->mu);
  return end_ns_;
}

Engine::Engine(EngineOptions options) : sync_(std::make_shared<EngineSync>()) {
  if (!options.timeline_path.empty()) {
    timeline_ = std::make_unique<Timeline>(options.timeline_path, options.rank);
    for (int q = 0; q < kNumQueues; ++q) timeline_->name_row(q, queue_name(static_cast<QueueKind>(q)));
  }
  for (int q = 0; q < kNumQueues; ++q) {
    threads_[q] = std::thread([this, q] { worker_loop(static_cast<QueueKind>(q)); });
#ifdef __linux__
    // named in top -H, py-spy and /proc/<pid>/task/*/comm: where a rank's CPU goes, per queue
    pthread_setname_np(threads_[q].native_handle(),
                       static_cast<QueueKind>(q) == QueueKind::kCompute ? "hipress-compute" : "hipress-comm");
#endif
  }
}

Engine::~Engine() { shutdown(/*drain=*/false); }

TaskHandle Engine::submit(std::string name, QueueKind queue, Work work,
                          const std::vector<TaskHandle>& deps, uint64_t batch_key) {
  if (!work) throw std::invalid_argument("task '" + name + "' has no work");
  auto t = std::make_shared<TaskNode>();
  t->name_ = std::move(name);
  t->queue_ = queue;
  t->batch_key_ = batch_key;
  t->work_ = std::move(work);
  return submit_node(std::move(t), deps);
}

TaskHandle Engine::submit_deferred(std::string name, QueueKind queue, DeferredWork work,
                                   const std::vector<TaskHandle>& deps) {
  if (!work) throw std::invalid_argument("task '" + name + "' has no work");
  auto t = std::make_shared<TaskNode>();
  t->name_ = std::move(name);
  t->queue_ = queue;
  t->deferred_work_ = std::move(work);
  t->is_deferred_ = true;
  return submit_node(std::move(t), deps);
}

void Engine::complete(const TaskHandle& t, bool ok, const std::string& error) {
  if (!t || t->sync_ != sync_) throw std::invalid_argument("complete() of a task of another engine");
  std::vector<TaskHandle> finished;
  int64_t start, end;
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (t->is_deferred_ && t->state_ == TaskState::kRunning && !t->early_complete_) {
      // Its work has not returned yet: the queue thread finishes it when it does.
      t->early_complete_ = true;
      t->early_ok_ = ok;
      t->early_error_ = error;
      return;
    }
    if (t->state_ != TaskState::kPosted) {
      if (t->state_ == TaskState::kCancelled) return;  // shut down meanwhile: nothing left to do
      throw std::logic_error("complete() of task '" + t->name_ + "' in state " + task_state_name(t->state_));
    }
    finish_locked(t, ok ? TaskState::kDone : TaskState::kFailed, error, &finished);
    start = t->start_ns_;
    end = t->end_ns_;
    auto& c = counters_.queue[static_cast<int>(t->queue_)];
    if (!ok) c.tasks_failed++;
  }
  if (timeline_) timeline_->slice(static_cast<int>(t->queue_), t->name_, start, end, ok ? "deferred" : "failed");
  run_callbacks(finished);
}

TaskHandle Engine::submit_node(std::shared_ptr<TaskNode> t, const std::vector<TaskHandle>& deps) {
  t->sync_ = sync_;
  std::vector<TaskHandle> finished;
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (stopping_) throw EngineShutdownError("cannot submit task '" + t->name_ + "': the engine is shut down");
    int64_t now = now_ns();
    t->id_ = next_id_++;
    t->submit_ns_ = now;
    counters_.submitted++;
    live_.emplace(t->id_, t);
    const TaskNode* failed_dep = nullptr;
    for (const auto& d : deps) {
      if (!d) throw std::invalid_argument("task '" + t->name_ + "' has a null dependency");
      if (d->sync_ != sync_) throw std::invalid_argument("task '" + t->name_ + "' depends on '" + d->name_ + "' of another engine");
      if (d->state_ == TaskState::kDone) continue;
      if (is_final(d->state_)) { failed_dep = d.get(); break; }
      d->dependents_.push_back(t);
      t->pending_deps_++;
    }
    if (failed_dep) {
      // It will never run; dependencies registered so far drop it when they finish.
      counters_.dependency_failed++;
      finish_locked(t, TaskState::kFailed, dependency_error(*failed_dep, t.get()), &finished);
    } else if (t->pending_deps_ == 0) {
      enqueue_locked(t, now);
    }
  }
  run_callbacks(finished);
  return t;
}

void Engine::enqueue_locked(const TaskHandle& t, int64_t now) {
  t->state_ = TaskState::kQueued;
  t->ready_ns_ = now;
  int q = static_cast<int>(t->queue_);
  queues_[q].push_back(t);
  queue_cv_[q].notify_one();
}

void Engine::finish_locked(const TaskHandle& t, TaskState state, const std::string& error,
                           std::vector<TaskHandle>* finished) {
  // Iterative, so that a long chain of failing dependents cannot overflow the stack.
  std::vector<std::pair<TaskHandle, std::string>> todo{{t, error}};
  TaskState first_state = state;
  while (!todo.empty()) {
    auto [node, err] = std::move(todo.back());
    todo.pop_back();
    if (is_final(node->state_)) continue;  // already failed through another dependency
    TaskState s = (node == t) ? first_state : TaskState::kFailed;
    node->state_ = s;
    node->error_ = err;
    node->end_ns_ = now_ns();
    if (node != t && s == TaskState::kFailed) counters_.dependency_failed++;
    if (s == TaskState::kCancelled) counters_.cancelled++;
    live_.erase(node->id_);
    finished->push_back(node);
    auto dependents = std::move(node->dependents_);
    node->dependents_.clear();
    for (auto& dep : dependents) {
      if (s == TaskState::kDone) {
        if (--dep->pending_deps_ == 0 && dep->state_ == TaskState::kPending) enqueue_locked(dep, node->end_ns_);
      } else {
        todo.emplace_back(dep, dependency_error(*node, dep.get()));
      }
    }
  }
  sync_->done_cv.notify_all();
}

std::string Engine::dependency_error(const TaskNode& dep, TaskNode* dependent) {
  if (dep.state_ == TaskState::kCancelled) return "dependency '" + dep.name_ + "' was cancelled";
  const bool dep_is_root = dep.root_name_.empty();
  dependent->root_name_ = dep_is_root ? dep.name_ : dep.root_name_;
  dependent->root_error_ = dep_is_root ? dep.error_ : dep.root_error_;
  std::string via = dep_is_root ? "" : " (via '" + dep.name_ + "')";
  return "dependency '" + dependent->root_name_ + "' failed" + via + ": " + dependent->root_error_;
}

void Engine::run_callbacks(std::vector<TaskHandle>& finished) {
  for (auto& node : finished) {
    std::vector<TaskNode::Callback> cbs;
    {
      std::lock_guard<std::mutex> lock(sync_->mu);
      cbs = std::move(node->callbacks_);
      node->callbacks_.clear();
    }
    // Work is released here, outside the lock: it may own Python objects or buffers.
    Work release = std::move(node->work_);
    node->work_ = nullptr;
    release = nullptr;
    DeferredWork release_deferred = std::move(node->deferred_work_);
    node->deferred_work_ = nullptr;
    release_deferred = nullptr;
    for (auto& cb : cbs) {
      try {
        cb(*node);
      } catch (...) {
        // A callback must not take the engine thread down; callers report their own errors.
      }
    }
  }
}

void Engine::run_batch(int qi, const TaskHandle& first, std::vector<TaskHandle>& rest) {
  std::vector<TaskHandle> all;
  all.reserve(rest.size() + 1);
  all.push_back(first);
  for (auto& b : rest) all.push_back(b);
  std::vector<std::string> errors(all.size());
  std::vector<char> oks(all.size(), 1);
  for (size_t i = 0; i < all.size(); ++i) {
    try {
      all[i]->work_();
    } catch (const std::exception& e) {
      oks[i] = 0;
      errors[i] = e.what();
    } catch (...) {
      oks[i] = 0;
      errors[i] = "unknown C++ exception";
    }
  }
  std::vector<TaskHandle> finished;
  int64_t start = first->start_ns_, end;
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    for (size_t i = 0; i < all.size(); ++i) {
      finish_locked(all[i], oks[i] ? TaskState::kDone : TaskState::kFailed, errors[i], &finished);
      if (!oks[i]) counters_.queue[qi].tasks_failed++;
    }
    end = all.back()->end_ns_;
    auto& c = counters_.queue[qi];
    c.tasks_run += all.size();
    c.batches++;
    c.busy_ns += end - start;
  }
  if (timeline_) {
    timeline_->slice(qi, "batch[" + std::to_string(all.size()) + "] " + first->name_ + " .. " + all.back()->name_,
                     start, end, "batch");
  }
  run_callbacks(finished);
}

void Engine::worker_loop(QueueKind q) {
  const int qi = static_cast<int>(q);
  std::vector<TaskHandle> batch;
  for (;;) {
    TaskHandle t;
    {
      std::unique_lock<std::mutex> lock(sync_->mu);
      queue_cv_[qi].wait(lock, [&] { return !queues_[qi].empty() || stopping_; });
      if (queues_[qi].empty()) return;  // stopping, nothing left
      t = std::move(queues_[qi].front());
      queues_[qi].pop_front();
      t->state_ = TaskState::kRunning;
      t->start_ns_ = now_ns();
      counters_.queue[qi].wait_ns += t->start_ns_ - t->ready_ns_;
      if (t->batch_key_ != 0 && !t->is_deferred_) {
        batch.clear();
        while (!queues_[qi].empty() && batch.size() + 1 < kMaxBatch &&
               queues_[qi].front()->batch_key_ == t->batch_key_ && !queues_[qi].front()->is_deferred_) {
          TaskHandle b = std::move(queues_[qi].front());
          queues_[qi].pop_front();
          b->state_ = TaskState::kRunning;
          b->start_ns_ = t->start_ns_;
          counters_.queue[qi].wait_ns += b->start_ns_ - b->ready_ns_;
          batch.push_back(std::move(b));
        }
      }
    }
    if (!batch.empty()) {
      run_batch(qi, t, batch);
      batch.clear();
      continue;
    }
    std::string error;
    bool ok = true;
    const bool deferred = t->is_deferred_;
    try {
      if (deferred) {
        DeferredWork w = std::move(t->deferred_work_);
        t->deferred_work_ = nullptr;
        w(t);  // w (and what it owns) is released at the end of this block, outside the lock
      } else {
        t->work_();
      }
    } catch (const std::exception& e) {
      ok = false;
      error = e.what();
    } catch (...) {
      ok = false;
      error = "unknown C++ exception";
    }
    std::vector<TaskHandle> finished;
    int64_t start, end;
    {
      std::lock_guard<std::mutex> lock(sync_->mu);
      if (deferred && ok && !t->early_complete_) {
        // Handed off: it finishes when complete() is called.
        counters_.queue[qi].tasks_run++;
        counters_.queue[qi].busy_ns += now_ns() - t->start_ns_;
        if (t->state_ == TaskState::kRunning) t->state_ = TaskState::kPosted;
        continue;
      }
      if (deferred && ok) {
        ok = t->early_ok_;
        error = t->early_error_;
      }
      finish_locked(t, ok ? TaskState::kDone : TaskState::kFailed, error, &finished);
      start = t->start_ns_;
      end = t->end_ns_;
      auto& c = counters_.queue[qi];
      c.tasks_run++;
      if (!ok) c.tasks_failed++;
      c.busy_ns += end - start;
    }
    if (timeline_) timeline_->slice(qi, t->name_, start, end, ok ? "task" : "failed");
    run_callbacks(finished);
  }
}

bool Engine::wait(const TaskHandle& task, double timeout_s) {
  if (!task) throw std::invalid_argument("wait on a null task handle");
  std::unique_lock<std::mutex> lock(task->sync_->mu);
  auto done = [&] { return is_final(task->state_); };
  if (timeout_s < 0) {
    task->sync_->done_cv.wait(lock, done);
    return true;
  }
  return task->sync_->done_cv.wait_for(lock, std::chrono::duration<double>(timeout_s), done);
}

void Engine::add_callback(const TaskHandle& task, TaskNode::Callback cb) {
  {
    std::lock_guard<std::mutex> lock(task->sync_->mu);
    if (!is_final(task->state_)) {
      task->callbacks_.push_back(std::move(cb));
      return;
    }
  }
  cb(*task);
}

void Engine::shutdown(bool drain, double timeout_s) {
  std::lock_guard<std::mutex> serial(shutdown_mu_);
  if (stopped_.load()) return;
  std::vector<TaskHandle> finished;
  {
    std::unique_lock<std::mutex> lock(sync_->mu);
    if (drain) {
      auto empty = [&] { return live_.empty(); };
      if (timeout_s < 0) {
        sync_->done_cv.wait(lock, empty);
      } else {
        sync_->done_cv.wait_for(lock, std::chrono::duration<double>(timeout_s), empty);
      }
    }
    stopping_ = true;
    // Cancel everything not yet running, in submission order so messages name the root cause.
    std::vector<TaskHandle> pending;
    for (auto& kv : live_) {
      auto st = kv.second->state_;
      if (st == TaskState::kPending || st == TaskState::kQueued || st == TaskState::kPosted) pending.push_back(kv.second);
    }
    std::sort(pending.begin(), pending.end(), [](const TaskHandle& a, const TaskHandle& b) { return a->id_ < b->id_; });
    for (int q = 0; q < kNumQueues; ++q) queues_[q].clear();
    for (auto& t : pending) finish_locked(t, TaskState::kCancelled, "cancelled: the engine was shut down", &finished);
    for (int q = 0; q < kNumQueues; ++q) queue_cv_[q].notify_all();
  }
  run_callbacks(finished);
  for (auto& th : threads_) {
    if (th.joinable()) th.join();
  }
  stopped_.store(true);
  if (timeline_) timeline_->close();
}

EngineCounters Engine::counters() const {
  std::lock_guard<std::mutex> lock(sync_->mu);
  EngineCounters c = counters_;
  c.live = live_.size();
  return c;
}

}  // namespace hipress
