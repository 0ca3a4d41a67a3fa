#include "cache/shape_dispatcher.h"

#include <pybind11/stl.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Device.h>

#include <atomic>
#include <chrono>
#include <sstream>

namespace shapecache {
namespace {

std::atomic<uint64_t> next_function_id{1};

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

py::object call_python(PyObject* callable, PyObject* args, PyObject* kwargs) {
  PyObject* out = PyObject_Call(callable, args, kwargs);
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(out);
}

// Unpins on every way out of a run, exceptions included. The pinned entry cannot have been
// removed meanwhile, so the key is still there to unpin.
class PinGuard {
 public:
  PinGuard(EntryLru& lru, const ShapeKey& key) : lru_(lru), key_(key) { lru_.pin(key_); }
  // What the unpinning evicts (budgeted_lru.h) is destroyed here, with the GIL held.
  ~PinGuard() { auto evicted = lru_.unpin(key_); }
  PinGuard(const PinGuard&) = delete;
  PinGuard& operator=(const PinGuard&) = delete;

 private:
  EntryLru& lru_;
  const ShapeKey& key_;
};

// Ends a build's mark on every way out, exceptions included.
class BuildGuard {
 public:
  BuildGuard(ShapeCache& cache, const c10::Device& device, const ShapeKey& key)
      : cache_(cache), device_(device), key_(key) {}
  ~BuildGuard() { cache_.end_build(device_, key_); }
  BuildGuard(const BuildGuard&) = delete;
  BuildGuard& operator=(const BuildGuard&) = delete;

 private:
  ShapeCache& cache_;
  const c10::Device& device_;
  const ShapeKey& key_;
};

// The cached calls running on this thread, and the background builds that calls inside them
// queued: those are ready once the outermost cached call returns (BuildJob::ready), since the
// call that asked for them is, for the caller, still running. Touched with the GIL held only.
struct BuildToMakeReady {
  uint64_t function_id;
  c10::Device device;
  ShapeKey key;
  std::shared_ptr<ShapeCache> cache;
};
struct CachedCallsOnThisThread {
  int running = 0;
  std::vector<BuildToMakeReady> deferred;
};
thread_local CachedCallsOnThisThread cached_calls;

class CachedCall {
 public:
  CachedCall() { ++cached_calls.running; }
  ~CachedCall() { --cached_calls.running; }
  CachedCall(const CachedCall&) = delete;
  CachedCall& operator=(const CachedCall&) = delete;
  bool outermost() const { return cached_calls.running == 1; }
};

void make_deferred_builds_ready() {
  if (cached_calls.deferred.empty()) return;  // almost always: nothing per call
  std::vector<BuildToMakeReady> deferred = std::move(cached_calls.deferred);
  cached_calls.deferred.clear();
  for (const BuildToMakeReady& build : deferred) {
    BuildQueue::instance().make_ready(build.function_id, build.device, build.key);
    build.cache->wake_build_worker(build.device);
  }
}

// torch.OutOfMemoryError, looked up once.
const py::object& out_of_memory_type() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> storage;
  return storage.call_once_and_store_result([] { return py::module_::import("torch").attr("OutOfMemoryError"); }).get_stored();
}

// A failed allocation: CUDA's torch.OutOfMemoryError, Python's MemoryError, or torch's CPU
// allocator failing, which raises a plain RuntimeError ("[enforce fail at alloc_cpu.cpp]
// DefaultCPUAllocator: can't allocate memory", also inside the errors torch.compile wraps it
// in). Read only when a call raised.
bool runtime_error_says(py::error_already_set& error, const char* text) {
  return error.matches(PyExc_RuntimeError) && std::string(py::str(error.value())).find(text) != std::string::npos;
}

bool is_out_of_memory(py::error_already_set& error) {
  return error.matches(out_of_memory_type()) || error.matches(PyExc_MemoryError) ||
         runtime_error_says(error, "DefaultCPUAllocator: can't allocate memory");
}

// A failed allocation, or an error that may be one: oneDNN reports a failed allocation while
// creating a primitive (its JIT code, its scratchpad) as "could not create a primitive", the
// text of every failed creation (dnnl.hpp wraps dnnl_primitive_create's status in it, and
// torch keeps only the text). Under a data-segment limit a convolution of a new size raises
// it where the next size raises the allocator's own error. A build that raises it is retried
// once after making room, like an out-of-memory build; only a definite one is reported to the
// user as out of memory.
bool may_be_out_of_memory(py::error_already_set& error) {
  return is_out_of_memory(error) || runtime_error_says(error, "could not create a primitive");
}

// `args` with the owner in front, when there is one.
py::tuple with_owner(const py::object& self, const py::tuple& args) {
  if (self.is_none()) return args;
  const Py_ssize_t n = PyTuple_GET_SIZE(args.ptr());
  py::tuple out(n + 1);
  PyTuple_SET_ITEM(out.ptr(), 0, self.inc_ref().ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(args.ptr(), i);
    Py_INCREF(item);
    PyTuple_SET_ITEM(out.ptr(), i + 1, item);
  }
  return out;
}

// `value` with every list, dict and tuple in it copied, and everything else shared: what a
// queued build keeps of its call, whose key holds those containers' contents while the
// caller may change them once the call has returned.
py::object copy_containers(py::handle value) {
  PyObject* v = value.ptr();
  if (PyList_CheckExact(v)) {
    py::list out;
    for (py::handle item : py::reinterpret_borrow<py::list>(value)) out.append(copy_containers(item));
    return out;
  }
  if (PyTuple_CheckExact(v)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(v);
    py::tuple out(n);
    for (Py_ssize_t i = 0; i < n; ++i) PyTuple_SET_ITEM(out.ptr(), i, copy_containers(PyTuple_GET_ITEM(v, i)).release().ptr());
    return out;
  }
  if (PyDict_CheckExact(v)) {
    py::dict out;
    for (auto [k, item] : py::reinterpret_borrow<py::dict>(value)) out[k] = copy_containers(item);
    return out;
  }
  return py::reinterpret_borrow<py::object>(value);
}

// Set while a builder or a crop plan's fake-tensor run is on this thread's stack: cached
// functions they reach (a cached submodule, recursion) are transparent. They call the
// original and build nothing, so no entry is built from the fake tensors of a trace, and a
// captured or traced call is one graph, not graphs inside a graph.
thread_local bool inside_build = false;

// Set while this thread runs a background build: no caller is there to see a warning raised
// as an error.
thread_local bool in_background_build = false;

class InsideBuild {
 public:
  InsideBuild() : outer_(inside_build) { inside_build = true; }
  ~InsideBuild() { inside_build = outer_; }
  InsideBuild(const InsideBuild&) = delete;
  InsideBuild& operator=(const InsideBuild&) = delete;

