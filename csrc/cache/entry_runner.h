// EntryRunner: an entry that serves calls from C++ alone (a CUDA graph replay), where other
// entries call a Python callable.
#pragma once

#include <pybind11/pybind11.h>

namespace shapecache {

namespace py = pybind11;

class EntryRunner {
 public:
  virtual ~EntryRunner() = default;

  // Serves a call: `args` and `kwargs` are the call's own (padded when bucketed), without the
  // owner a method is bound to. Runs with the GIL held and calls no Python code.
  virtual py::object run(const py::tuple& args, const py::dict& kwargs) = 0;

  // False once what the entry captured is stale (weights replaced, workspace moved): it must
  // be rebuilt, never run.
  virtual bool valid() = 0;
};

}  // namespace shapecache
