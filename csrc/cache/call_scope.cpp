#include "cache/call_scope.h"

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Device.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "cache/build_queue.h"

namespace shapecache {
namespace {

struct BuildToMakeReady {
  uint64_t function_id;
  c10::Device device;
  ShapeKey key;
  py::object wake;
};

struct CachedCallsOnThisThread {
  int running = 0;
  std::vector<BuildToMakeReady> deferred;
};
thread_local CachedCallsOnThisThread cached_calls;
thread_local bool inside_build = false;
thread_local bool background_build = false;
thread_local EntriesServed* entries_served = nullptr;

void make_deferred_builds_ready() {
  if (cached_calls.deferred.empty()) return;  // almost always: nothing per call
  std::vector<BuildToMakeReady> deferred = std::move(cached_calls.deferred);
  cached_calls.deferred.clear();
  // Every build is made ready before any worker is woken: a waker that raises then strands
  // none of them (a worker that runs anyway, or sc.wait, takes them).
  for (const BuildToMakeReady& build : deferred) BuildQueue::instance().make_ready(build.function_id, build.device, build.key);
  for (const BuildToMakeReady& build : deferred) {
    if (!build.wake.is_none()) build.wake(py::reinterpret_steal<py::object>(THPDevice_New(build.device)));
  }
}

}  // namespace

CachedCallScope::CachedCallScope() { ++cached_calls.running; }

CachedCallScope::~CachedCallScope() {
  if (--cached_calls.running != 0) return;
  // A destructor must not throw: a waker that raises is reported, as the interpreter reports
  // an exception it cannot raise.
  try {
    make_deferred_builds_ready();
  } catch (py::error_already_set& error) {
    error.discard_as_unraisable("shapecache: waking a background build worker");
  }
}

void make_ready_when_outermost_returns(uint64_t function_id, const c10::Device& device, const ShapeKey& key,
                                       py::object wake) {
  cached_calls.deferred.push_back({function_id, device, key, std::move(wake)});
}

InsideBuild::InsideBuild() : outer_(inside_build) { inside_build = true; }
InsideBuild::~InsideBuild() { inside_build = outer_; }

InBackgroundBuild::InBackgroundBuild() { background_build = true; }
InBackgroundBuild::~InBackgroundBuild() { background_build = false; }
bool in_background_build() { return background_build; }

void EntriesServed::open() {
  if (open_) throw py::value_error("shapecache: this EntriesServed is open already");
  used.clear();
  built.clear();
  outer_ = entries_served;
  open_ = true;
  entries_served = this;
}

void EntriesServed::close() {
  if (!open_) return;
  if (entries_served != this) throw py::value_error("shapecache: an EntriesServed is closed on another thread, or "
                                                    "before one opened inside it");
  entries_served = outer_;
  open_ = false;
}

void note_entry_served(uint64_t id, bool built) {
  for (EntriesServed* record = entries_served; record != nullptr; record = record->outer_) {
    std::vector<uint64_t>& ids = built ? record->built : record->used;
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);  // a request uses few entries
  }
}

bool transparent_here() { return inside_build || c10::impl::TorchDispatchModeTLS::any_modes_set(); }

}  // namespace shapecache