 private:
  bool outer_;
};

// Whether this call is part of a trace: inside a build, or under a dispatch mode (the fake
// and functional modes of torch.export and AOT autograd, a proxy mode, a debug mode), where
// tensors are not what an entry could run on.
bool transparent_here() { return inside_build || c10::impl::TorchDispatchModeTLS::any_modes_set(); }

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

std::string describe_error(py::error_already_set& error) {
  return std::string(py::str(error.type().attr("__name__"))) + ": " + first_line(py::str(error.value()));
}

// CPython 3.11 counts C calls against the recursion limit together with Python frames, and
// a call of a cached function is two of them before its frame (the instance's tp_call, then
// pybind11's method call): a recursive cached function reached a third of the plain depth,
// where any Python decorator reaches half. For the call's duration one of the two is given
// back, so each level costs what a decorator's does. From 3.12 on, the limit counts Python
// frames only (C calls have their own, larger one), and nothing is given back.
class RecursionAllowance {
 public:
#if PY_VERSION_HEX < 0x030C0000
  RecursionAllowance() { Py_LeaveRecursiveCall(); }
  ~RecursionAllowance() {
    if (Py_EnterRecursiveCall("")) PyErr_Clear();  // restores the count it had; cannot pass the limit
  }
#endif
  RecursionAllowance(const RecursionAllowance&) = delete;
  RecursionAllowance& operator=(const RecursionAllowance&) = delete;
};

}  // namespace


ShapeDispatcher::ShapeDispatcher(py::object function, py::object builder, std::shared_ptr<ShapeCache> cache,
                               std::vector<ArgumentBuckets> buckets, std::vector<std::string> parameter_names,
                               py::object owner, bool key_training, py::object background)
    : function_(std::move(function)),
      builder_(std::move(builder)),
      background_(std::move(background)),
      cache_(std::move(cache)),
      buckets_(std::move(buckets)),
      parameter_names_(std::move(parameter_names)),
      owner_(owner.is_none() ? py::object(py::none()) : py::object(py::weakref(owner))),
      key_training_(key_training),
      id_(next_function_id.fetch_add(1)) {
  if (!PyCallable_Check(function_.ptr())) {
    throw py::type_error(std::string("cached: expected a callable, got ") + Py_TYPE(function_.ptr())->tp_name);
  }
  if (!cache_) throw py::value_error("cached: cache must not be None");
}

