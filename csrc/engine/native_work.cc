#include "engine/native_work.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "common/clock.h"

namespace hipress::native_work {

Work noop() {
  return [] {};
}

Work spin(double us) {
  return [us] {
    const int64_t until = now_ns() + static_cast<int64_t>(us * 1e3);
    while (now_ns() < until) {
    }
  };
}

Work sleep(double us) {
  return [us] { std::this_thread::sleep_for(std::chrono::nanoseconds(static_cast<int64_t>(us * 1e3))); };
}

Work fail(std::string message) {
  return [message] { throw std::runtime_error(message); };
}

Work copy(void* dst, const void* src, size_t bytes) {
  return [dst, src, bytes] { std::memcpy(dst, src, bytes); };
}

}  // namespace hipress::native_work
