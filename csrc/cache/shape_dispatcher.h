// ShapeDispatcher: a callable that serves each shape bucket of a function from its own
// compiled entry. This file holds the hot path of shapecache.
//
// A call: build the key from the arguments (C++), find the entry on the key's device, pin
// it, run it, unpin it, crop padded outputs to the plain call's sizes. A miss asks the Python
// builder for an entry (the slow path: compiling and measuring belong to Python and torch) and
// inserts the BuiltEntry it returns under the budget; a miss of a bucket that another call is
// building runs uncached (one build per bucket). An argument that cannot be keyed runs the
// call uncached, with one warning.
//
// The miss path is one-way: this class owns key -> lookup -> pin -> run -> insert; the builder
// sees the cache only through the BuildHandle it is given (build_handle.h), and returns a
// BuiltEntry. Inline, the miss waits for the build, whose first run is the call. In the
// background (build_queue.h), the miss runs the call uncached, queues the build for the
// device's worker, and the same insertion code runs there when the build ends; until then the
// bucket's calls run uncached.
//
// Before a build, room is made for an entry the size of this function's last build on the
// device (BudgetedLru::make_room_for), so a build never runs beside a full budget.
//
// Out of memory while building (invariant 3): evict the device's unpinned entries, empty
// the allocator's cache, retry once; then run the call uncached and count a fallback. Only an
// out-of-memory error of the plain uncached call reaches the user, with the cache's state.
// Any other failure falls back too: a build that fails where the plain call does not, or an
// entry that raises where the uncached call does not, leaves its bucket uncached until
// clear(), with one warning; the plain call's own exceptions reach the user as themselves.
//
// An entry is checked before each call against what it was built from (state_guard.h); a
// stale one is rebuilt, and a bucket rebuilt kInvalidationsBeforeUncached times in a row is
// given up. Inside a build or a trace, calls are transparent (they call the function).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <unordered_set>
#include <vector>

#include "core/bucket_policy.h"
#include "cache/build_handle.h"
#include "cache/build_queue.h"
#include "cache/built_entry.h"
#include "cache/call_key.h"
#include "cache/function_counters.h"
#include "cache/shape_cache.h"

namespace shapecache {

namespace py = pybind11;

class ShapeDispatcher {
 public:
  // `builder(args: tuple, kwargs: dict, handle: BuildHandle) -> BuiltEntry` builds the entry
  // of a new bucket on `handle.device`, and runs the call too when `handle.run_call`.
  // `background(device: torch.device) -> bool`, or None: whether misses on a device queue
  // their build for the device's worker instead of waiting for it (asked once per device).
  // `owner` is None, or the object a method is bound to (the nn.Module of a forward): it is
  // held through a weak reference and passed as the first argument of every call, so that
  // the owner -> cached function -> owner cycle, which the garbage collector cannot see
  // through C++, never forms. Its `training` flag joins the key when `key_training` is set.
  ShapeDispatcher(py::object function, py::object builder, std::shared_ptr<ShapeCache> cache,
                 std::vector<ArgumentBuckets> buckets, std::vector<std::string> parameter_names, py::object owner,
                 bool key_training, py::object background);

  py::object call(const py::args& args, const py::kwargs& kwargs);

  py::dict stats() const;
  // Drops this function's entries, cancels its queued builds, and drops the result of one
  // running now (its generation is then old).
  void clear();

  // Queues the build of the bucket of a call without running the call (pre-warming in the
  // background); false when the bucket has an entry, is being built, or runs uncached.
  bool queue_build(const py::args& args, const py::kwargs& kwargs);
  // Runs a queued build on the worker's thread and inserts its entry (BuildQueue::run_next).
  void run_background_build(BuildJob& job);
  int64_t pending_builds() const { return BuildQueue::instance().pending(id_); }

  // For the garbage collector (the Python type's tp_traverse and tp_clear): a compiled
  // entry's guard holds the cached module's dict, which holds this dispatcher, which holds
  // the entry through the cache, out of the collector's sight. Visiting what this
  // dispatcher and its entries hold makes the cycle visible; clearing drops the entries.
  int traverse(visitproc visit, void* arg) const;
  void clear_references();

  const py::object& function() const { return function_; }
  const std::shared_ptr<ShapeCache>& cache() const { return cache_; }
  uint64_t id() const { return id_; }

