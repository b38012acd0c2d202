// Small native task bodies that need no Python: used by the engine benchmark,
// the overlap tests and as the simplest example of a native task.
#pragma once

#include <string>

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

}  // namespace hipress::native_work
