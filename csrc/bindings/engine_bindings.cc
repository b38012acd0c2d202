// Python face of the task engine. The engine itself knows nothing of Python:
// here a Python callable becomes a Work that takes the GIL only while it runs.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/registry.h"
#include "common/clock.h"
#include "engine/engine.h"
#include "engine/engine_bench.h"
#include "engine/native_work.h"

namespace py = pybind11;

namespace hipress {
namespace {

// Opaque native task body handed from C++ factories to Engine.submit.
struct NativeWork {
  Work work;
};

// Owns a Python object from any thread: destruction takes the GIL.
std::shared_ptr<py::object> share_py(py::object obj) {
  return std::shared_ptr<py::object>(new py::object(std::move(obj)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

Work python_work(py::object fn) {
  auto holder = share_py(std::move(fn));
  return [holder] {
    py::gil_scoped_acquire gil;
    try {
      (*holder)();
    } catch (py::error_already_set& e) {
      // Keep the Python exception type and message; drop the traceback.
      std::string msg = py::str(e.type().attr("__name__")).cast<std::string>() + ": " +
                        py::str(e.value()).cast<std::string>();
      throw std::runtime_error(msg);
    }
  };
}

struct EngineDeleter {
  void operator()(Engine* e) const {
    // Joining the queue threads may wait for Python tasks, which need the GIL.
    py::gil_scoped_release release;
    delete e;
  }
};

py::dict counters_dict(const EngineCounters& c) {
  py::dict d;
  for (int q = 0; q < kNumQueues; ++q) {
    py::dict qd;
    qd["tasks_run"] = c.queue[q].tasks_run;
    qd["tasks_failed"] = c.queue[q].tasks_failed;
    qd["batches"] = c.queue[q].batches;
    qd["wait_s"] = c.queue[q].wait_ns / 1e9;
    qd["busy_s"] = c.queue[q].busy_ns / 1e9;
    d[q == 0 ? "compute" : "comm"] = qd;
  }
  d["submitted"] = c.submitted;
  d["cancelled"] = c.cancelled;
  d["dependency_failed"] = c.dependency_failed;
  d["live"] = c.live;
  return d;
}

}  // namespace
}  // namespace hipress

HIPRESS_BINDINGS(engine, m) {
  using namespace hipress;
  m.def("now_ns", &now_ns, "Monotonic clock used by the engine counters and timeline (ns).");

  m.def("bench_native_tasks",
        [](uint64_t tasks, int queues, bool chained) {
          auto r = bench_native_tasks(tasks, queues, chained);
          return std::make_pair(r.seconds, r.tasks);  // converted after the GIL is retaken
        },
        py::arg("tasks"), py::arg("queues") = 1, py::arg("chained") = false,
        py::call_guard<py::gil_scoped_release>(),
        "Engine overhead measured in C++: (seconds, tasks) for no-op native tasks.");

  py::register_exception<EngineShutdownError>(m, "EngineShutdownError", PyExc_RuntimeError);

  py::class_<NativeWork>(m, "NativeWork", "A task body implemented in C++; runs without the GIL.");
  m.def("native_noop", [] { return NativeWork{native_work::noop()}; });
  m.def("native_spin", [](double us) { return NativeWork{native_work::spin(us)}; }, py::arg("us"));
  m.def("native_sleep", [](double us) { return NativeWork{native_work::sleep(us)}; }, py::arg("us"));
  m.def("native_fail", [](std::string msg) { return NativeWork{native_work::fail(std::move(msg))}; },
        py::arg("message"));
  m.def("native_copy",
        [](uintptr_t dst, uintptr_t src, size_t n) {
          return NativeWork{native_work::copy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n)};
        },
        py::arg("dst_ptr"), py::arg("src_ptr"), py::arg("nbytes"));
  m.def("native_scatter_divided",
        [](uintptr_t src, bool src_bf16, float divisor, const std::vector<std::tuple<size_t, uintptr_t, size_t>>& segs) {
          std::vector<native_work::ScatterSegment> out;
          out.reserve(segs.size());
          for (const auto& [off, dst, n] : segs) out.push_back({off, reinterpret_cast<float*>(dst), n});
          return NativeWork{native_work::scatter_divided(reinterpret_cast<const void*>(src), src_bf16, divisor,
                                                         std::move(out))};
        },
        py::arg("src_ptr"), py::arg("src_bf16"), py::arg("divisor"), py::arg("segments"),
        "dst = src / divisor for each (src offset in elements, fp32 dst pointer, count) segment; src fp32 or "
        "bf16. The caller keeps every buffer alive until the task ran.");

  py::class_<TaskNode, TaskHandle>(m, "TaskHandle")
      .def_property_readonly("id", &TaskNode::id)
      .def_property_readonly("name", &TaskNode::name)
      .def_property_readonly("queue", [](const TaskNode& t) { return static_cast<int>(t.queue()); })
      .def_property_readonly("state", [](const TaskNode& t) { return std::string(task_state_name(t.state())); })
      .def_property_readonly("finished", &TaskNode::finished)
      .def_property_readonly("error", &TaskNode::error)
      .def_property_readonly("submit_ns", &TaskNode::submit_ns)
      .def_property_readonly("start_ns", &TaskNode::start_ns)
      .def_property_readonly("end_ns", &TaskNode::end_ns)
      .def("wait", [](const TaskHandle& t, double timeout_s) { return Engine::wait(t, timeout_s); },
           py::arg("timeout_s") = -1.0, py::call_guard<py::gil_scoped_release>(),
           "Block until finished or timeout (s; negative: forever). Returns whether it finished.")
      .def("add_done_callback",
           [](const TaskHandle& t, py::object fn) {
             auto holder = share_py(std::move(fn));
             Engine::add_callback(t, [holder](const TaskNode&) {
               py::gil_scoped_acquire gil;
               try {
                 (*holder)();
               } catch (py::error_already_set& e) {
                 e.discard_as_unraisable("hipress task done-callback");
               }
             });
           },
           py::arg("fn"), "Call fn() (with the GIL) once the task finished, on the finishing thread.");

  py::class_<Engine, std::unique_ptr<Engine, EngineDeleter>>(m, "Engine")
      .def(py::init([](std::string timeline_path, int rank) {
             EngineOptions o;
             o.timeline_path = std::move(timeline_path);
             o.rank = rank;
             return std::unique_ptr<Engine, EngineDeleter>(new Engine(o));
           }),
           py::arg("timeline_path") = "", py::arg("rank") = 0)
      .def("submit",
           [](Engine& e, std::string name, int queue, py::object work, std::vector<TaskHandle> deps,
              uint64_t batch_key) {
             if (queue != 0 && queue != 1) throw py::value_error("queue must be 0 (compute) or 1 (comm)");
             Work w;
             if (py::isinstance<NativeWork>(work)) {
               w = work.cast<NativeWork&>().work;
             } else if (PyCallable_Check(work.ptr())) {
               w = python_work(work);
             } else {
               throw py::type_error("task work must be a callable or a hipress._C.NativeWork");
             }
             return e.submit(std::move(name), static_cast<QueueKind>(queue), std::move(w), deps, batch_key);
           },
           py::arg("name"), py::arg("queue"), py::arg("work"), py::arg("deps") = std::vector<TaskHandle>{},
           py::arg("batch_key") = 0)
      .def("submit_deferred",
           [](Engine& e, std::string name, int queue, py::object fn, std::vector<TaskHandle> deps) {
             if (queue != 0 && queue != 1) throw py::value_error("queue must be 0 (compute) or 1 (comm)");
             if (!PyCallable_Check(fn.ptr())) throw py::type_error("deferred task work must be callable");
             auto holder = share_py(std::move(fn));
             DeferredWork w = [holder](const TaskHandle& self) {
               py::gil_scoped_acquire gil;
               try {
                 (*holder)(self);
               } catch (py::error_already_set& err) {
                 throw std::runtime_error(py::str(err.type().attr("__name__")).cast<std::string>() + ": " +
                                          py::str(err.value()).cast<std::string>());
               }
             };
             return e.submit_deferred(std::move(name), static_cast<QueueKind>(queue), std::move(w), deps);
           },
           py::arg("name"), py::arg("queue"), py::arg("work"), py::arg("deps") = std::vector<TaskHandle>{},
           "work(handle) runs when ready and hands the job on; complete(handle) finishes the task later.")
      .def("complete", &Engine::complete, py::arg("task"), py::arg("ok") = true, py::arg("error") = "",
           py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &Engine::shutdown, py::arg("drain") = true, py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("is_shut_down", &Engine::is_shut_down)
      .def("counters", [](const Engine& e) { return counters_dict(e.counters()); })
      .def_property_readonly("timeline_enabled", [](Engine& e) { return e.timeline() != nullptr; })
      .def("timeline_row",
           [](Engine& e, int row, std::string name) {
             if (row < kNumQueues) throw py::value_error("rows 0 and 1 belong to the engine queues");
             if (e.timeline()) e.timeline()->name_row(row, name);
           },
           py::arg("row"), py::arg("name"), "Names an extra timeline row (>= 2) for events outside the engine.")
      .def("timeline_slice",
           [](Engine& e, int row, std::string name, int64_t start_ns, int64_t end_ns) {
             if (e.timeline()) e.timeline()->slice(row, name, start_ns, end_ns, "event");
           },
           py::arg("row"), py::arg("name"), py::arg("start_ns"), py::arg("end_ns"),
           "Adds a slice (steady-clock ns, see now_ns) to the timeline; no-op when disabled.");
}
