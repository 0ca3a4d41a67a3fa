// BuildHandle: all a builder may do to the cache it builds for, on the device it builds on.
// A builder is given one per build, inline or in the background, and reaches the cache
// through nothing else: it charges the bytes every entry of the device shares (a CUDA graph
// pool, a convolution workspace), and takes the steps of a pool rebuild (list the device's
// entries, drop or re-charge them). What the build returns, the dispatcher inserts.
#pragma once

#include <pybind11/pybind11.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "cache/shape_cache.h"

namespace shapecache {

namespace py = pybind11;

class BuildHandle {
 public:
  // `run_call`: whether the build is to run the call and return its output (inline), or only
  // build (in the background, where the call already ran uncached). `tensors`: the call's
  // tensors in key order (Call::tensors), the inputs a graph is traced with. `upgrading`:
  // None, or for an upgrade (miss_policy.h) the bucket's entry as it is, (backend, runner):
  // what the entry's builder returned as its runner (the function, a graph, a C++ runner).
  BuildHandle(std::shared_ptr<ShapeCache> cache, c10::Device device, bool run_call, py::tuple tensors = py::tuple(),
              py::object upgrading = py::none())
      : cache_(std::move(cache)),
        device_(device),
        run_call_(run_call),
        tensors_(std::move(tensors)),
        upgrading_(std::move(upgrading)) {}

  // As a builder gets it: `device`, `run_call`, `tensors` and `upgrading` are plain attributes
  // of the Python object, which a builder reads without a call back into C++.
  static py::object to_python(BuildHandle handle);

  // Charges the device's shared bytes; a figure not given stays as it is. May evict.
  void set_shared_bytes(std::optional<int64_t> pool, std::optional<int64_t> workspace);
  // The same where they and an entry of `bytes` fit in the room the budget has free now,
  // without evicting anything (an upgrade's graph: miss_policy.h, Upgrade); else charges
  // nothing. Returns whether it charged them.
  bool set_shared_bytes_if_free(std::optional<int64_t> pool, std::optional<int64_t> workspace, int64_t bytes);
  // Whether an entry of `bytes` fits the device's budget, after evictions; with the shared
  // bytes at `shared_bytes` where given (measured, not yet charged).
  bool could_fit(int64_t bytes, std::optional<int64_t> shared_bytes) {
    auto& lru = cache_->lru(device_);
    return shared_bytes ? lru.could_fit_with_shared(bytes, *shared_bytes) : lru.could_fit(bytes);
  }
  // The device's entries, most recently used first: (id, runner, pinned) each.
  py::list entries() { return cache_->entries(device_); }
  bool erase_entry(uint64_t id) { return cache_->erase_entry(device_, id).has_value(); }
  bool contains_entry(uint64_t id) { return cache_->contains_entry(device_, id); }
  // Re-charges a rebuilt entry; returns the ids of what left the cache.
  py::list set_entry_bytes(uint64_t id, int64_t bytes);
  size_t evict_unpinned() { return cache_->evict_unpinned(device_).size(); }
  void count_pool_rebuild() { cache_->count_pool_rebuild(device_); }

 private:
  // The device's shared bytes as charged, with the figures given in place of theirs.
  SharedBytes shared_given(std::optional<int64_t> pool, std::optional<int64_t> workspace) const;

  std::shared_ptr<ShapeCache> cache_;
  c10::Device device_;
  bool run_call_;
  py::tuple tensors_;
  py::object upgrading_;
};

}  // namespace shapecache
