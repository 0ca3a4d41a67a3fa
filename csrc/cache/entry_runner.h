// EntryRunner: an entry that serves calls from C++ (a CUDA graph replay, a compiled graph
// called with the call's tensors), where other entries call a Python callable with the call.
#pragma once

#include <pybind11/pybind11.h>

namespace shapecache {

namespace py = pybind11;

class EntryRunner {
 public:
  virtual ~EntryRunner() = default;

  // Serves a call: `args` and `kwargs` are the call's own (padded when bucketed), without the
  // owner a method is bound to. Runs with the GIL held.
  virtual py::object run(const py::tuple& args, const py::dict& kwargs) = 0;

  // False once what the entry was built from is stale (state_guard.h; a workspace that moved):
  // it must be rebuilt, never run.
  virtual bool valid() = 0;
};

}  // namespace shapecache
