// ShapeCache: one budget domain. Holds the compiled entries of any number of cached
// functions, one BudgetedLru per device, each under that device's byte budget.
//
// Threading (invariant 7): every method runs with the GIL held, and no Python code runs between reading
// and updating the cache's state (entries that leave the cache are handed back to the
// caller, whose scope destroys them). That makes the GIL the cache's lock. Creating a Python
// object can run the garbage collector, whose callbacks run Python code and may release the
// GIL: so no Python object is created while walking an LRU (stats and entries copy the figures
// out first, then build Python objects).
//
// One build per bucket: a miss marks its key as building until its builder returns; another
// call that misses the same key meanwhile (another thread, or a recursive call) runs uncached
// instead of building it again.
#pragma once

#include <pybind11/pybind11.h>

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/budgeted_lru.h"
#include "core/shape_key.h"
#include "cache/entries_released.h"
#include "cache/entry_runner.h"

namespace shapecache {

namespace py = pybind11;

// Unix time in seconds, as Entry::last_use holds it.
inline double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The compiled artifact of one bucket of one cached function.
struct Entry {
  // Its build's (entries_released.h), moved in by MissPolicy::insert. First, so destroyed last:
  // the count moves once the entry's Python objects are let go, never before.
  ReleaseMark release_mark{false};
  uint64_t id = 0;            // unique in the process: how Python names an entry it rebuilds
  std::shared_ptr<EntryRunner> runner;  // serves the bucket's calls (entry_runner.h)
  // What the builder returned as the runner (a callable, or a runner bound to Python): the
  // object BuildHandle.entries() lists and the garbage collector visits.
  py::object handle;
  uint64_t function_id = 0;   // the ShapeDispatcher that built it
  std::string bucket;         // the key, readable
  std::string backend;        // what built the runner: "eager", "compile", ...
  double build_seconds = 0;   // wall time of the build, first call included
  int64_t hits = 0;           // calls served after the build
  double last_use = 0;        // unix time of the last call
  // Whether the runner was checked after its first run (its builder ran the call and
  // checked; else the miss policy checks after the first hit: MissPolicy::after_first_run).
  bool checked_after_first_run = true;
  // Its builder asked for an upgrade, not yet queued (miss_policy.h, Upgrade).
  bool wants_upgrade = false;

  // After the runner was found stale: what changed.
  std::string changed() const {
    std::string what = runner ? runner->changed() : std::string();
    return what.empty() ? "what the graph was captured from moved (its workspace, or a released graph)" : what;
  }
};

using EntryLru = BudgetedLru<ShapeKey, Entry, ShapeKeyHash>;

// Bytes a device's cache holds outside its entries, charged to the same budget.
struct SharedBytes {
  int64_t pool = 0;       // the memory pool that every graph of the device is captured into
  int64_t workspace = 0;  // the workspace arena of tuned convolutions
};

class ShapeCache : public std::enable_shared_from_this<ShapeCache> {
 public:
  // `budget_for_device(device: torch.device) -> int` resolves the byte budget of a device
  // the first time the cache sees it (fractions of a device's memory need the device).
  ShapeCache(py::object budget_for_device, int64_t max_entries);

  // The device's LRU, created on first use. May call into Python (first use only).
  EntryLru& lru(const c10::Device& device);

  // Removes every unpinned entry (of one function, or of all when `function_id` is empty).
  std::vector<EntryLru::Evicted> clear(std::optional<uint64_t> function_id = std::nullopt);

  // Evicts every unpinned entry of a device (to free memory after an out-of-memory error).
  std::vector<EntryLru::Evicted> evict_unpinned(const c10::Device& device);

  // "holds 1.2 GiB in 3 entries (1 pinned) + 512 MiB pool + 64 MiB workspace; budget 8 GiB"
  std::string describe(const c10::Device& device);

  SharedBytes shared_bytes(const c10::Device& device) {
    lru(device);
    return devices_.at(device).shared;
  }

  // The device's entries, most recently used first: (id, runner, pinned) per entry.
  py::list entries(const c10::Device& device);

  // An entry's artifact was rebuilt and holds `bytes` now; kept under the budget rule
  // (BudgetedLru::set_entry_bytes). Returns what left the cache, possibly the entry itself.
  std::vector<EntryLru::Evicted> set_entry_bytes(const c10::Device& device, uint64_t id, int64_t bytes);

  // Removes an entry unless it is pinned; returns it. None when no entry has that id.
  std::optional<EntryLru::Evicted> erase_entry(const c10::Device& device, uint64_t id);

  bool contains_entry(const c10::Device& device, uint64_t id) { return key_of(device, id).has_value(); }

  static uint64_t next_entry_id();

  void count_pool_rebuild(const c10::Device& device) {
    lru(device);
    ++devices_.at(device).pool_rebuilds;
  }

  // Charges the shared bytes of a device against its budget; may evict.
  std::vector<EntryLru::Evicted> set_shared_bytes(const c10::Device& device, SharedBytes bytes);
  // Charges them only where they and `bytes` more fit in the room the budget has free now
  // (EntryLru::fits_free_with_shared): never evicts. Returns whether it charged them.
  bool set_shared_bytes_if_free(const c10::Device& device, SharedBytes bytes, int64_t more_bytes);

  // Marks `key` as being built on `device`; false when another call is building it.
  bool begin_build(const c10::Device& device, const ShapeKey& key) {
    lru(device);
    return devices_.at(device).building.insert(key).second;
  }
  void end_build(const c10::Device& device, const ShapeKey& key) { devices_.at(device).building.erase(key); }
  // Ends a build's mark on every way out, exceptions included.
  class BuildMark {
   public:
    BuildMark(ShapeCache& cache, const c10::Device& device, const ShapeKey& key)
        : cache_(cache), device_(device), key_(key) {}
    ~BuildMark() { cache_.end_build(device_, key_); }
    BuildMark(const BuildMark&) = delete;
    BuildMark& operator=(const BuildMark&) = delete;

   private:
    ShapeCache& cache_;
    const c10::Device& device_;
    const ShapeKey& key_;
  };

  // Why an entry of `bytes` was not inserted on `device` (BudgetedLru::insert refused it),
  // for the warning; `never_fits`: it is larger than the budget leaves beside the shared bytes.
  std::string why_not_kept(const c10::Device& device, int64_t bytes, bool& never_fits);

  // Visits the Python objects the entries of one function hold (their runners and guards),
  // once per reference, for the garbage collector. Calls no Python code.
  int traverse(uint64_t function_id, visitproc visit, void* arg) const;

  // Totals, per-device figures and entries; entries of one function only when given.
  py::dict stats(std::optional<uint64_t> function_id = std::nullopt) const;

  int64_t max_entries() const { return max_entries_; }

 private:
  struct DeviceCache {
    std::unique_ptr<EntryLru> lru;
    SharedBytes shared;
    int64_t pool_rebuilds = 0;  // times every graph of the device was captured again, largest first
    std::unordered_set<ShapeKey, ShapeKeyHash> building;  // keys whose builder is running
  };

  std::optional<ShapeKey> key_of(const c10::Device& device, uint64_t id);

  py::object budget_for_device_;
  int64_t max_entries_;
  std::unordered_map<c10::Device, DeviceCache> devices_;
  std::vector<c10::Device> device_order_;  // first use first, for stable stats
};

}  // namespace shapecache
