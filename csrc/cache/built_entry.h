// BuiltEntry: what a builder returned for a new bucket, as the miss policy inserts it.
//
// A builder returns a plain Python object (python/shapecache/_backends/entry.py, BuiltEntry),
// read here once: the builder makes no C++ object of its result. What the entry serves calls
// with and what it is guarded by are made here, when the builder has returned:
//   - the runner: a callable called as the plain function is (a PythonRunner), a graph over
//     the call's tensors in key order (a CompiledGraphRunner), or `entry_runner`, a runner
//     made in C++ already (a CUDA graph's), which holds its own guard;
//   - the guard: made from the record of what the entry depends on (guards.py). The tensors
//     of a record carry the version they were read at, so a tensor updated in place between
//     the record and now is stale;
//   - `built_from`, the guard over the live state the build started from: if it no longer
//     holds, another thread changed the model while the entry was built: the entry is stale
//     from the start (`started_stale`; miss_policy.h says what becomes of it).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cache/entries_released.h"
#include "cache/entry_runner.h"
#include "cache/state_guard.h"

namespace shapecache {

namespace py = pybind11;

struct BuiltEntry {
  // Counts one release where this is never inserted (entries_released.h). First, so destroyed
  // last: after the runner and handle below are let go.
  ReleaseMark release_mark;
  // Serves the bucket's later calls; null: nothing was built, `failure` says why, and the
  // bucket runs uncached until clear().
  std::shared_ptr<EntryRunner> runner;
  // What the builder returned as the runner (the callable, or the runner bound to Python):
  // the object BuildHandle.entries() lists and the garbage collector visits.
  py::object handle = py::none();
  int64_t bytes = 0;  // device memory the entry holds beyond what the uncached call leaves behind
  // The result of the call the build ran, when `ran_call`. A builder that did not run the call
  // (an eager entry, a compiled graph; any build in the background, where the call ran
  // uncached already) leaves it None and `ran_call` false: inline, the miss policy then runs
  // the runner for the result.
  py::object output = py::none();
  bool ran_call = true;
  std::string backend;  // what built the runner: "eager", "compile", "cuda_graph", ...
  std::shared_ptr<StateGuard> guard;  // what the entry was built from (state_guard.h), or null
  std::string failure;  // with no runner: why
  bool started_stale = false;  // `built_from` no longer held: `guard` is that guard, and says what changed
  // The builder asks for the bucket's upgrade once the entry is in (miss_policy.h, Upgrade).
  bool upgrade = false;

  // Reads what a builder returned. Raises TypeError for an object that is not a BuiltEntry and
  // ValueError for one that names neither a runner nor a failure.
  static BuiltEntry from_python(const py::handle& returned);
};

}  // namespace shapecache
