// call_python: a Python call from C++ that raises the Python error as py::error_already_set,
// without pybind11's argument conversion (the hit and the miss paths call with a ready tuple).
#pragma once

#include <pybind11/pybind11.h>

namespace shapecache {

namespace py = pybind11;

inline py::object call_python(const py::object& callable, const py::tuple& args, const py::dict& kwargs) {
  PyObject* out = PyObject_Call(callable.ptr(), args.ptr(), kwargs.ptr());
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(out);
}

}  // namespace shapecache
