// MissPolicy: what happens to a call that no valid entry serves, for one cached function.
// Every rule of a miss is here; the hit is in shape_dispatcher.cpp, the budget rule in
// core/budgeted_lru.h.
//
// Rules:
//   - Inline (the default): the miss builds its bucket's entry and waits for it; the build's
//     first run is the call. One build per bucket: a miss of a bucket another call is building
//     (another thread, or this call's own caller) runs uncached ("busy").
//   - Background (build="background", where the backend lets builds leave the caller's
//     thread): the miss runs the call uncached, then queues the build for the device's worker
//     (build_queue.h). The job is ready once the outermost cached call on the thread has
//     returned (call_scope.h); a call that raises builds nothing. A full queue runs the call
//     uncached without queuing. Until the entry is in, the bucket's calls run uncached. A
//     queued build holds its cached function and module weakly: a function let go of cancels
//     its builds, and one whose module is gone by its turn is dropped.
//   - Room first: before a build, room is made for an entry the size of this function's last
//     build on the device (BudgetedLru::make_room_for), so a build never runs beside a full
//     budget.
//   - Out of memory while building (invariant 3): evict the device's unpinned entries, empty
//     the allocator's cache, retry once; then run the call uncached. Only an out-of-memory
//     error of the plain uncached call reaches the user, with the cache's state.
//   - Insert: under the budget rule. An entry larger than the budget leaves beside the shared
//     bytes is not kept and its bucket is given up; one that does not fit beside running
//     entries is built again on its next call.
//   - Stale (invariant 5): an entry whose runner is no longer valid is erased and rebuilt; if
//     a call up the stack is running it, this call runs uncached instead. An entry stale
//     when built (another thread changed what it reads during the build: built_entry.h) is
//     not inserted; the bucket's next call builds it again.
//   - Given up: a bucket runs uncached until clear(), with one warning, when its build failed
//     where the plain call did not, its entry raised where the plain call did not, its entry
//     can never fit, it was found stale kInvalidationsBeforeUncached times in a row by the
//     same change, or its first run made it stale (the call updates what it reads: checked
//     right after an inline build, at the first hit of an entry built without running the
//     call). The plain call's own exceptions reach the user as themselves.
//   - Upgrade (backend="auto", upgrade=True): an entry whose builder asks for it
//     (BuiltEntry.upgrade) wants an upgrade until the upgrade starts; its first hit queues a
//     second build of its bucket for the device's worker, whatever build= says, ready once
//     that call has returned (a size called once is never compiled; a job cancelled, by
//     clear() or in a forked child, is asked for again by the next hit). Upgrades take at most half the queue (a first build
//     always has room); one that finds no room is asked for again by the next hit. Its builder
//     is given the entry as it is (BuildHandle.upgrading), compiles the bucket and measures
//     the forms (python/shapecache/_backends/upgrade.py; on CUDA the compiled graph captured
//     too, whose growth of the pool it charges only where the pool and the new form fit in the
//     budget's free room: BuildHandle::set_shared_bytes_if_free). Meanwhile the entry serves the
//     bucket's calls, and the bucket is marked as building (one build per bucket: were the
//     entry evicted, its calls run uncached until the upgrade ends). What it returns replaces
//     the entry in place (its pins and recency kept: an upgrade is not a use; a call running
//     the old runner finishes with it) where the new form's guard still holds after its
//     measurement and its added bytes fit in the budget's free room: an upgrade never evicts.
//     Where its builder found it not faster, or refused or failed to build it, the entry
//     stays as it is and the bucket is not upgraded again until clear(); where the model
//     changed while it was built, its entry's next hit asks once more. Where the entry it
//     upgrades is gone (evicted, stale, cleared), the upgrade is dropped, and the bucket's
//     next entry asks again.
//   - Transparent: inside a build or a trace nothing is built (call_scope.h).
//   - Warnings: each kind once per function. Inline, a warning turned into an error (-W error)
//     raises from the call; in the background, where no caller would see it, it is reported
//     as unraisable; a rejected insertion's warning never turns a computed result into an error.
#pragma once

