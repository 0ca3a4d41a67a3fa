// EntryRunner: how an entry serves its bucket's calls. Every entry has one, so the hit path
// has one form whatever built the entry: check `valid()`, then `run(call)`. Runners built in
// Python (an eager function, Dynamo's compiled code) are a PythonRunner (python_runner.h);
// the compile backend's graphs and CUDA graphs serve calls from C++.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "cache/call.h"
#include "cache/state_guard.h"

namespace shapecache {

namespace py = pybind11;

// Thrown by run() where the runner was released between the hit's valid() and its run (a
// CUDA graph pool rebuilt by another thread, which may drop a graph once it saw it unpinned and
// before the hit pinned it): the hit serves the call as the miss of a stale entry.
class EntryReleased : public std::runtime_error {
 public:
  EntryReleased() : std::runtime_error("shapecache: the entry's runner was released before it ran") {}
};

class EntryRunner {
 public:
  virtual ~EntryRunner() = default;

  // Serves a call of the entry's bucket (its padded arguments, its tensors in key order).
  // Runs with the GIL held.
  virtual py::object run(const Call& call) = 0;

  // False once what the entry was built from is stale (state_guard.h; a workspace that
  // moved): it must be rebuilt, never run. May run Python code.
  virtual bool valid() = 0;

  // Whether a call may run it now; false: the call runs uncached, the entry stays
  // (compiled_graph_runner.h has the one case).
  virtual bool runs_now() { return true; }

  // After valid() returned false: what changed, for counters and warnings.
  virtual std::string changed() const = 0;

  // What the entry was built from (state_guard.h), or null: it depends on nothing that can change.
  virtual const std::shared_ptr<StateGuard>& guard() const = 0;
};

}  // namespace shapecache
