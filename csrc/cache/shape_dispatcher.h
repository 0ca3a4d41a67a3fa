// ShapeDispatcher: a callable that serves each shape bucket of a function from its own
// compiled entry. This file holds the hit; every rule of a miss is in miss_policy.h.
//
// A call: make the Call from the arguments, once (call_key.h: its key, device, padded
// arguments and tensors in key order); find the bucket's entry on the call's device; pin it,
// check that its runner is still valid (state_guard.h), run it, unpin it; crop a padded
// call's outputs to the plain call's sizes (crop_plans.h). Anything else (no entry, a stale
// entry, an entry that raised, an argument that cannot be keyed) goes to the MissPolicy.
// Inside a build or a trace, calls are transparent: they call the function (call_scope.h).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/call.h"
#include "cache/call_key.h"
#include "cache/crop_plans.h"
#include "cache/function_counters.h"
#include "cache/miss_policy.h"
#include "cache/shape_cache.h"
#include "core/bucket_policy.h"

namespace shapecache {

namespace py = pybind11;

class ShapeDispatcher {
 public:
  // `builder` and `background`: as MissPolicy takes them. `owner` is None, or the object a
  // method is bound to (the nn.Module of a forward): it is held through a weak reference and
  // passed as the first argument of every call, so that the owner -> cached function -> owner
  // cycle, which the garbage collector cannot see through C++, never forms. Its `training`
  // flag joins the key when `key_training` is set. `run_on_fake_tensors`: for CropPlans.
  ShapeDispatcher(py::object function, py::object builder, std::shared_ptr<ShapeCache> cache,
                  std::vector<ArgumentBuckets> buckets, std::vector<std::string> parameter_names, py::object owner,
                  bool key_training, py::object background, MissServices services, py::object run_on_fake_tensors);

  py::object call(const py::args& args, const py::kwargs& kwargs);

  py::dict stats() const;
  // Drops this function's entries, cancels its queued builds, and drops the result of one
  // running now (its generation is then old).
  void clear();
  // Queues the build of the bucket of a call without running the call (pre-warming in the
  // background); false when the bucket has an entry, is being built, or runs uncached.
  bool queue_build(const py::args& args, const py::kwargs& kwargs);
  int64_t pending_builds() const { return miss_.pending_builds(); }

  // For the garbage collector (the Python type's tp_traverse and tp_clear): a compiled
  // entry's guard holds the cached module's dict, which holds this dispatcher, which holds
  // the entry through the cache, out of the collector's sight. Visiting what this
  // dispatcher and its entries hold makes the cycle visible; clearing drops the entries.
  int traverse(visitproc visit, void* arg) const;
  void clear_references();

  const py::object& function() const { return function_; }
  const std::shared_ptr<ShapeCache>& cache() const { return cache_; }

 private:
  py::object owner() const;
  CallContext context_of(const py::object& owner) const;

  py::object function_;
  std::shared_ptr<ShapeCache> cache_;
  std::vector<ArgumentBuckets> buckets_;
  std::vector<std::string> parameter_names_;
  py::object owner_;  // None, or a weak reference to the object passed as first argument
  bool key_training_;
  uint64_t id_;
  FunctionCounters counters_;
  CropPlans crop_plans_;
  MissPolicy miss_;
};

}  // namespace shapecache