#include <pybind11/pybind11.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "cache/build_queue.h"
#include "cache/build_run.h"
#include "cache/built_entry.h"
#include "cache/call.h"
#include "cache/function_counters.h"
#include "cache/shape_cache.h"

namespace shapecache {

namespace py = pybind11;

// What a miss calls into Python for, each None or a callable.
struct MissServices {
  // release_device_memory(handle: BuildHandle): after an out-of-memory build, frees what the
  // allocator caches on handle.device and charges the shared bytes it leaves.
  py::object release_device_memory = py::none();
  // wake_build_worker(device: torch.device): a queued build is ready for the device's worker.
  py::object wake_build_worker = py::none();
};

class MissPolicy : public QueuedBuildRunner {
 public:
  // `builder(args: tuple, kwargs: dict, handle: BuildHandle) -> BuiltEntry` builds the entry
  // of a new bucket on `handle.device`, and runs the call too when `handle.run_call`.
  // `background(device: torch.device) -> bool`, or None: whether misses on a device queue
  // their build for the device's worker (asked once per device). `self_object()` returns the
  // cached function's Python object, which a queued job refers to weakly.
  MissPolicy(py::object function, py::object builder, std::shared_ptr<ShapeCache> cache, uint64_t function_id,
             FunctionCounters& counters, py::object background, MissServices services,
             std::function<py::object()> self_object);
  // Cancels the builds it queued: the queue holds the cached function weakly, and `this` is
  // what its jobs run.
  ~MissPolicy();

  // Serves a call whose bucket has no entry, or (`stale`) an entry found not valid, which the
  // caller has unpinned. Returns the output as the caller gets it (cropped, when padded).
  py::object serve(Call& call, bool stale);
  // `out` of a padded call cropped to the plain call's sizes (CropPlans), or where it cannot
  // be, the call run unpadded; `out` itself when nothing was padded.
  py::object cropped(const Call& call, py::object out);

  // A hit: the bucket is not being invalidated call after call.
  void note_hit(const ShapeKey& key) {
    if (!invalidations_in_a_row_.empty()) invalidations_in_a_row_.erase(key);
  }
  // Called in a catch block, where running an entry for a call raised: rethrows what is the
  // call's own to report (an eager entry's error, since an eager entry is the plain call; an
  // interrupt; out of memory; the recursion limit, which a second run would reach again at
  // every level of a recursive function); else returns the failure, named, for entry_failed.
  static std::string failure_of_entry(bool eager);
  // The entry raised `failure` where it was run for `call` (its pin released): the uncached
  // call tells whose error it is. Its own: it propagates and the entry stays. Not: the bucket
  // is given up, and the uncached call's output is returned.
  py::object entry_failed(Call& call, const std::string& failure);
  // After the first run of an entry built without running the call.
  void after_first_run(const Call& call);
  // After a hit of entry `entry_id`, which wanted an upgrade when the hit began (Entry::
  // wants_upgrade): queues the upgrade (the Upgrade rule).
  void queue_upgrade(const Call& call, uint64_t entry_id);

  // Calls that run uncached without a try: an argument that cannot be keyed (`what`), a padded
  // call whose outputs cannot be cropped (`reason`), a call whose entry cannot run now
  // (EntryRunner::runs_now).
  py::object run_uncached_now(const Call& call);
  py::object run_unkeyable(const py::tuple& args_with_owner, const py::dict& kwargs, const std::string& what);
  py::object run_unpadded(const Call& call, const std::string& reason);

  // Queues the build of a call's bucket without running the call (pre-warming in the
  // background); false when the bucket has an entry, is being built, or runs uncached.
  bool queue_build(Call& call);
  // On the worker's thread: builds a queued job's entry and inserts it, or upgrades the
  // bucket's entry (the Upgrade rule).
  void run_queued(BuildJob& job) override;
  int64_t pending_builds() const { return BuildQueue::instance().pending(function_id_); }

