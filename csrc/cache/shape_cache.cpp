#include "cache/shape_cache.h"

#include "cache/cache_figures.h"
#include "cache/python_runner.h"

#include <torch/csrc/Device.h>

#include <atomic>
#include <sstream>
#include <tuple>

namespace shapecache {

ShapeCache::ShapeCache(py::object budget_for_device, int64_t max_entries)
    : budget_for_device_(std::move(budget_for_device)), max_entries_(max_entries) {
  if (max_entries < 0) {
    throw py::value_error("max_entries must be a non-negative int or None, got " + std::to_string(max_entries));
  }
}

EntryLru& ShapeCache::lru(const c10::Device& device) {
  auto it = devices_.find(device);
  if (it != devices_.end()) return *it->second.lru;
  py::object device_obj = py::reinterpret_steal<py::object>(THPDevice_New(device));
  const int64_t budget = budget_for_device_(device_obj).cast<int64_t>();
  // Python may have re-entered and created it meanwhile.
  it = devices_.find(device);
  if (it != devices_.end()) return *it->second.lru;
  DeviceCache created;
  created.lru = std::make_unique<EntryLru>(budget, max_entries_);
  device_order_.push_back(device);
  return *devices_.emplace(device, std::move(created)).first->second.lru;
}

std::vector<EntryLru::Evicted> ShapeCache::clear(std::optional<uint64_t> function_id) {
  std::vector<EntryLru::Evicted> removed;
  for (auto& [device, cache] : devices_) {
    if (!function_id) {
      auto all = cache.lru->clear();
      std::move(all.begin(), all.end(), std::back_inserter(removed));
      continue;
    }
    std::vector<ShapeKey> keys;
    cache.lru->for_each([&](const ShapeKey& key, const Entry& entry, int64_t, int) {
      if (entry.function_id == *function_id) keys.push_back(key);
    });
    for (const ShapeKey& key : keys) {
      if (auto gone = cache.lru->erase(key)) removed.push_back(std::move(*gone));
    }
  }
  return removed;
}

std::vector<EntryLru::Evicted> ShapeCache::evict_unpinned(const c10::Device& device) {
  return lru(device).evict_unpinned();
}

std::string ShapeCache::describe(const c10::Device& device) {
  EntryLru& entries = lru(device);
  const SharedBytes& shared = devices_.at(device).shared;
  int64_t pinned = 0;
  entries.for_each([&](const ShapeKey&, const Entry&, int64_t, int pins) { pinned += pins > 0 ? 1 : 0; });
  std::ostringstream out;
  out << "the cache on " << device << " holds " << entries.entry_bytes() << " bytes in " << entries.size()
      << " entries (" << pinned << " pinned) + " << shared.pool << " bytes of graph pool + " << shared.workspace
      << " bytes of workspace; budget ";
  if (entries.budget_bytes() == EntryLru::kUnlimited) {
    out << "unlimited";
  } else {
    out << entries.budget_bytes() << " bytes";
  }
  return out.str();
}

uint64_t ShapeCache::next_entry_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

std::optional<ShapeKey> ShapeCache::key_of(const c10::Device& device, uint64_t id) {
  std::optional<ShapeKey> found;
  lru(device).for_each([&](const ShapeKey& key, const Entry& entry, int64_t, int) {
    if (entry.id == id) found = key;
  });
  return found;
}

std::string ShapeCache::why_not_kept(const c10::Device& device, int64_t bytes, bool& never_fits) {
  EntryLru& entries = lru(device);
  never_fits = bytes > entries.budget_bytes() - entries.shared_bytes();
  std::ostringstream why;
  if (bytes > entries.budget_bytes() - entries.shared_bytes() - entries.pinned_bytes()) {
    why << "it holds " << bytes << " bytes, more than the budget of " << entries.budget_bytes()
        << " bytes leaves after " << entries.pinned_bytes() << " bytes of running entries and "
        << entries.shared_bytes() << " shared bytes";
  } else {
    why << "all " << entries.pinned_count() << " entries on " << device
        << " are running, and max_entries=" << entries.max_entries() << " leaves no room beside them";
  }
  return why.str();
}

int ShapeCache::traverse(uint64_t function_id, visitproc visit, void* arg) const {
  int result = 0;
  for (const auto& [device, cache] : devices_) {
    cache.lru->for_each([&](const ShapeKey&, const Entry& entry, int64_t, int) {
      if (result != 0 || entry.function_id != function_id) return;
      if (entry.handle) result = visit(entry.handle.ptr(), arg);
      // A PythonRunner holds the same callable once more: each reference is visited.
      if (auto* python = dynamic_cast<const PythonRunner*>(entry.runner.get()); result == 0 && python != nullptr) {
        result = visit(python->callable().ptr(), arg);
      }
      // What the runner was built from (entry_runner.h), once however many hold it.
      if (const auto& guard = entry.runner->guard(); result == 0 && guard) result = guard->traverse(visit, arg);
    });
  }
  return result;
}

py::list ShapeCache::entries(const c10::Device& device) {
  std::vector<std::tuple<uint64_t, py::object, bool>> found;  // copied out first: see the file's comment
  lru(device).for_each([&](const ShapeKey&, const Entry& entry, int64_t, int pins) {
    found.emplace_back(entry.id, entry.handle, pins > 0);
  });
  py::list out;
  for (auto& [id, runner, pinned] : found) out.append(py::make_tuple(id, std::move(runner), pinned));
  return out;
}

std::vector<EntryLru::Evicted> ShapeCache::set_entry_bytes(const c10::Device& device, uint64_t id, int64_t bytes) {
  if (bytes < 0) throw py::value_error("bytes must be >= 0, got " + std::to_string(bytes));
  const std::optional<ShapeKey> key = key_of(device, id);
  if (!key) throw py::key_error("no entry " + std::to_string(id) + " on " + device.str());
  return lru(device).set_entry_bytes(*key, bytes);
}

std::optional<EntryLru::Evicted> ShapeCache::erase_entry(const c10::Device& device, uint64_t id) {
  const std::optional<ShapeKey> key = key_of(device, id);
  if (!key) return std::nullopt;
  return lru(device).erase(*key);
}

namespace {

void check_shared_bytes(const SharedBytes& bytes) {
  if (bytes.pool < 0 || bytes.workspace < 0) {
    throw py::value_error("shared bytes must be >= 0, got pool=" + std::to_string(bytes.pool) +
                          " workspace=" + std::to_string(bytes.workspace));
  }
}

}  // namespace

std::vector<EntryLru::Evicted> ShapeCache::set_shared_bytes(const c10::Device& device, SharedBytes bytes) {
  check_shared_bytes(bytes);
  EntryLru& entries = lru(device);
  devices_.at(device).shared = bytes;
  return entries.set_shared_bytes(bytes.pool + bytes.workspace);
}

bool ShapeCache::set_shared_bytes_if_free(const c10::Device& device, SharedBytes bytes, int64_t more_bytes) {
  check_shared_bytes(bytes);
  if (more_bytes < 0) throw py::value_error("bytes must be >= 0, got " + std::to_string(more_bytes));
  EntryLru& entries = lru(device);
  if (!entries.fits_free_with_shared(more_bytes, bytes.pool + bytes.workspace)) return false;
  devices_.at(device).shared = bytes;
  auto evicted = entries.set_shared_bytes(bytes.pool + bytes.workspace);  // within the budget: evicts nothing
  return true;
}

namespace {

// A device's figures and its entries', copied out of the cache before any Python object is made.
struct DeviceListing {
  std::string name;
  int64_t budget;
  DeviceFigures figures;
  std::vector<EntryFigures> entries;
};

// A limit as Python reads it: None for no limit.
py::object limit_or_none(int64_t limit) {
  return limit == EntryLru::kUnlimited ? py::object(py::none()) : py::object(py::int_(limit));
}

}  // namespace

py::dict ShapeCache::stats(std::optional<uint64_t> function_id) const {
  std::vector<DeviceListing> devices;
  devices.reserve(device_order_.size());
  for (const c10::Device& device : device_order_) {
    const DeviceCache& cache = devices_.at(device);
    const EntryLru& lru = *cache.lru;
    const LruCounters& c = lru.counters();
    DeviceListing listing{device.str(), lru.budget_bytes(), {}, {}};
    DeviceFigures& f = listing.figures;
    f.bytes = lru.total_bytes();
    f.entry_bytes = lru.entry_bytes();
    f.pool_bytes = cache.shared.pool;
    f.workspace_bytes = cache.shared.workspace;
    f.peak_bytes = c.peak_bytes;
    f.entry_count = static_cast<int64_t>(lru.size());
    f.evictions = c.evictions;
    f.rejections = c.rejections;
    f.pool_rebuilds = cache.pool_rebuilds;
    lru.for_each([&](const ShapeKey&, const Entry& entry, int64_t bytes, int pins) {
      if (function_id && entry.function_id != *function_id) return;
      listing.entries.push_back(EntryFigures{entry.id, entry.bucket, listing.name, entry.backend, bytes, entry.hits,
                                             entry.build_seconds, entry.last_use, pins > 0});
    });
    devices.push_back(std::move(listing));
  }

  // From here on Python objects are made; the cache is not read again.
  py::dict out;
  DeviceFigures totals;
  py::list entries;
  py::dict per_device;
  for (const DeviceListing& listing : devices) {
    py::dict figures;
    figures["budget"] = limit_or_none(listing.budget);
    listing.figures.for_each([&](const char* name, int64_t value, bool) { figures[name] = value; });
    per_device[py::str(listing.name)] = figures;
#define SHAPECACHE_FIGURE_SUM(name, summed, what) \
  if (summed) totals.name += listing.figures.name;
    SHAPECACHE_DEVICE_FIGURES(SHAPECACHE_FIGURE_SUM)
#undef SHAPECACHE_FIGURE_SUM
    for (const EntryFigures& e : listing.entries) {
      py::dict d;
      e.for_each([&](const char* name, const auto& value) { d[name] = value; });
      entries.append(d);
    }
  }
  totals.for_each([&](const char* name, int64_t value, bool summed) {
    if (summed) out[name] = value;
  });
  out["max_entries"] = limit_or_none(max_entries_);
  out["devices"] = per_device;
  out["entries"] = entries;
  return out;
}

}  // namespace shapecache
