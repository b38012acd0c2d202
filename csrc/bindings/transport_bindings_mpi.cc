// Python face of the native MPI transport (hipress/comm/transport/mpi.py wraps it).
// Buffers arrive as (address, bytes); every call that waits releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "bindings/registry.h"
#include "transport/mpi_transport.h"

namespace py = pybind11;
using hipress::mpi::Comm;

namespace {
void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }
}  // namespace

HIPRESS_BINDINGS(transport_mpi, m) {
  // Raised as MpiTransportError(op, message, peers): the Python layer turns it into
  // hipress.comm.transport.base.TransportError.
  static py::exception<hipress::mpi::TransportError> exc(m, "MpiTransportError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hipress::mpi::TransportError& e) {
      py::tuple args = py::make_tuple(e.op, std::string(e.what()), e.peers);
      PyErr_SetObject(exc.ptr(), args.ptr());
    }
  });

  m.def("mpi_init", &hipress::mpi::ensure_initialized,
        "Initialize MPI (THREAD_MULTIPLE requested) unless already done; returns the thread level provided.");
  m.def("mpi_we_initialized", &hipress::mpi::we_initialized);
  m.def("mpi_finalize_if_owned", &hipress::mpi::finalize_if_owned, py::call_guard<py::gil_scoped_release>());
  m.def("mpi_thread_level", &hipress::mpi::thread_level);
  m.attr("MPI_THREAD_SERIALIZED") = static_cast<int>(MPI_THREAD_SERIALIZED);
  m.attr("MPI_THREAD_MULTIPLE") = static_cast<int>(MPI_THREAD_MULTIPLE);

  py::class_<Comm>(m, "MpiComm", "Private duplicate of an MPI communicator; byte-buffer operations with timeouts.")
      .def_static("world", [] { return Comm::dup_of(MPI_COMM_NULL); }, py::call_guard<py::gil_scoped_release>())
      .def_static("from_fortran",
                  [](int64_t f) { return Comm::dup_of(MPI_Comm_f2c(static_cast<MPI_Fint>(f))); },
                  py::arg("fortran_handle"), py::call_guard<py::gil_scoped_release>(),
                  "Duplicate the communicator whose Fortran handle is given (mpi4py: comm.py2f()).")
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("size", &Comm::size)
      .def_property_readonly("broken", &Comm::broken)
      .def("fortran_handle", [](const Comm& c) { return static_cast<int64_t>(MPI_Comm_c2f(c.handle())); })
      .def("send", [](Comm& c, uintptr_t b, size_t n, int dst, int tag, double t) { c.send(ptr(b), n, dst, tag, t); },
           py::call_guard<py::gil_scoped_release>())
      .def("recv", [](Comm& c, uintptr_t b, size_t n, int src, int tag, double t) { c.recv(ptr(b), n, src, tag, t); },
           py::call_guard<py::gil_scoped_release>())
      .def("sendrecv",
           [](Comm& c, uintptr_t sb, size_t sn, int dst, uintptr_t rb, size_t rn, int src, int tag, double t) {
             c.sendrecv(sb ? ptr(sb) : nullptr, sn, dst, rb ? ptr(rb) : nullptr, rn, src, tag, t);
           },
           py::call_guard<py::gil_scoped_release>())
      .def("exchange",
           [](Comm& c, const std::vector<std::tuple<uintptr_t, size_t, int>>& sends,
              const std::vector<std::tuple<uintptr_t, size_t, int>>& recvs, int tag, double t) {
             auto legs = [](const std::vector<std::tuple<uintptr_t, size_t, int>>& v) {
               std::vector<Comm::Leg> out;
               for (const auto& [b, n, peer] : v) out.push_back({b, n, peer});
               return out;
             };
             c.exchange(legs(sends), legs(recvs), tag, t);
           },
           "(buffer address, bytes, peer) sends and receives, all posted at once, then waited for.",
           py::call_guard<py::gil_scoped_release>())
      .def("alltoallv",
           [](Comm& c, uintptr_t sb, std::vector<size_t> sc, uintptr_t rb, std::vector<size_t> rc, double t, bool p2p) {
             c.alltoallv(ptr(sb), sc, ptr(rb), rc, t, p2p);
           },
           py::call_guard<py::gil_scoped_release>())
      .def("allgather", [](Comm& c, uintptr_t sb, size_t n, uintptr_t rb, double t) { c.allgather(ptr(sb), n, ptr(rb), t); },
           py::call_guard<py::gil_scoped_release>())
      .def("allgatherv",
           [](Comm& c, uintptr_t sb, size_t n, uintptr_t rb, std::vector<size_t> rc, double t) {
             c.allgatherv(ptr(sb), n, ptr(rb), rc, t);
           },
           py::call_guard<py::gil_scoped_release>())
      .def("bcast", [](Comm& c, uintptr_t b, size_t n, int root, double t) { c.bcast(ptr(b), n, root, t); },
           py::call_guard<py::gil_scoped_release>())
      .def("allreduce_f32",
           [](Comm& c, uintptr_t b, size_t n, double t) { c.allreduce_f32(static_cast<float*>(ptr(b)), n, t); },
           py::call_guard<py::gil_scoped_release>())
      .def("barrier", &Comm::barrier, py::call_guard<py::gil_scoped_release>())
      .def("split", &Comm::split, py::arg("color"), py::arg("key"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("free", &Comm::free, py::call_guard<py::gil_scoped_release>())
      .def("abort", &Comm::abort, py::arg("code") = 1, py::call_guard<py::gil_scoped_release>());
}
