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
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "cache/call.h"
#include "cache/call_modes.h"
#include "core/shape_key.h"

namespace shapecache {

namespace py = pybind11;

class ShapeCache;
struct BuildJob;

// What runs a job when a worker takes it: the miss policy of the function that queued it
// (miss_policy.h), which builds the entry and inserts it.
class QueuedBuildRunner {
 public:
  virtual void run_queued(BuildJob& job) = 0;

 protected:
  ~QueuedBuildRunner() = default;
};

struct BuildJob {
  // A weak reference to the cached function's Python object, which owns `runner`. The queue
  // keeps nothing alive (the collector cannot see it): a cached function that is let go of
  // cancels its jobs as it is destroyed (~MissPolicy), and a running job holds it strongly.
  py::object function_ref;
  QueuedBuildRunner* runner = nullptr;
  std::shared_ptr<ShapeCache> cache;  // where the bucket is marked as building until the job ends
  uint64_t function_id = 0;
  ShapeKey key;
  c10::Device device{c10::kCPU};
  // The call's arguments as its entry is called (padded), without the owner, with every list,
  // dict and tuple copied: the key holds their contents, and the caller may change them after
  // the call returns. Tensors are shared (a build reads their sizes, not their values).
  py::tuple args;
  // A weak reference to the owner (the module of a cached forward), or None: a queued build
  // keeps no module alive, and one whose module is gone by its turn is dropped unbuilt.
  py::object owner_ref = py::none();
  py::dict kwargs;
  py::tuple tensors;  // the call's tensors in key order (Call::tensors), for the builder's handle
  uint64_t generation = 0;  // the miss policy's clear() count when queued: a clear since drops the build
  // The caller's grad, inference and autocast modes, which the key holds: the build runs
  // under them on the worker's thread, whose own modes are its defaults.
  CallModes modes;
  // A copy of the caller's context (contextvars.copy_context()): what the call ran under that
  // Python keeps per context, not per process. Torch's configuration modules (inductor's,
  // dynamo's) keep the settings a thread makes in context variables, so a worker's thread,
  // which starts with an empty context, would build under their defaults, not the caller's.
  py::object context;
  // Whether a worker may start it: once the call that queued it has returned (or at once, for
  // queue_build). Started while its call runs, the build would compete with that call for the
  // cores, and would read state the call has not finished updating (BatchNorm's statistics).
  bool ready = false;
  // The id of the entry this job upgrades (miss_policy.h, Upgrade); 0: the bucket's first build.
  uint64_t upgrades = 0;

  // The arguments as the entry is called, the owner first where there is one; nullopt where
  // the owner was let go of (nothing will call the entry).
  std::optional<py::tuple> entry_args() const;

  // A job for `call`'s bucket: its key, device, arguments, owner, tensors and modes, as above.
  // Who runs it, for which function, generation and readiness are the queuer's to fill.
  static BuildJob of_call(const Call& call);
};

// Enters a job's context (BuildJob::context) on this thread for its lifetime, as
// `context.run` would; left on every way out. A context is entered by one thread at a time:
// each job holds a copy of its own. Needs the GIL.
class EnteredContext {
 public:
  explicit EnteredContext(const py::object& context);
  ~EnteredContext();
  EnteredContext(const EnteredContext&) = delete;
  EnteredContext& operator=(const EnteredContext&) = delete;

 private:
  py::object context_;
};

class BuildQueue {
 public:
  static BuildQueue& instance();

  // Jobs waiting per device at most. Each holds its call's inputs outside any budget, so a stream of new sizes faster than the builds must not
  // grow the queue without bound: past this, misses run uncached without queuing.
  static constexpr size_t kMaxWaiting = 64;

  // False (and nothing queued) when the device's queue is full.
  bool push(BuildJob job);

  // Runs the oldest ready job of `device` (QueuedBuildRunner::run_queued); false when none is
  // ready.
  bool run_next(const c10::Device& device);

  // The call that queued a bucket's job has returned: the job may start.
  void make_ready(uint64_t function_id, const c10::Device& device, const ShapeKey& key);
  // Every waiting job may start (sc.wait asks for them now); returns the devices with jobs.
  std::vector<c10::Device> make_all_ready();

  // Removes the waiting jobs of a function and returns them (the caller ends their build marks).
  std::vector<BuildJob> cancel(uint64_t function_id);
  // Removes the waiting job of one bucket, if any (its call failed: it builds nothing).
  std::vector<BuildJob> cancel(uint64_t function_id, const c10::Device& device, const ShapeKey& key);
  // Removes every waiting job (at interpreter exit).
  std::vector<BuildJob> cancel_all();

  // Devices with ready jobs waiting.
  std::vector<c10::Device> ready_devices() const;

  // Builds of a function waiting or running.
  int64_t pending(uint64_t function_id) const;
  // Builds waiting or running on any device.
  int64_t pending() const;

  // After fork(), in the child: no build of its parent runs there, and none it queued will.
  // Their buckets' marks end, so that their next misses queue them again.
  std::vector<BuildJob> forget_parents_builds();

 private:
  struct Running {
    uint64_t function_id;
    ShapeKey key;
    std::shared_ptr<ShapeCache> cache;
  };
  std::unordered_map<c10::Device, std::deque<BuildJob>> waiting_;
  std::unordered_map<c10::Device, Running> running_;  // the build running on each device's worker
};

}  // namespace shapecache