  // Forgets what was decided about buckets and drops queued and running builds (their
  // generation is old from now on).
  void clear();
  // Visits the Python objects held here, for the garbage collector.
  int traverse(visitproc visit, void* arg) const;

 private:
  enum class Warning { kUnkeyable, kRejected, kOutOfMemory, kUncroppable, kEntryFailed, kBuildFailed, kUnstable,
                       kBackgroundFailed, kUpgradeFailed };
  enum class Queued { kQueued, kBusy, kFull };  // queued; being built already; the queue is full

  bool builds_in_background(const c10::Device& device);
  // A job of `call`'s bucket run by this policy, in its current generation (BuildJob::of_call).
  BuildJob job_of(const Call& call);
  Queued queue(const Call& call, bool ready);
  // Builds the bucket's entry (build_run.h) and inserts it (unless cleared since `generation`).
  // Inline (`run_call`), returns the call's output; in the background, None.
  py::object build(const ShapeKey& key, const c10::Device& device, const py::tuple& args, const py::dict& kwargs,
                   const py::tuple& tensors, bool run_call, uint64_t generation);
  // Builds the bucket's compiled form and puts it in place of the entry `job` upgrades.
  void run_upgrade(BuildJob& job);
  // A build ran out of memory twice: a fallback, with its one warning.
  void warn_out_of_memory(const c10::Device& device);
  void insert(const ShapeKey& key, const c10::Device& device, BuiltEntry built, double seconds);
  void give_up_if_unstable(const ShapeKey& key, const std::string& changed);
  // The bucket runs uncached until clear(), with the kind's one warning: `what` happened, and
  // that bucket runs uncached from now on. `fallback`: this call fell back (it is counted).
  void give_up(const ShapeKey& key, Warning kind, const std::string& what, bool fallback = true);
  void remember_uncached(const ShapeKey& key);
  py::object run_uncached(const py::tuple& args, const py::dict& kwargs);
  void warn_once(Warning kind, const std::string& message);

  py::object function_;
  std::shared_ptr<ShapeCache> cache_;
  uint64_t function_id_;
  FunctionCounters& counters_;  // the dispatcher's
  py::object background_;       // None, or device -> bool
  MissServices services_;
  BuildRun run_build_;
  std::function<py::object()> self_object_;
  std::unordered_map<c10::Device, bool> background_by_device_;
  uint64_t generation_ = 0;  // clear() calls: a build started or queued before one is dropped
  std::unordered_set<Warning> warned_;
  // Buckets given up (see the rules). Emptied by clear(), and at kMaxKeysRemembered keys.
  static constexpr size_t kMaxKeysRemembered = 4096;
  std::unordered_set<ShapeKey, ShapeKeyHash> uncached_buckets_;
  // Invalidations of a bucket since its last hit, by the same change each time, and what that
  // change was. Different changes in a row (a user trying settings) are not counted together.
  static constexpr int kInvalidationsBeforeUncached = 3;
  std::unordered_map<ShapeKey, std::pair<int, std::string>, ShapeKeyHash> invalidations_in_a_row_;
  // Buckets whose upgrade was built and not kept (the Upgrade rule): not tried again until
  // clear(). Emptied at kMaxKeysRemembered keys.
  std::unordered_set<ShapeKey, ShapeKeyHash> upgrade_tried_;
  // Buckets whose upgrade found the model changed while it was built, and was asked for again.
  std::unordered_set<ShapeKey, ShapeKeyHash> upgrade_retried_;
  // Bytes of this function's last build per device: the estimate room is made for before the
  // next build. The last one, not the largest: sizes served together are usually alike, and
  // an overestimate evicts entries the user keeps calling.
  std::unordered_map<c10::Device, int64_t> last_build_bytes_;
};

}  // namespace shapecache