 private:
  // call() without the bookkeeping of the cached calls running on this thread.
  py::object call_here(const py::args& args, const py::kwargs& kwargs);
  // Builds the bucket's entry and inserts it (unless this function was cleared since
  // `generation`). Inline (`run_call`), returns the call's output; in the background, None.
  py::object build(const ShapeKey& key, const c10::Device& device, PyObject* args, PyObject* kwargs, bool run_call,
                   uint64_t generation);
  void insert(const ShapeKey& key, const c10::Device& device, BuiltEntry built, double seconds);
  bool builds_in_background(const c10::Device& device);
  // Marks the bucket as building and queues its build (the caller wakes the worker).
  enum class Queued { kQueued, kBusy, kFull };  // queued; being built already; the queue is full
  Queued queue(const CallKey& key, const py::tuple& call_args, PyObject* call_kwargs, bool ready);
  // After an entry's first run when its builder did not run the call (a background build):
  // if that run changed what the entry reads, the bucket runs uncached from now on.
  void check_after_first_run(const CallKey& key);
  // A hit: runs the entry; if it raises where the uncached call does not, the bucket runs
  // uncached from now on. `own_args`/`own_kwargs`: the call's (padded) arguments without the
  // owner; `call_args`: with it.
  py::object run_entry(const CallKey& key, Entry& entry, const py::tuple& own_args, const py::dict& own_kwargs,
                       const py::tuple& call_args);
  // After an entry was found stale: counts it, and after kInvalidationsBeforeUncached in a
  // row by the same change without a hit between them, gives the bucket up (`changed` names
  // what changed).
  void give_up_if_unstable(const CallKey& key, const std::string& changed);
  static bool still_valid(const Entry& entry);
  void run_uncached_from_now_on(const ShapeKey& key);
  std::optional<BuiltEntry> run_builder(const c10::Device& device, PyObject* args, PyObject* kwargs, bool run_call);
  py::object run_uncached_after_out_of_memory(const c10::Device& device, PyObject* args, PyObject* kwargs);
  py::object owner() const;
  // What a call's key is made with: this function's id and parameter names, and the owner's
  // training flag when it is keyed.
  CallContext context_of(const py::object& self) const;
  // Warns once per flag. Inline, a warning turned into an error (-W error) raises from the
  // call; in the background, where no caller would see it, it is reported as unraisable.
  void warn_once(bool& warned, const std::string& message);

  // What a padded call's outputs are cropped to (call_key.h): the plain call's size of each
  // output tensor, or none when the function cannot run on fake tensors (`reason` says why).
  struct CropPlan {
    std::optional<std::vector<std::vector<int64_t>>> shapes;
    std::string reason;
  };
  std::shared_ptr<const CropPlan> crop_plan(const CallKey& key, const py::tuple& args, const py::dict& kwargs);
  py::object run_unpadded(const py::object& self, const py::tuple& args, const py::dict& kwargs,
                          const std::string& reason);
  py::object crop(const py::object& self, const py::args& args, const py::kwargs& kwargs, const CropPlan& plan,
                  const py::object& out);
  py::object function_;
  py::object builder_;
  py::object background_;  // None, or device -> bool
  std::unordered_map<c10::Device, bool> background_by_device_;
  uint64_t generation_ = 0;  // clear() calls: a background build queued before one is dropped
  std::shared_ptr<ShapeCache> cache_;
  std::vector<ArgumentBuckets> buckets_;
  std::vector<std::string> parameter_names_;
  py::object owner_;   // None, or a weak reference to the object passed as first argument
  bool key_training_;
  uint64_t id_;
  FunctionCounters counters_;
  bool warned_unkeyable_ = false;
  bool warned_rejected_ = false;
  bool warned_out_of_memory_ = false;
  bool warned_uncroppable_ = false;
  bool warned_entry_failed_ = false;
  bool warned_build_failed_ = false;
  bool warned_unstable_ = false;
  bool warned_background_failed_ = false;
  // Crop plans by padded key and the caller's sizes of its padded dimensions. A plan costs a
  // fake-tensor run of the function, once per distinct sizes; the map is emptied when it
  // reaches kMaxKeysRemembered, so a stream of ever-new sizes cannot grow it without bound.
  static constexpr size_t kMaxKeysRemembered = 4096;
  std::unordered_map<ShapeKey, std::shared_ptr<const CropPlan>, ShapeKeyHash> crop_plans_;
  // Bytes of this function's last build per device: the estimate room is made for before the
  // next build. The last one, not the largest: sizes served together are usually alike, and
  // an overestimate evicts entries the user keeps calling.
  std::unordered_map<c10::Device, int64_t> last_build_bytes_;
  // Buckets that run uncached, not built again per call: their entry held more than the budget
  // leaves beside the shared bytes, could not be built, raised where the uncached call did
  // not, or what it reads changed before every call. Emptied by clear() (and, like the crop
  // plans, at kMaxKeysRemembered keys).
  std::unordered_set<ShapeKey, ShapeKeyHash> uncached_buckets_;
  // Invalidations of a bucket since its last hit, by the same change each time, and what that
  // change was. A bucket found stale this many times in a row by one change is given up:
  // something it reads changes on every call (a step counter in a hook). Different changes in
  // a row (a user trying settings) are not counted together.
  static constexpr int kInvalidationsBeforeUncached = 3;
  std::unordered_map<ShapeKey, std::pair<int, std::string>, ShapeKeyHash> invalidations_in_a_row_;
};

}  // namespace shapecache
