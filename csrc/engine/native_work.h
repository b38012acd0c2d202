// Small native task bodies that need no Python: used by the engine benchmark,
// the overlap tests and as the simplest example of a native task.
#pragma once

#include <string>
#include <vector>

#include "engine/engine.h"

namespace hipress::native_work {

Work noop();
// Busy-waits for us microseconds (keeps a core busy, like a kernel would).
Work spin(double us);
// Sleeps for us microseconds (frees the core, like waiting on a network would).
Work sleep(double us);
// Throws std::runtime_error(message): how a failing native kernel reports.
Work fail(std::string message);
// memcpy(dst, src, bytes) on host memory.
Work copy(void* dst, const void* src, size_t bytes);

// One piece of a scatter: count values from src[src_offset] to dst.
struct ScatterSegment {
  size_t src_offset;
  float* dst;
  size_t count;
};
// dst = src / divisor for every segment, in fp32 (src is fp32, or bf16 widened first; divisor 1:
// a copy): an allreduced bucket written into the gradients it fused, one pass without the GIL.
Work scatter_divided(const void* src, bool src_bf16, float divisor, std::vector<ScatterSegment> segments);

}  // namespace hipress::native_work
