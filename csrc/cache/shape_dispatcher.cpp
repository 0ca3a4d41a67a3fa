#include "cache/shape_dispatcher.h"

#include <atomic>
#include <chrono>
#include <optional>
#include <utility>

#include "cache/call_scope.h"
#include "cache/python_call.h"

namespace shapecache {
namespace {

std::atomic<uint64_t> next_function_id{1};

// Pins an entry for the length of a check and a run: a pinned entry is never evicted, erased
// or cleared (budgeted_lru.h), so the entry stays where it is while Python code runs, on this
// thread or another. Unpins on every way out, exceptions included; what the unpinning evicts
// is destroyed there, with the GIL held.
class Pin {
 public:
  Pin(EntryLru& lru, const ShapeKey& key) : lru_(&lru), key_(key) { lru_->pin(key_); }
  ~Pin() { release(); }
  void release() {
    if (lru_ == nullptr) return;
    auto evicted = std::exchange(lru_, nullptr)->unpin(key_);
  }
  Pin(const Pin&) = delete;
  Pin& operator=(const Pin&) = delete;

 private:
  EntryLru* lru_;
  const ShapeKey& key_;
};

// A recursive cached function goes as deep as under a Python decorator. CPython 3.11 counts
// each level's two frames (the cached call, the function's) against one recursion limit, as
// it counts a decorator's wrapper and function. 3.12 and 3.13 count C calls against a limit
// of their own, and a level costs two of them (the call slot, and the function's frame
// entered from C) where a decorator's costs none: for the call's duration one is given back,
// so the Python limit, not the C one, ends the recursion, as for a decorated function. From
// 3.14 on, the C limit is the stack's own depth, which nothing can give back.
class RecursionAllowance {
 public:
#if PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030E0000
  RecursionAllowance() { Py_LeaveRecursiveCall(); }
  ~RecursionAllowance() {
    if (Py_EnterRecursiveCall("")) PyErr_Clear();  // restores the count it had; cannot pass the limit
  }
#else
  RecursionAllowance() = default;
#endif
  RecursionAllowance(const RecursionAllowance&) = delete;
  RecursionAllowance& operator=(const RecursionAllowance&) = delete;
};

}  // namespace

ShapeDispatcher::ShapeDispatcher(py::object function, py::object builder, std::shared_ptr<ShapeCache> cache,
                                 std::vector<ArgumentBuckets> buckets, std::vector<std::string> parameter_names,
                                 py::object owner, bool key_training, py::object background, MissServices services,
                                 py::object run_on_fake_tensors)
    : function_(std::move(function)),
      cache_(std::move(cache)),
      buckets_(std::move(buckets)),
      parameter_names_(std::move(parameter_names)),
      owner_(owner.is_none() ? py::object(py::none()) : py::object(py::weakref(owner))),
      key_training_(key_training),
      id_(next_function_id.fetch_add(1)),
      crop_plans_(function_, std::move(run_on_fake_tensors)),
      miss_(function_, std::move(builder), cache_, id_, counters_, std::move(background), std::move(services),
            [this] { return py::cast(this, py::return_value_policy::reference); }) {
  if (!PyCallable_Check(function_.ptr())) {
    throw py::type_error(std::string("cached: expected a callable, got ") + Py_TYPE(function_.ptr())->tp_name);
  }
  if (!cache_) throw py::value_error("cached: cache must not be None");
}

// The hit, and the turns to the miss policy.
py::object ShapeDispatcher::call(const py::args& args, const py::kwargs& kwargs) {
  CachedCallScope scope;  // builds queued inside are ready once the outermost cached call ends
  [[maybe_unused]] RecursionAllowance allowance;  // empty but on 3.12 and 3.13
  py::object self = owner();
  if (transparent_here()) return call_python(function_, with_owner(self, args), kwargs);
  ++counters_.calls;
  std::optional<Call> made;
  try {
    made.emplace(make_call(context_of(self), self, args, kwargs, buckets_));
  } catch (const UnkeyableArgument& e) {
    return miss_.run_unkeyable(with_owner(self, args), kwargs, e.what());
  }
  Call& call = *made;
  if (call.padded) {
    call.crop_plan = crop_plans_.plan_for(call);
    if (!call.crop_plan->shapes) return miss_.run_unpadded(call, call.crop_plan->reason);
  }
  EntryLru& lru = cache_->lru(call.device);
  Entry* entry = lru.find(call.key);
  if (entry == nullptr) return miss_.serve(call, /*stale=*/false);
  Pin pin(lru, call.key);
  // Read together, before the check runs Python code (an upgrade may swap the runner meanwhile).
  std::shared_ptr<EntryRunner> runner = entry->runner;
  const bool eager = entry->backend == "eager";
  const bool first_run_unchecked = !entry->checked_after_first_run;
  const uint64_t upgrade = entry->wants_upgrade ? entry->id : 0;
  if (!runner->valid()) {
    pin.release();
    return miss_.serve(call, /*stale=*/true);
  }
  if (!runner->runs_now()) {
    pin.release();
    return miss_.cropped(call, miss_.run_uncached_now(call));
  }
  ++counters_.hits;
  ++entry->hits;
  entry->last_use = unix_seconds();
  note_entry_served(entry->id, /*built=*/false);
  miss_.note_hit(call.key);
  py::object out;
  try {
    out = runner->run(call);
  } catch (const EntryReleased&) {  // released by another thread's pool rebuild since valid()
    pin.release();
    return miss_.serve(call, /*stale=*/true);
  } catch (...) {
    const std::string failure = MissPolicy::failure_of_entry(eager);  // rethrows the call's own errors
    pin.release();
    return miss_.cropped(call, miss_.entry_failed(call, failure));
  }
  pin.release();
  if (first_run_unchecked) miss_.after_first_run(call);  // unpinned now: a stale entry can go
  if (upgrade != 0) miss_.queue_upgrade(call, upgrade);
  return miss_.cropped(call, std::move(out));
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

CallContext ShapeDispatcher::context_of(const py::object& owner) const {
  CallContext context;
  context.function_id = id_;
  context.parameter_names = &parameter_names_;
  if (key_training_ && !owner.is_none()) {
    const int training = PyObject_IsTrue(owner.attr("training").ptr());
    if (training < 0) throw py::error_already_set();
    context.training = training;
  }
  return context;
}

bool ShapeDispatcher::queue_build(const py::args& args, const py::kwargs& kwargs) {
  if (transparent_here()) return false;
  py::object self = owner();
  Call call = make_call(context_of(self), self, args, kwargs, buckets_);  // UnkeyableArgument reaches the caller
  return miss_.queue_build(call);
}

py::dict ShapeDispatcher::stats() const {
  py::dict out = cache_->stats(id_);
  counters_.for_each([&](const char* name, int64_t value) { out[name] = value; });
  out["pending_builds"] = pending_builds();
  return out;
}

void ShapeDispatcher::clear() {
  miss_.clear();
  cache_->clear(id_);
  crop_plans_.clear();
}

int ShapeDispatcher::traverse(visitproc visit, void* arg) const {
  Py_VISIT(function_.ptr());
  Py_VISIT(owner_.ptr());
  if (int result = miss_.traverse(visit, arg)) return result;
  if (int result = crop_plans_.traverse(visit, arg)) return result;
  return cache_ ? cache_->traverse(id_, visit, arg) : 0;
}

void ShapeDispatcher::clear_references() {
  // Pinned entries stay (a call is running them, so this dispatcher is not garbage then).
  if (cache_) auto dropped = cache_->clear(id_);
  crop_plans_.clear();
  // Its queued builds are cancelled when it is destroyed (~MissPolicy).
}

}  // namespace shapecache
