#include "engine/native_work.h"

#include <chrono>
#include <cstdint>
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

Work scatter_divided(const void* src, bool src_bf16, float divisor, std::vector<ScatterSegment> segments) {
  return [src, src_bf16, divisor, segments = std::move(segments)] {
    for (const ScatterSegment& s : segments) {
      float* out = s.dst;
      if (src_bf16) {
        const uint16_t* in = static_cast<const uint16_t*>(src) + s.src_offset;
        for (size_t i = 0; i < s.count; ++i) {
          const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;  // bf16 is fp32's top half
          float v;
          std::memcpy(&v, &bits, sizeof v);
          out[i] = v / divisor;
        }
      } else {
        const float* in = static_cast<const float*>(src) + s.src_offset;
        for (size_t i = 0; i < s.count; ++i) out[i] = in[i] / divisor;
      }
    }
  };
}

}  // namespace hipress::native_work