py::object ShapeDispatcher::owner() const {
  if (owner_.is_none()) return py::none();
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* strong = nullptr;
  if (PyWeakref_GetRef(owner_.ptr(), &strong) < 0) throw py::error_already_set();
  py::object alive = strong ? py::reinterpret_steal<py::object>(strong) : py::object(py::none());
#else
  py::object alive = py::reinterpret_borrow<py::object>(PyWeakref_GetObject(owner_.ptr()));
#endif
  if (alive.is_none()) {
    PyErr_SetString(PyExc_ReferenceError, "shapecache: the object this cached method belongs to no longer exists");
    throw py::error_already_set();
  }
  return alive;
}

CallContext ShapeDispatcher::context_of(const py::object& self) const {
  CallContext context;
  context.function_id = id_;
  context.parameter_names = &parameter_names_;
  if (key_training_ && !self.is_none()) {
    const int training = PyObject_IsTrue(self.attr("training").ptr());
    if (training < 0) throw py::error_already_set();
    context.training = training;
  }
  return context;
}

py::object ShapeDispatcher::call(const py::args& args, const py::kwargs& kwargs) {
  CachedCall running;
  if (!running.outermost()) return call_here(args, kwargs);
  py::object out;
  try {
    out = call_here(args, kwargs);
  } catch (...) {
    make_deferred_builds_ready();  // the calls that queued them succeeded
    throw;
  }
  make_deferred_builds_ready();
  return out;
}

py::object ShapeDispatcher::call_here(const py::args& args, const py::kwargs& kwargs) {
  RecursionAllowance allowance;
  if (transparent_here()) return call_python(function_.ptr(), with_owner(owner(), args).ptr(), kwargs.ptr());
  ++counters_.calls;
  py::object self = owner();
  const CallContext context = context_of(self);

  CallKey key;
  try {
    key = make_call_key(context, args, kwargs, buckets_);
  } catch (const UnkeyableArgument& e) {
    ++counters_.uncached_calls;
    warn_once(warned_unkeyable_, std::string("shapecache: ") + e.what() +
                                     " that cannot be keyed; such calls run uncached (keyed: tensors, ints, floats, "
                                     "bools, strings, None, dtypes, devices, and tuples, lists and dicts of those)");
    return call_python(function_.ptr(), with_owner(self, args).ptr(), kwargs.ptr());
  }
  std::shared_ptr<const CropPlan> plan;
  if (key.padded) {
    plan = crop_plan(key, with_owner(self, args), kwargs);
    if (!plan->shapes) return run_unpadded(self, args, kwargs, plan->reason);
  }
  py::tuple call_args = with_owner(self, key.padded ? key.args : static_cast<const py::tuple&>(args));
  PyObject* call_kwargs = key.padded ? key.kwargs.ptr() : kwargs.ptr();

  EntryLru& lru = cache_->lru(key.device);
  py::object out;
  Entry* entry = lru.find(key.key);
  if (entry != nullptr && !still_valid(*entry)) {
    // What the entry was built from changed (state_guard.h): it must not run. Rebuild it (or,
    // if a call up the stack is running it, run this call uncached).
    ++counters_.invalidations;
    entry = lru.find(key.key);  // the check may have let another thread erase it
    const std::string changed = entry != nullptr ? entry->changed() : "the entry was dropped meanwhile";
    if (lru.pin_count(key.key) > 0) {
      out = call_python(function_.ptr(), call_args.ptr(), call_kwargs);
      return key.padded ? crop(self, args, kwargs, *plan, out) : out;
    }
    if (entry != nullptr) auto stale = lru.erase(key.key);
    entry = nullptr;
    give_up_if_unstable(key, changed);
  } else if (entry != nullptr) {
    entry = lru.find(key.key);  // the check may have let another thread erase it
  }
  if (entry != nullptr) {
    out = run_entry(key, *entry, key.padded ? key.args : static_cast<const py::tuple&>(args),
                    key.padded ? key.kwargs : static_cast<const py::dict&>(kwargs), call_args);
  } else if (uncached_buckets_.count(key.key) != 0) {
    // Its entry cannot fit the budget, could not be built, or what it reads changes on every
    // call: building it again would cost a build per call and keep nothing.
    ++counters_.uncached_calls;
    out = call_python(function_.ptr(), call_args.ptr(), call_kwargs);
  } else if (builds_in_background(key.device)) {
    // The build is queued for the device's worker (unless it is queued or running already);
    // this call, and the bucket's calls until the entry is in, run uncached. The job is ready
    // once this call, and any cached call it runs inside, has returned (BuildJob::ready): a
    // worker busy with other builds does not start it while the call that asked for it runs.
    switch (queue(key, call_args, call_kwargs, /*ready=*/false)) {
      case Queued::kQueued:
        ++counters_.misses;
        try {
          out = call_python(function_.ptr(), call_args.ptr(), call_kwargs);
          if (key.padded) out = crop(self, args, kwargs, *plan, out);  // part of the call: it may run it unpadded
        } catch (...) {
          // A call that fails by itself builds nothing, as inline (its own error propagates).
          auto cancelled = BuildQueue::instance().cancel(id_, key.device, key.key);
          throw;
        }
        cached_calls.deferred.push_back({id_, key.device, key.key, cache_});  // ready when the outermost returns
        return out;
      case Queued::kBusy:
        ++counters_.busy_misses;
        out = call_python(function_.ptr(), call_args.ptr(), call_kwargs);
        break;
      case Queued::kFull:
        ++counters_.uncached_calls;
        out = call_python(function_.ptr(), call_args.ptr(), call_kwargs);
        break;
    }
  } else if (!cache_->begin_build(key.device, key.key)) {
    // Another call is building this bucket (another thread, or this call's own caller).
    ++counters_.busy_misses;
    out = call_python(function_.ptr(), call_args.ptr(), call_kwargs);
  } else {
    BuildGuard building(*cache_, key.device, key.key);
    ++counters_.misses;
    out = build(key.key, key.device, call_args.ptr(), call_kwargs, /*run_call=*/true, generation_);
  }
  return key.padded ? crop(self, args, kwargs, *plan, out) : out;
}

