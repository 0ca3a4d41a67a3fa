// call_python: a Python call from C++ that raises the Python error as py::error_already_set,
// without pybind11's argument conversion (the hit and the miss paths call with a ready tuple),
// counted as a run of user code (every caller runs the user's code or an entry's runner);
// describe_error: how warnings and counters name an error that such a call raised.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "cache/trace_gate.h"

namespace shapecache {

namespace py = pybind11;

inline py::object call_python(const py::object& callable, const py::tuple& args, const py::dict& kwargs) {
  TraceGate::Run run;  // user code: kept apart from a trace that must be alone (trace_gate.h)
  PyObject* out = PyObject_Call(callable.ptr(), args.ptr(), kwargs.ptr());
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(out);
}

inline std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// "TypeName: first line of the message".
inline std::string describe_error(py::error_already_set& error) {
  return std::string(py::str(error.type().attr("__name__"))) + ": " + first_line(py::str(error.value()));
}

}  // namespace shapecache
