#include "engine/timeline.h"

#include <stdexcept>

#include "common/clock.h"

namespace hipress {
namespace {

std::string json_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 2);
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out;
}

}  // namespace

Timeline::Timeline(const std::string& path, int pid) : path_(path), pid_(pid), origin_ns_(now_ns()) {
  file_ = std::fopen(path.c_str(), "w");
  if (!file_) throw std::runtime_error("cannot open timeline file '" + path + "' for writing");
  std::fputs("[\n", file_);
}

Timeline::~Timeline() { close(); }

void Timeline::write_event_locked(const std::string& json) {
  if (!file_) return;
  if (!first_) std::fputs(",\n", file_);
  first_ = false;
  std::fputs(json.c_str(), file_);
}

void Timeline::name_row(int tid, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  write_event_locked("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + std::to_string(pid_) +
                     ",\"tid\":" + std::to_string(tid) + ",\"args\":{\"name\":\"" +
                     json_escape(name) + "\"}}");
}

void Timeline::slice(int tid, const std::string& name, int64_t start_ns, int64_t end_ns,
                     const char* category) {
  // Microseconds with ns precision: Chrome trace "ts"/"dur" are in µs.
  char buf[160];
  std::snprintf(buf, sizeof(buf), ",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}",
                pid_, tid, (start_ns - origin_ns_) / 1e3, (end_ns - start_ns) / 1e3);
  std::string ev = "{\"name\":\"" + json_escape(name) + "\",\"cat\":\"" + category + "\"" + buf;
  std::lock_guard<std::mutex> lock(mu_);
  write_event_locked(ev);
}

void Timeline::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!file_) return;
  std::fputs("\n]\n", file_);
  std::fclose(file_);
  file_ = nullptr;
}

}  // namespace hipress
