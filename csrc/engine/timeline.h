// Chrome-trace timeline (chrome://tracing, Perfetto), like Horovod's timeline:
// one row (tid) per engine queue, one complete ("X") slice per task.
// Written as a JSON array streamed to disk, so a crashed run still leaves a
// readable file (both viewers accept a missing closing bracket).
#pragma once

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace hipress {

class Timeline {
 public:
  // Opens path for writing; throws std::runtime_error if it cannot.
  Timeline(const std::string& path, int pid);
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // Names a row; rows 0 and 1 are the engine's queues.
  void name_row(int tid, const std::string& name);
  // A slice [start_ns, end_ns) on row tid.
  void slice(int tid, const std::string& name, int64_t start_ns, int64_t end_ns,
             const char* category);
  void close();
  const std::string& path() const { return path_; }

 private:
  void write_event_locked(const std::string& json);
  std::mutex mu_;
  std::FILE* file_ = nullptr;
  std::string path_;
  int pid_;
  bool first_ = true;
  int64_t origin_ns_;
};

}  // namespace hipress
