// BuiltEntry: what a builder hands the cache for a new bucket (bound as _C.BuiltEntry).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cache/state_guard.h"

namespace shapecache {

namespace py = pybind11;

struct BuiltEntry {
  // Serves the bucket's later calls (an EntryRunner serves them from C++); None: nothing was
  // built, `failure` says why, and the bucket runs uncached until clear().
  py::object runner = py::none();
  int64_t bytes = 0;  // device memory the entry holds beyond what the uncached call leaves behind
  // The result of the call the build ran, when `ran_call`. A builder that did not run the call
  // (an eager entry; any build in the background, where the call ran uncached already) leaves
  // it None and `ran_call` false: inline, the dispatcher then runs `runner` for the result.
  py::object output = py::none();
  bool ran_call = true;
  std::string backend;  // what built the runner: "eager", "compile", "cuda_graph", ...
  std::shared_ptr<StateGuard> guard;  // what the entry was built from (state_guard.h), or null
  std::string failure;  // with no runner: why
};

}  // namespace shapecache