py::object ShapeDispatcher::crop(const py::object& self, const py::args& args, const py::kwargs& kwargs,
                                 const CropPlan& plan, const py::object& out) {
  if (std::optional<py::object> cropped = crop_outputs(out, *plan.shapes)) return std::move(*cropped);
  return run_unpadded(self, args, kwargs, "the padded call returned other outputs than the plain call's");
}

py::object ShapeDispatcher::run_entry(const CallKey& key, Entry& entry, const py::tuple& own_args,
                                      const py::dict& own_kwargs, const py::tuple& call_args) {
  PyObject* call_kwargs = own_kwargs.ptr();
  ++counters_.hits;
  ++entry.hits;
  entry.last_use = unix_seconds();
  if (!invalidations_in_a_row_.empty()) invalidations_in_a_row_.erase(key.key);
  // Copied before the run: calls it makes may insert entries, which can move `entry`.
  py::object runner = entry.runner;
  std::shared_ptr<EntryRunner> native = entry.native;
  const bool eager = entry.backend == "eager";
  const bool first_run_unchecked = !entry.checked_after_first_run;
  EntryLru& lru = cache_->lru(key.device);
  std::optional<py::error_already_set> failure;
  py::object ran;
  {
    PinGuard pinned(lru, key.key);
    try {
      ran = native ? native->run(own_args, own_kwargs) : call_python(runner.ptr(), call_args.ptr(), call_kwargs);
    } catch (py::error_already_set& error) {
      // The call's own to report: an eager entry's error (it is the plain call), an
      // interrupt, out of memory, or the recursion limit (which a second run would reach
      // again at every level of a recursive function).
      if (eager || !error.matches(PyExc_Exception) || error.matches(PyExc_RecursionError) ||
          may_be_out_of_memory(error)) {
        throw;
      }
      failure = std::move(error);
    }
  }
  if (!failure) {
    if (first_run_unchecked) check_after_first_run(key);  // unpinned now: a stale entry can go
    return ran;
  }
  // The entry raised. The uncached call tells whose error it is: if it raises too, it is the
  // call's own (its exception propagates, the entry stays); if not, the entry was wrong for
  // this bucket, which runs uncached from now on (invariant 3: a failure falls back).
  py::object out = call_python(function_.ptr(), call_args.ptr(), call_kwargs);
  ++counters_.fallbacks;
  if (lru.pin_count(key.key) == 0) auto failed = lru.erase(key.key);
  run_uncached_from_now_on(key.key);
  warn_once(warned_entry_failed_, "shapecache: the compiled entry for " + describe_key(key.key) + " raised (" +
                                      describe_error(*failure) +
                                      ") where the uncached call did not; that bucket runs uncached from now on "
                                      "(sc.clear lets it be built again)");
  return out;
}

