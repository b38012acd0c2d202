// Each seam adds its Python bindings from its own file with HIPRESS_BINDINGS,
// so adding a seam never edits a central list: module.cc runs every
// registered binder, in name order, when hipress._C is imported.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <map>
#include <string>

namespace hipress::bindings {

using Binder = std::function<void(pybind11::module_&)>;

std::map<std::string, Binder>& registry();

struct Registrar {
  Registrar(const char* name, Binder binder) { registry().emplace(name, std::move(binder)); }
};

}  // namespace hipress::bindings

#define HIPRESS_BINDINGS(name, module_var)                                                     \
  static void hipress_bind_##name(pybind11::module_& module_var);                              \
  static ::hipress::bindings::Registrar hipress_registrar_##name(#name, hipress_bind_##name); \
  static void hipress_bind_##name(pybind11::module_& module_var)
