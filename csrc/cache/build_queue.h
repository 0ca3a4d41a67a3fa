// BuildQueue: the background builds waiting for their device's worker, process-wide, in the
// order they were asked for. One worker thread per device (python/shapecache/_build_workers.py)
// runs them one at a time: the slow part of a miss (export, inductor) happens there while the
// caller's calls of that bucket run uncached.
//
// A bucket is queued at most once: its key stays marked as building in its cache
// (ShapeCache::begin_build) from the miss that queued it until its build ends or is cancelled.
//
// Threading: every method runs with the GIL held, which is the queue's lock, as it is the
// cache's; the worker waits for work in Python with the GIL released. Jobs hold Python
// objects, so they are created, moved out and destroyed only with the GIL held.
#pragma once

#include <pybind11/pybind11.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <unordered_map>
#include <vector>

#include "cache/call_modes.h"
#include "core/shape_key.h"

namespace shapecache {

namespace py = pybind11;

class ShapeDispatcher;

struct BuildJob {
  py::object dispatcher;  // the ShapeDispatcher's Python object: kept alive until the job ends
  uint64_t function_id = 0;
  ShapeKey key;
  c10::Device device{c10::kCPU};
  py::tuple args;   // the call's arguments as its entry is called (padded, owner first)
  py::dict kwargs;  // (a copy: the caller may change its dict after the call)
  uint64_t generation = 0;  // the dispatcher's clear() count when queued: a clear since drops the build
  // The caller's grad, inference and autocast modes, which the key holds: the build runs
  // under them on the worker's thread, whose own modes are its defaults.
  CallModes modes;
};

class BuildQueue {
 public:
  static BuildQueue& instance();

  void push(BuildJob job);

  // Runs the oldest job of `device` (ShapeDispatcher::run_background_build); false when none waits.
  bool run_next(const c10::Device& device);

  // Removes the waiting jobs of a function and returns them (the caller ends their build marks).
  std::vector<BuildJob> cancel(uint64_t function_id);
  // Removes every waiting job (at interpreter exit).
  std::vector<BuildJob> cancel_all();

  // Builds of a function waiting or running.
  int64_t pending(uint64_t function_id) const;
  // Builds waiting or running on any device.
  int64_t pending() const;

  // After fork(): the child has no worker, so no build of its parent runs in it.
  void forget_running() { running_.clear(); }

 private:
  std::unordered_map<c10::Device, std::deque<BuildJob>> waiting_;
  std::unordered_map<c10::Device, uint64_t> running_;  // device -> function id of the build running there
};

}  // namespace shapecache