void ShapeDispatcher::check_after_first_run(const CallKey& key) {
  Entry* entry = cache_->lru(key.device).find(key.key);
  if (entry == nullptr || entry->checked_after_first_run) return;
  entry->checked_after_first_run = true;
  if (still_valid(*entry)) return;
  // Its own run changed what it reads (BatchNorm's statistics in training): this run was the
  // call's one update, and its output is the answer, but every later call would find the entry
  // stale and rebuild it. As an inline build finds at its first run (compile.py).
  EntryLru& lru = cache_->lru(key.device);
  entry = lru.find(key.key);  // the check may run Python code
  const std::string changed = entry != nullptr ? entry->changed() : "the entry";
  if (entry != nullptr && lru.pin_count(key.key) == 0) auto stale = lru.erase(key.key);
  ++counters_.fallbacks;
  run_uncached_from_now_on(key.key);
  warn_once(warned_build_failed_, "shapecache: no entry could be kept for " + describe_key(key.key) +
                                      " (the call updates what it reads: " + changed +
                                      "); that bucket runs uncached from now on (sc.clear lets it be built again)");
}

bool ShapeDispatcher::still_valid(const Entry& entry) {
  // The check may run Python code (a dict key's __eq__), which may let another thread clear
  // the cache: what it reads is kept alive here, not through the entry.
  std::shared_ptr<EntryRunner> native = entry.native;
  std::shared_ptr<StateGuard> guard = entry.guard;
  if (native) return native->valid();
  return !guard || guard->check();
}

void ShapeDispatcher::give_up_if_unstable(const CallKey& key, const std::string& changed) {
  auto& [count, last] = invalidations_in_a_row_[key.key];
  count = changed == last ? count + 1 : 1;
  last = changed;
  if (count < kInvalidationsBeforeUncached) return;
  invalidations_in_a_row_.erase(key.key);
  run_uncached_from_now_on(key.key);
  warn_once(warned_unstable_, "shapecache: " + changed + " before each of the last " +
                                  std::to_string(kInvalidationsBeforeUncached) + " calls of " + describe_key(key.key) +
                                  ", so its entry was rebuilt each time; that bucket runs uncached from now on "
                                  "(sc.clear lets it be built again)");
}

void ShapeDispatcher::run_uncached_from_now_on(const ShapeKey& key) {
  if (uncached_buckets_.size() >= kMaxKeysRemembered) uncached_buckets_.clear();
  uncached_buckets_.insert(key);
}

std::shared_ptr<const ShapeDispatcher::CropPlan> ShapeDispatcher::crop_plan(const CallKey& key, const py::tuple& args,
                                                                            const py::dict& kwargs) {
  // Invariant 4 for padded buckets. The plan's key: the bucket, and which dimensions were
  // padded from which sizes: calls of one bucket padded in different dimensions (1x4 and 3x1 in a bucket of 3x4) return different shapes.
  ShapeKey plan_key = key.key;
  for (const CropDim& c : key.crop) {
    plan_key.add_int(c.argument);
    plan_key.add_int(c.dim);
    plan_key.add_int(c.original);
  }
  if (auto found = crop_plans_.find(plan_key); found != crop_plans_.end()) return found->second;
  auto plan = std::make_shared<CropPlan>();
  const py::object& fake_call = cache_->run_on_fake_tensors();
  if (fake_call.is_none()) {
    plan->reason = "the cache was made without run_on_fake_tensors";
  } else {
    try {
      InsideBuild planning;
      py::object outputs = fake_call(function_, args, kwargs);
      // Sizes in the order crop_outputs will meet the real outputs: the same walk.
      std::vector<std::vector<int64_t>> shapes;
      map_tensors(outputs, [&](const at::Tensor& t) {
        shapes.push_back(t.sizes().vec());
        return t;
      });
      plan->shapes = std::move(shapes);
    } catch (py::error_already_set& error) {
      if (!error.matches(PyExc_Exception)) throw;  // KeyboardInterrupt, SystemExit
      plan->reason = describe_error(error);
    } catch (const py::type_error& error) {  // an output map_tensors cannot walk
      plan->reason = std::string("TypeError: ") + error.what();
    }
  }
  if (crop_plans_.size() >= kMaxKeysRemembered) crop_plans_.clear();
  return crop_plans_.emplace(std::move(plan_key), std::move(plan)).first->second;
}

