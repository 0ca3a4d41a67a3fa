// BuildRun: running one builder for one bucket, the part of a miss that calls into the
// backend. The builder runs inside the build scope (call_scope.h); inline, an entry the builder
// did not run is run once for the call's result; and the out-of-memory rule of a build
// (invariant 3): a build that runs out of memory evicts the device's unpinned entries, empties
// the allocator's cache and is retried once. What follows a build (insert, give up) is
// miss_policy.h's.
#pragma once

#include <pybind11/pybind11.h>

#include <c10/core/Device.h>

#include <memory>
#include <optional>

#include "cache/built_entry.h"
#include "cache/function_counters.h"
#include "cache/shape_cache.h"

namespace shapecache {

namespace py = pybind11;

// torch.OutOfMemoryError, looked up once.
const py::object& out_of_memory_type();
// A failed allocation: CUDA's torch.OutOfMemoryError, Python's MemoryError, or torch's CPU
// allocator failing (a RuntimeError that says so). Read only when something raised.
bool is_out_of_memory(py::error_already_set& error);
// A failed allocation, or an error that may be one (oneDNN's failed primitive creation): a
// build that raises one is retried; an entry that raises one raised the call's own error.
bool may_be_out_of_memory(py::error_already_set& error);

class BuildRun {
 public:
  // `builder(args, kwargs, handle: BuildHandle) -> BuiltEntry`; `release_device_memory(handle)`
  // or None: after an out-of-memory build, frees what the allocator caches on handle.device.
  BuildRun(py::object function, py::object builder, std::shared_ptr<ShapeCache> cache, FunctionCounters& counters,
           py::object release_device_memory);

  // The entry the builder made on `device` (inline, `run_call`: with the call's output);
  // nullopt where it ran out of memory twice. Any other error of the builder propagates.
  // `upgrading`: BuildHandle's (an upgrade's builder measures the entry it would replace).
  std::optional<BuiltEntry> operator()(const c10::Device& device, const py::tuple& args, const py::dict& kwargs,
                                       const py::tuple& tensors, bool run_call, py::object upgrading = py::none());

  // After the build ran out of memory twice, inline: the call uncached. Its own out-of-memory
  // error is raised with the cache's state on `device`, since the cache may be what left no room.
  py::object run_uncached(const c10::Device& device, const py::tuple& args, const py::dict& kwargs);

  // Visits the Python objects held here, for the garbage collector.
  int traverse(visitproc visit, void* arg) const;

 private:
  // Runs a new entry for the call's result (`built.output`); returns why it raised, or "".
  static std::string first_run(BuiltEntry& built, const py::tuple& args, const py::dict& kwargs,
                               const py::tuple& tensors);
  void release_device_memory(const c10::Device& device);

  py::object function_;
  py::object builder_;
  std::shared_ptr<ShapeCache> cache_;
  FunctionCounters& counters_;  // the dispatcher's
  py::object release_device_memory_;
};

}  // namespace shapecache
