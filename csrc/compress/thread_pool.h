// A tiny fixed-size thread pool for CompLL kernels (no OpenMP: it clashes with
// torch's bundled libgomp). Work is split into chunks whose boundaries depend
// only on the problem size, never on the thread count, so every kernel gives
// bit-identical results with 1 or N threads (reductions combine per-chunk
// partials in chunk order).
#pragma once

#include <cstddef>
#include <functional>

namespace hipress::compress {

// Threads used by parallel_for (the caller counts as one). Default 1, or the
// HIPRESS_COMPRESS_THREADS environment variable (unset or empty: 1). n <= 0 means all
// hardware threads.
void set_num_threads(int n);
int num_threads();

// Calls fn(chunk) for chunk in [0, nchunks), spread over the pool. If the pool
// is already busy (another thread is inside parallel_for) the chunks run
// inline on the caller: never a deadlock, never oversubscription. The first
// exception thrown by fn is rethrown on the caller after all chunks finished.
void parallel_for(size_t nchunks, const std::function<void(size_t chunk)>& fn);

// Chunked loop over [0, n) with a fixed chunk size `grain` (elements).
inline void parallel_range(size_t n, size_t grain, const std::function<void(size_t begin, size_t end)>& fn) {
  if (n == 0) return;
  size_t nchunks = (n + grain - 1) / grain;
  if (nchunks == 1) {
    fn(0, n);
    return;
  }
  parallel_for(nchunks, [&](size_t c) {
    size_t b = c * grain, e = b + grain < n ? b + grain : n;
    fn(b, e);
  });
}

}  // namespace hipress::compress