py::object ShapeDispatcher::run_unpadded(const py::object& self, const py::tuple& args, const py::dict& kwargs,
                                         const std::string& reason) {
  ++counters_.uncached_calls;
  warn_once(warned_uncroppable_, "shapecache: cannot tell the sizes of a padded call's outputs (" +
                                     reason.substr(0, reason.find('\n')) +
                                     "); calls of this function that need padding run uncached, at their own sizes");
  return call_python(function_.ptr(), with_owner(self, args).ptr(), kwargs.ptr());
}

bool ShapeDispatcher::builds_in_background(const c10::Device& device) {
  if (background_.is_none()) return false;
  if (auto found = background_by_device_.find(device); found != background_by_device_.end()) return found->second;
  py::object device_obj = py::reinterpret_steal<py::object>(THPDevice_New(device));
  const bool background = background_(device_obj).cast<bool>();
  background_by_device_[device] = background;
  return background;
}

ShapeDispatcher::Queued ShapeDispatcher::queue(const CallKey& key, const py::tuple& call_args, PyObject* call_kwargs,
                                               bool ready) {
  if (!cache_->begin_build(key.device, key.key)) return Queued::kBusy;
  BuildJob job;
  job.dispatcher = py::cast(this, py::return_value_policy::reference);
  job.function_id = id_;
  job.key = key.key;
  job.device = key.device;
  job.args = copy_containers(call_args).cast<py::tuple>();
  job.kwargs = copy_containers(py::reinterpret_borrow<py::dict>(call_kwargs)).cast<py::dict>();
  job.generation = generation_;
  job.modes = CallModes::of_this_thread(key.device.type());
  job.ready = ready;
  if (!BuildQueue::instance().push(std::move(job))) {
    cache_->end_build(key.device, key.key);
    return Queued::kFull;
  }
  return Queued::kQueued;  // the caller wakes the worker once the job is ready
}

bool ShapeDispatcher::queue_build(const py::args& args, const py::kwargs& kwargs) {
  if (transparent_here()) return false;
  py::object self = owner();
  const CallContext context = context_of(self);
  CallKey key = make_call_key(context, args, kwargs, buckets_);  // UnkeyableArgument reaches the caller
  if (!builds_in_background(key.device) || uncached_buckets_.count(key.key) != 0) return false;
  EntryLru& lru = cache_->lru(key.device);
  if (Entry* entry = lru.find(key.key)) {
    if (still_valid(*entry) || lru.pin_count(key.key) > 0) return false;
    ++counters_.invalidations;  // stale: built again below
    auto stale = lru.erase(key.key);
  }
  py::tuple call_args = with_owner(self, key.padded ? key.args : static_cast<const py::tuple&>(args));
  if (queue(key, call_args, key.padded ? key.kwargs.ptr() : kwargs.ptr(), /*ready=*/true) != Queued::kQueued) {
    return false;
  }
  cache_->wake_build_worker(key.device);  // no call counts it: it is not a miss of a call
  return true;
}

void ShapeDispatcher::run_background_build(BuildJob& job) {
  BuildGuard building(*cache_, job.device, job.key);
  if (job.generation != generation_) return;  // cleared since it was queued
  struct InBackground {
    InBackground() { in_background_build = true; }
    ~InBackground() { in_background_build = false; }
  } in_background;
  CallModesScope modes(job.modes);
  ++counters_.background_builds;
  std::string failure;
  try {
    build(job.key, job.device, job.args.ptr(), job.kwargs.ptr(), /*run_call=*/false, job.generation);
    return;
  } catch (py::error_already_set& error) {
    failure = describe_error(error);
  } catch (const std::exception& error) {  // a builder that returned something else (py::type_error)
    failure = error.what();
  }
  // No call waits for this build: whatever it raised, its bucket runs uncached, as an inline
  // build that fails where the plain call does not (unless it was cleared meanwhile).
  if (job.generation != generation_) return;
  ++counters_.fallbacks;
  run_uncached_from_now_on(job.key);
  warn_once(warned_background_failed_, "shapecache: the background build of " + describe_key(job.key) + " failed (" +
                                           first_line(failure) +
                                           "); that bucket runs uncached from now on (sc.clear lets it be built again)");
}

