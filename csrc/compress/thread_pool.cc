#include "compress/thread_pool.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace hipress::compress {
namespace {

class Pool {
 public:
  Pool() {
    // As in hipress.config's table: unset or empty = 1, n <= 0 = all hardware threads
    // (hipress.compression rejects a value that is not an integer before the pool is used).
    const char* env = std::getenv("HIPRESS_COMPRESS_THREADS");
    char* end = nullptr;
    long n = env ? std::strtol(env, &end, 10) : 1;
    threads_ = (env && end != env) ? static_cast<int>(n) : 1;
    if (threads_ <= 0) threads_ = hw();
  }
  ~Pool() { stop_workers(); }

  static int hw() {
    unsigned h = std::thread::hardware_concurrency();
    return h ? static_cast<int>(h) : 1;
  }

  void set_threads(int n) {
    std::lock_guard<std::mutex> run(run_mu_);
    if (n <= 0) n = hw();
    stop_workers();
    threads_ = n;
  }
  int threads() const { return threads_; }

  void run(size_t nchunks, const std::function<void(size_t)>& fn) {
    std::unique_lock<std::mutex> run(run_mu_, std::try_to_lock);
    if (!run.owns_lock() || threads_ <= 1 || nchunks <= 1) {
      for (size_t c = 0; c < nchunks; ++c) fn(c);
      return;
    }
    start_workers();
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      nchunks_ = nchunks;
      next_.store(0);
      done_ = 0;
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return done_ == nchunks_ && active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work() {
    size_t mine = 0;
    std::exception_ptr err;
    const std::function<void(size_t)>* fn;
    size_t n;
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn = fn_;
      n = nchunks_;
      if (!fn) return;
      ++active_;  // the caller does not return (fn stays alive) while a worker is active
    }
    for (;;) {
      size_t c = next_.fetch_add(1);
      if (c >= n) break;
      try {
        (*fn)(c);
      } catch (...) {
        if (!err) err = std::current_exception();
      }
      ++mine;
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (err && !error_) error_ = err;
    done_ += mine;
    --active_;
    if (done_ == nchunks_ && active_ == 0) done_cv_.notify_all();
  }

  void start_workers() {
    if (!workers_.empty()) return;
    stop_ = false;
    for (int i = 1; i < threads_; ++i) {
      workers_.emplace_back([this] {
        uint64_t seen = 0;
        for (;;) {
          {
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
            if (stop_) return;
            seen = generation_;
          }
          work();
        }
      });
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  int threads_ = 1;
  std::mutex run_mu_;  // one parallel_for at a time
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
  uint64_t generation_ = 0;
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t nchunks_ = 0, done_ = 0;
  int active_ = 0;
  std::atomic<size_t> next_{0};
  std::exception_ptr error_;
};

Pool& pool() {
  static Pool* p = new Pool();  // leaked on purpose: no join at static destruction time
  return *p;
}

}  // namespace

void set_num_threads(int n) { pool().set_threads(n); }
int num_threads() { return pool().threads(); }
void parallel_for(size_t nchunks, const std::function<void(size_t)>& fn) { pool().run(nchunks, fn); }

}  // namespace hipress::compress
