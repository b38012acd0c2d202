#include <pybind11/pybind11.h>

#include "bindings/registry.h"

namespace hipress::bindings {

std::map<std::string, Binder>& registry() {
  static std::map<std::string, Binder> binders;  // function-local: safe across static init order
  return binders;
}

}  // namespace hipress::bindings

PYBIND11_MODULE(_C, m) {
  m.doc() = "hipress native core: task engine, CompLL kernels, transports (framework-agnostic C++)";
#ifdef HIPRESS_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
#ifdef HIPRESS_WITH_MPI
  m.attr("with_mpi") = true;
#else
  m.attr("with_mpi") = false;
#endif
  for (auto& [name, bind] : hipress::bindings::registry()) bind(m);
}