py::object ShapeDispatcher::build(const ShapeKey& key, const c10::Device& device, PyObject* args, PyObject* kwargs,
                                  bool run_call, uint64_t generation) {
  {
    auto last = last_build_bytes_.find(device);
    auto evicted = cache_->lru(device).make_room_for(last == last_build_bytes_.end() ? 0 : last->second);
  }  // what was evicted is released here, before the build allocates
  const auto start = std::chrono::steady_clock::now();
  std::optional<BuiltEntry> maybe_built = run_builder(device, args, kwargs, run_call);
  if (!maybe_built) {
    if (run_call) return run_uncached_after_out_of_memory(device, args, kwargs);
    // In the background no call waits: the bucket is built again from its next miss.
    if (generation != generation_) return py::none();
    ++counters_.fallbacks;
    warn_once(warned_out_of_memory_, "shapecache: building an entry on " + device.str() +
                                         " ran out of memory twice (after evicting and emptying the allocator's "
                                         "cache); such calls run uncached");
    return py::none();
  }
  BuiltEntry built = std::move(*maybe_built);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  py::object output = run_call ? built.output : py::none();
  if (generation != generation_) return output;  // cleared while building: the result is dropped
  if (built.runner.is_none()) {
    // Nothing could be built for the bucket (the compiler failed where the plain call did not):
    // the bucket runs uncached until clear(). Inline, the output is the plain call's.
    ++counters_.fallbacks;
    run_uncached_from_now_on(key);
    warn_once(warned_build_failed_, "shapecache: no entry could be built for " + describe_key(key) + " (" +
                                        first_line(built.failure) +
                                        "); that bucket runs uncached from now on (sc.clear lets it be built again)");
    return output;
  }
  insert(key, device, std::move(built), seconds);
  return output;
}

void ShapeDispatcher::insert(const ShapeKey& key, const c10::Device& device, BuiltEntry built, double seconds) {
  ++counters_.builds;
  Entry entry;
  entry.id = ShapeCache::next_entry_id();
  entry.runner = std::move(built.runner);
  if (py::isinstance<EntryRunner>(entry.runner)) entry.native = entry.runner.cast<std::shared_ptr<EntryRunner>>();
  entry.guard = std::move(built.guard);
  entry.function_id = id_;
  entry.bucket = describe_key(key);
  entry.backend = std::move(built.backend);
  entry.build_seconds = seconds;
  entry.last_use = unix_seconds();
  entry.checked_after_first_run = built.ran_call;
  const int64_t bytes = built.bytes;
  if (bytes >= 0) last_build_bytes_[device] = bytes;

  // The same key may have been built by a re-entrant call meanwhile; then `inserted` is false
  // and the existing entry stays.
  EntryLru& lru = cache_->lru(device);
  const bool present = lru.contains(key);
  auto result = lru.insert(key, std::move(entry), bytes);
  if (result.inserted || present) return;  // `result` (evicted, returned entries) is destroyed on return
  ++counters_.fallbacks;
  std::ostringstream message;
  message << "shapecache: the entry for " << describe_key(key) << " was not kept: ";
  const bool never_fits = bytes > lru.budget_bytes() - lru.shared_bytes();
  if (bytes > lru.budget_bytes() - lru.shared_bytes() - lru.pinned_bytes()) {
    message << "it holds " << bytes << " bytes, more than the budget of " << lru.budget_bytes()
            << " bytes leaves after " << lru.pinned_bytes() << " bytes of running entries and " << lru.shared_bytes()
            << " shared bytes";
  } else {
    message << "all " << lru.pinned_count() << " entries on " << device
            << " are running, and max_entries=" << lru.max_entries() << " leaves no room beside them";
  }
  if (never_fits) {
    run_uncached_from_now_on(key);
    message << "; the bucket's calls run uncached from now on (a larger budget, or sc.clear, lets it be built "
               "again)";
  } else {
    message << "; the bucket is built again on its next call";
  }
  // A warning turned into an error (-W error) must not turn the call's computed result into an
  // exception: it is reported as unraisable instead.
  if (!warned_rejected_) {
    warned_rejected_ = true;
    if (PyErr_WarnEx(PyExc_RuntimeWarning, message.str().c_str(), 1) < 0) PyErr_WriteUnraisable(function_.ptr());
  }
}

