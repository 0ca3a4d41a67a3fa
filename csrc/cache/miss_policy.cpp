#include "cache/miss_policy.h"

#include <c10/util/Exception.h>
#include <torch/csrc/Device.h>

#include <chrono>
#include <new>
#include <utility>

#include "cache/call_key.h"
#include "cache/call_modes.h"
#include "cache/call_scope.h"
#include "cache/crop_plans.h"
#include "cache/python_call.h"

namespace shapecache {

MissPolicy::MissPolicy(py::object function, py::object builder, std::shared_ptr<ShapeCache> cache,
                       uint64_t function_id, FunctionCounters& counters, py::object background,
                       MissServices services, std::function<py::object()> self_object)
    : function_(function),
      cache_(cache),
      function_id_(function_id),
      counters_(counters),
      background_(std::move(background)),
      services_(services),
      run_build_(std::move(function), std::move(builder), std::move(cache), counters,
                 std::move(services.release_device_memory)),
      self_object_(std::move(self_object)) {
  services_.release_device_memory = py::none();  // the build run's to call (build_run.h)
}

py::object MissPolicy::serve(Call& call, bool stale) {
  if (stale) {
    ++counters_.invalidations;
    EntryLru& lru = cache_->lru(call.device);
    Entry* entry = lru.find(call.key);  // the check ran Python code: another thread may have erased it
    const std::string changed = entry != nullptr ? entry->changed() : "the entry was dropped meanwhile";
    // A call up the stack is running it: this call runs uncached, and the entry is rebuilt
    // by a later call.
    if (lru.pin_count(call.key) > 0) return cropped(call, run_uncached(call.entry_args, call.entry_kwargs));
    if (entry != nullptr) auto erased = lru.erase(call.key);
    give_up_if_unstable(call.key, changed);
  }
  if (uncached_buckets_.count(call.key) != 0) {
    // Building it again would cost a build per call and keep nothing.
    ++counters_.uncached_calls;
    return cropped(call, run_uncached(call.entry_args, call.entry_kwargs));
  }
  if (builds_in_background(call.device)) {
    switch (queue(call, /*ready=*/false)) {
      case Queued::kQueued: {
        ++counters_.misses;
        py::object out;
        try {
          // The crop is part of the call (it may run the call unpadded).
          out = cropped(call, run_uncached(call.entry_args, call.entry_kwargs));
        } catch (...) {
          // A call that fails by itself builds nothing, as inline (its own error propagates).
          auto cancelled = BuildQueue::instance().cancel(function_id_, call.device, call.key);
          throw;
        }
        make_ready_when_outermost_returns(function_id_, call.device, call.key, services_.wake_build_worker);
        return out;
      }
      case Queued::kBusy:
        ++counters_.busy_misses;
        return cropped(call, run_uncached(call.entry_args, call.entry_kwargs));
      case Queued::kFull:
        ++counters_.uncached_calls;
        return cropped(call, run_uncached(call.entry_args, call.entry_kwargs));
    }
  }
  if (!cache_->begin_build(call.device, call.key)) {
    ++counters_.busy_misses;
    return cropped(call, run_uncached(call.entry_args, call.entry_kwargs));
  }
  py::object out;
  {
    ShapeCache::BuildMark building(*cache_, call.device, call.key);
    ++counters_.misses;
    out = build(call.key, call.device, call.entry_args, call.entry_kwargs, call.tensor_tuple(), /*run_call=*/true,
                generation_);
  }
  return cropped(call, std::move(out));
}

py::object MissPolicy::cropped(const Call& call, py::object out) {
  if (!call.padded) return out;
  if (std::optional<py::object> cropped = CropPlans::crop(call, out)) return std::move(*cropped);
  return run_unpadded(call, "the padded call returned other outputs than the plain call's");
}

std::string MissPolicy::failure_of_entry(bool eager) {
  try {
    throw;
  } catch (py::error_already_set& error) {
    if (eager || !error.matches(PyExc_Exception) || error.matches(PyExc_RecursionError) ||
        may_be_out_of_memory(error)) {
      throw;
    }
    return describe_error(error);
  } catch (const c10::OutOfMemoryError&) {
    throw;  // the call's own, as a Python out-of-memory error is
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& error) {
    // A runner's own C++ error (a CUDA graph's replay, c10::Error): as any failing entry.
    return first_line(error.what());
  }
}

py::object MissPolicy::entry_failed(Call& call, const std::string& failure) {
  py::object out = run_uncached(call.entry_args, call.entry_kwargs);
  EntryLru& lru = cache_->lru(call.device);
  if (lru.pin_count(call.key) == 0) auto failed = lru.erase(call.key);
  give_up(call.key, Warning::kEntryFailed,
          "the compiled entry for " + describe_key(call.key) + " raised (" + failure + ") where the uncached call did not");
  return out;
}

void MissPolicy::after_first_run(const Call& call) {
  EntryLru& lru = cache_->lru(call.device);
  Entry* entry = lru.find(call.key);
  if (entry == nullptr || entry->checked_after_first_run) return;
  entry->checked_after_first_run = true;
  std::shared_ptr<EntryRunner> runner = entry->runner;  // the check may run Python code
  if (runner->valid()) return;
  // Its own run changed what it reads (BatchNorm's statistics in training): this run was the
  // call's one update, and its output is the answer, but every later call would find the entry
  // stale and rebuild it. As an inline build finds at its first run (build()).
  entry = lru.find(call.key);
  const std::string changed = entry != nullptr ? entry->changed() : "the entry";
  if (entry != nullptr && lru.pin_count(call.key) == 0) auto stale = lru.erase(call.key);
  give_up(call.key, Warning::kBuildFailed,
          "no entry could be kept for " + describe_key(call.key) + " (the call updates what it reads: " + changed + ")");
}

py::object MissPolicy::run_unkeyable(const py::tuple& args_with_owner, const py::dict& kwargs, const std::string& what) {
  ++counters_.uncached_calls;
  warn_once(Warning::kUnkeyable, "shapecache: " + what +
                                     " that cannot be keyed; such calls run uncached (keyed: tensors, ints, floats, "
                                     "bools, strings, None, dtypes, devices, and tuples, lists and dicts of those)");
  return run_uncached(args_with_owner, kwargs);
}

py::object MissPolicy::run_uncached_now(const Call& call) {
  ++counters_.uncached_calls;
  return run_uncached(call.entry_args, call.entry_kwargs);
}

py::object MissPolicy::run_unpadded(const Call& call, const std::string& reason) {
  ++counters_.uncached_calls;
  warn_once(Warning::kUncroppable, "shapecache: cannot tell the sizes of a padded call's outputs (" + first_line(reason) +
                                       "); calls of this function that need padding run uncached, at their own sizes");
  return run_uncached(with_owner(call.owner, call.args), call.kwargs);
}

bool MissPolicy::builds_in_background(const c10::Device& device) {
  if (background_.is_none()) return false;
  if (auto found = background_by_device_.find(device); found != background_by_device_.end()) return found->second;
  py::object device_obj = py::reinterpret_steal<py::object>(THPDevice_New(device));
  const bool background = background_(device_obj).cast<bool>();
  background_by_device_[device] = background;
  return background;
}

BuildJob MissPolicy::job_of(const Call& call) {
  BuildJob job = BuildJob::of_call(call);
  job.function_ref = py::weakref(self_object_());
  job.runner = this;
  job.cache = cache_;
  job.function_id = function_id_;
  job.generation = generation_;
  return job;
}

MissPolicy::Queued MissPolicy::queue(const Call& call, bool ready) {
  if (!cache_->begin_build(call.device, call.key)) return Queued::kBusy;
  bool pushed = false;
  try {
    BuildJob job = job_of(call);
    job.ready = ready;
    pushed = BuildQueue::instance().push(std::move(job));
  } catch (...) {  // (making the job makes Python objects: a MemoryError ends the mark too)
    cache_->end_build(call.device, call.key);
    throw;
  }
  if (!pushed) {
    cache_->end_build(call.device, call.key);
    return Queued::kFull;
  }
  return Queued::kQueued;
}

bool MissPolicy::queue_build(Call& call) {
  if (!builds_in_background(call.device) || uncached_buckets_.count(call.key) != 0) return false;
  EntryLru& lru = cache_->lru(call.device);
  if (Entry* entry = lru.find(call.key)) {
    std::shared_ptr<EntryRunner> runner = entry->runner;
    if (runner->valid() || lru.pin_count(call.key) > 0) return false;
    ++counters_.invalidations;  // stale: built again below
    auto stale = lru.erase(call.key);
  }
  if (queue(call, /*ready=*/true) != Queued::kQueued) return false;
  // No call counts it: it is not a miss of a call.
  if (!services_.wake_build_worker.is_none()) {
    services_.wake_build_worker(py::reinterpret_steal<py::object>(THPDevice_New(call.device)));
  }
  return true;
}

void MissPolicy::run_queued(BuildJob& job) {
  if (job.upgrades != 0) return run_upgrade(job);
  ShapeCache::BuildMark building(*cache_, job.device, job.key);
  if (job.generation != generation_) return;  // cleared since it was queued
  std::optional<py::tuple> args = job.entry_args();
  if (!args) return;  // the module was let go of: nothing will call this entry
  InBackgroundBuild in_background;
  EnteredContext context(job.context);
  CallModesScope modes(job.modes);
  ++counters_.background_builds;
  std::string failure;
  try {
    build(job.key, job.device, *args, job.kwargs, job.tensors, /*run_call=*/false, job.generation);
    return;
  } catch (py::error_already_set& error) {
    failure = describe_error(error);
  } catch (const std::exception& error) {  // a builder that returned something else (py::type_error)
    failure = error.what();
  }
  // No call waits for this build: whatever it raised, its bucket runs uncached, as an inline
  // build that fails where the plain call does not (unless it was cleared meanwhile).
  if (job.generation != generation_) return;
  give_up(job.key, Warning::kBackgroundFailed,
          "the background build of " + describe_key(job.key) + " failed (" + first_line(failure) + ")");
}

py::object MissPolicy::build(const ShapeKey& key, const c10::Device& device, const py::tuple& args,
                             const py::dict& kwargs, const py::tuple& tensors, bool run_call, uint64_t generation) {
  {
    auto last = last_build_bytes_.find(device);
    auto evicted = cache_->lru(device).make_room_for(last == last_build_bytes_.end() ? 0 : last->second);
  }  // what was evicted is released here, before the build allocates
  const auto start = std::chrono::steady_clock::now();
  std::optional<BuiltEntry> maybe_built = run_build_(device, args, kwargs, tensors, run_call);
  if (!maybe_built) {
    if (run_call) {
      warn_out_of_memory(device);
      return run_build_.run_uncached(device, args, kwargs);
    }
    // In the background no call waits: the bucket is built again from its next miss.
    if (generation == generation_) warn_out_of_memory(device);
    return py::none();
  }
  BuiltEntry built = std::move(*maybe_built);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  py::object output = run_call ? built.output : py::none();
  if (generation != generation_) return output;  // cleared while building: the result is dropped
  if (built.started_stale) {
    // Another thread changed what the entry reads while it was built: it is not kept, and
    // the bucket's next call builds it again (as for an entry found stale).
    ++counters_.invalidations;
    give_up_if_unstable(key, built.guard->changed());
    return output;
  }
  if (built.ran_call && built.guard && !built.guard->check()) {
    // The build's run, the call's one run, changed what the entry reads (BatchNorm's
    // statistics in training): its output is the answer, but every later call would find the
    // entry stale and build it again.
    built.runner = nullptr;
    built.failure = "the call updates what it reads: " + built.guard->changed();
  }
  if (!built.runner) {
    // Nothing could be built for the bucket (the compiler failed where the plain call did not).
    // Inline, the output is the plain call's.
    give_up(key, Warning::kBuildFailed,
            "no entry could be built for " + describe_key(key) + " (" + first_line(built.failure) + ")");
    return output;
  }
  insert(key, device, std::move(built), seconds);
  return output;
}

void MissPolicy::queue_upgrade(const Call& call, uint64_t entry_id) {
  EntryLru& lru = cache_->lru(call.device);
  Entry* entry = lru.peek(call.key);  // the run was Python code: it may be gone or rebuilt
  if (entry == nullptr || entry->id != entry_id || !entry->wants_upgrade) return;
  // Never more than half the queue: an upgrade never keeps a first build out.
  if (BuildQueue::instance().pending() >= static_cast<int64_t>(BuildQueue::kMaxWaiting / 2)) return;
  // Queued or running, its build mark keeps the bucket's later hits from asking again; the
  // entry wants its upgrade until the job starts (a job cancelled, by clear() or in a forked
  // child, is asked for again).
  if (!cache_->begin_build(call.device, call.key)) return;
  bool pushed = false;
  try {
    BuildJob job = job_of(call);
    job.upgrades = entry_id;
    pushed = BuildQueue::instance().push(std::move(job));
  } catch (...) {
    cache_->end_build(call.device, call.key);
    throw;
  }
  if (!pushed) {
    cache_->end_build(call.device, call.key);  // full: a later hit asks again
    return;
  }
  make_ready_when_outermost_returns(function_id_, call.device, call.key, services_.wake_build_worker);
}

void MissPolicy::run_upgrade(BuildJob& job) {
  InBackgroundBuild in_background;
  ShapeCache::BuildMark building(*cache_, job.device, job.key);
  if (job.generation != generation_) return;  // cleared since it was queued
  EntryLru& lru = cache_->lru(job.device);
  Entry* entry = lru.peek(job.key);  // (looking is not a use: its recency stays)
  if (entry == nullptr || entry->id != job.upgrades) return;  // gone: the bucket's next entry asks again
  entry->wants_upgrade = false;
  py::tuple upgrading = py::make_tuple(entry->backend, entry->handle);
  std::optional<py::tuple> args = job.entry_args();
  if (!args) return;
  std::optional<BuiltEntry> maybe_built;
  std::string failure;
  const auto start = std::chrono::steady_clock::now();
  {
    EnteredContext context(job.context);
    CallModesScope modes(job.modes);  // (counted in upgrades, not background_builds: that is a bucket's first build)
    try {
      maybe_built = run_build_(job.device, *args, job.kwargs, job.tensors, /*run_call=*/false, std::move(upgrading));
    } catch (py::error_already_set& error) {
      failure = describe_error(error);
    } catch (const std::exception& error) {
      failure = error.what();
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (job.generation != generation_) return;  // cleared while building: dropped
  // Kept where it was built, its measurement left its guard holding (the measurement ran it:
  // that was its first run, checked here), and it fits where the entry is. Else the bucket
  // is not tried again, but once where the model changed while it was built (a weight
  // replaced): that says nothing of whether it pays, and the entry's next hit asks again.
  // (The guard's check may run Python code: it comes before the entry is looked up again.)
  const bool stale = maybe_built && maybe_built->runner &&
                     (maybe_built->started_stale || (maybe_built->guard && !maybe_built->guard->check()));
  entry = lru.peek(job.key);  // Python ran: look again
  if (entry == nullptr || entry->id != job.upgrades) return;  // gone meanwhile: its next entry asks again
  const bool kept = failure.empty() && maybe_built && maybe_built->runner && !stale && maybe_built->bytes >= 0 &&
                    lru.fits_in_place(job.key, maybe_built->bytes);
  if (!kept) {
    ++counters_.upgrades_not_kept;
    if (stale && upgrade_retried_.insert(job.key).second) {
      entry->wants_upgrade = true;
      return;
    }
    if (upgrade_tried_.size() >= kMaxKeysRemembered) upgrade_tried_.clear();
    if (upgrade_retried_.size() >= kMaxKeysRemembered) upgrade_retried_.clear();
    upgrade_tried_.insert(job.key);
    if (!failure.empty()) {
      warn_once(Warning::kUpgradeFailed, "shapecache: the upgrade of " + describe_key(job.key) + " failed (" +
                                             first_line(failure) + "); its entry stays as it was");
    }
    return;  // what was built is released here
  }
  BuiltEntry& built = *maybe_built;
  // Every field is written before anything old is released (a release may run Python code,
  // which may erase the entry). The old runner goes when the last call running it returns (a
  // hit holds its own reference).
  std::shared_ptr<EntryRunner> old_runner = std::exchange(entry->runner, std::move(built.runner));
  py::object old_handle = std::exchange(entry->handle, std::move(built.handle));
  entry->backend = std::move(built.backend);
  entry->build_seconds += seconds;
  entry->checked_after_first_run = true;
  ++counters_.upgrades;
  auto evicted = lru.set_entry_bytes(job.key, built.bytes);  // fits in place: evicts nothing
}

void MissPolicy::warn_out_of_memory(const c10::Device& device) {
  ++counters_.fallbacks;
  warn_once(Warning::kOutOfMemory, "shapecache: building an entry on " + device.str() +
                                       " ran out of memory twice (after evicting and emptying the allocator's "
                                       "cache); such calls run uncached");
}

void MissPolicy::insert(const ShapeKey& key, const c10::Device& device, BuiltEntry built, double seconds) {
  ++counters_.builds;
  Entry entry;
  entry.id = ShapeCache::next_entry_id();
  const uint64_t id = entry.id;
  entry.runner = std::move(built.runner);
  entry.handle = std::move(built.handle);
  entry.function_id = function_id_;
  entry.bucket = describe_key(key);
  entry.backend = std::move(built.backend);
  entry.build_seconds = seconds;
  entry.last_use = unix_seconds();
  entry.checked_after_first_run = built.ran_call;
  entry.wants_upgrade = built.upgrade && upgrade_tried_.count(key) == 0;
  entry.release_mark = std::move(built.release_mark);
  const int64_t bytes = built.bytes;
  if (bytes >= 0) last_build_bytes_[device] = bytes;

  // The same key may have been built by a re-entrant call meanwhile; then `inserted` is false
  // and the existing entry stays.
  EntryLru& lru = cache_->lru(device);
  const bool present = lru.contains(key);
  auto result = lru.insert(key, std::move(entry), bytes);
  if (result.inserted && !in_background_build()) note_entry_served(id, /*built=*/true);  // the call's
  if (result.inserted || present) return;  // `result` (evicted, returned entries) is destroyed on return
  ++counters_.fallbacks;
  bool never_fits = false;
  std::string message = "shapecache: the entry for " + describe_key(key) + " was not kept: " +
                        cache_->why_not_kept(device, bytes, never_fits);
  if (never_fits) {
    remember_uncached(key);
    message += "; the bucket's calls run uncached from now on (a larger budget, or sc.clear, lets it be built again)";
  } else {
    message += "; the bucket is built again on its next call";
  }
  // The call's result is computed: the warning is reported as unraisable if it is an error.
  if (warned_.insert(Warning::kRejected).second &&
      PyErr_WarnEx(PyExc_RuntimeWarning, message.c_str(), 1) < 0) {
    PyErr_WriteUnraisable(function_.ptr());
  }
}

void MissPolicy::give_up_if_unstable(const ShapeKey& key, const std::string& changed) {
  auto& [count, last] = invalidations_in_a_row_[key];
  count = changed == last ? count + 1 : 1;
  last = changed;
  if (count < kInvalidationsBeforeUncached) return;
  invalidations_in_a_row_.erase(key);
  give_up(key, Warning::kUnstable,
          changed + " before each of the last " + std::to_string(kInvalidationsBeforeUncached) + " calls of " +
              describe_key(key) + ", so its entry was rebuilt each time",
          /*fallback=*/false);
}

void MissPolicy::give_up(const ShapeKey& key, Warning kind, const std::string& what, bool fallback) {
  if (fallback) ++counters_.fallbacks;
  remember_uncached(key);
  warn_once(kind, "shapecache: " + what + "; that bucket runs uncached from now on (sc.clear lets it be built again)");
}

void MissPolicy::remember_uncached(const ShapeKey& key) {
  if (uncached_buckets_.size() >= kMaxKeysRemembered) uncached_buckets_.clear();
  uncached_buckets_.insert(key);
}

py::object MissPolicy::run_uncached(const py::tuple& args, const py::dict& kwargs) {
  return call_python(function_, args, kwargs);
}

MissPolicy::~MissPolicy() {
  try {
    auto cancelled = BuildQueue::instance().cancel(function_id_);
  } catch (...) {  // a destructor must not throw; nothing left to cancel then
  }
}

void MissPolicy::clear() {
  ++generation_;
  auto cancelled = BuildQueue::instance().cancel(function_id_);
  uncached_buckets_.clear();
  invalidations_in_a_row_.clear();
  upgrade_tried_.clear();
  upgrade_retried_.clear();
}

int MissPolicy::traverse(visitproc visit, void* arg) const {
  Py_VISIT(function_.ptr());
  Py_VISIT(background_.ptr());
  Py_VISIT(services_.wake_build_worker.ptr());
  return run_build_.traverse(visit, arg);
}

void MissPolicy::warn_once(Warning kind, const std::string& message) {
  if (!warned_.insert(kind).second) return;
  if (PyErr_WarnEx(PyExc_RuntimeWarning, message.c_str(), 1) < 0) {
    if (!in_background_build()) throw py::error_already_set();
    PyErr_WriteUnraisable(function_.ptr());
  }
}

}  // namespace shapecache