std::optional<BuiltEntry> ShapeDispatcher::run_builder(const c10::Device& device, PyObject* args, PyObject* kwargs,
                                                       bool run_call) {
  py::object handle = py::cast(BuildHandle(cache_, device, run_call));
  for (int attempt = 0;; ++attempt) {
    try {
      py::object result;
      {
        InsideBuild building;
        result = builder_(py::reinterpret_borrow<py::tuple>(args), py::reinterpret_borrow<py::dict>(kwargs), handle);
      }
      if (!py::isinstance<BuiltEntry>(result)) {
        throw py::type_error(std::string("shapecache: a builder must return a shapecache BuiltEntry, got ") +
                             Py_TYPE(result.ptr())->tp_name);
      }
      BuiltEntry built = result.cast<BuiltEntry>();
      // An entry whose builder did not run the call (eager) is run here, once the builder has
      // returned, so that a recursive cached function costs the interpreter's recursion limit
      // one Python frame per level, as any decorator does, and not the builder's frame too.
      if (run_call && !built.ran_call && !built.runner.is_none()) {
        built.output = call_python(built.runner.ptr(), args, kwargs);
        built.ran_call = true;
      }
      return built;
    } catch (py::error_already_set& error) {
      if (!may_be_out_of_memory(error)) throw;
    }  // the error, and the traceback that holds the failed build's tensors, are released here
    if (attempt == 1) return std::nullopt;
    ++counters_.oom_retries;
    cache_->release_device_memory(device);
  }
}

py::object ShapeDispatcher::run_uncached_after_out_of_memory(const c10::Device& device, PyObject* args,
                                                            PyObject* kwargs) {
  ++counters_.fallbacks;
  warn_once(warned_out_of_memory_, "shapecache: building an entry on " + device.str() +
                                       " ran out of memory twice (after evicting and emptying the allocator's "
                                       "cache); such calls run uncached");
  try {
    return call_python(function_.ptr(), args, kwargs);
  } catch (py::error_already_set& error) {
    if (!is_out_of_memory(error)) throw;
    const std::string state = "shapecache: " + cache_->describe(device) +
                              ". Building an entry ran out of memory twice, so the call ran uncached, and the "
                              "uncached call ran out of memory too: the model does not fit beside what the cache holds";
    py::raise_from(error, out_of_memory_type().ptr(), state.c_str());
    throw py::error_already_set();
  }
}

py::dict ShapeDispatcher::stats() const {
  py::dict out = cache_->stats(id_);
  counters_.for_each([&](const char* name, int64_t value) { out[name] = value; });
  out["pending_builds"] = pending_builds();
  return out;
}

int ShapeDispatcher::traverse(visitproc visit, void* arg) const {
  Py_VISIT(function_.ptr());
  Py_VISIT(builder_.ptr());
  Py_VISIT(owner_.ptr());
  return cache_ ? cache_->traverse(id_, visit, arg) : 0;
}

void ShapeDispatcher::clear_references() {
  // Pinned entries stay (a call is running them, so this dispatcher is not garbage then).
  if (cache_) auto dropped = cache_->clear(id_);
  crop_plans_.clear();
  // Nothing queued holds it (a queued job keeps its dispatcher alive): nothing to cancel.
}

void ShapeDispatcher::clear() {
  ++generation_;
  auto cancelled = BuildQueue::instance().cancel(id_);
  cache_->clear(id_);
  crop_plans_.clear();
  uncached_buckets_.clear();
  invalidations_in_a_row_.clear();
}

void ShapeDispatcher::warn_once(bool& warned, const std::string& message) {
  if (warned) return;
  warned = true;
  if (PyErr_WarnEx(PyExc_RuntimeWarning, message.c_str(), 1) < 0) {
    if (!in_background_build) throw py::error_already_set();
    PyErr_WriteUnraisable(function_.ptr());
  }
}

}  // namespace shapecache
