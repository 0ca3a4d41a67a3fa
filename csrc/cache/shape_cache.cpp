#include "cache/shape_cache.h"

#include <torch/csrc/Device.h>

#include <atomic>
#include <sstream>

namespace shapecache {

ShapeCache::ShapeCache(py::object budget_for_device, int64_t max_entries, py::object release_device_memory)
    : budget_for_device_(std::move(budget_for_device)),
      release_device_memory_(std::move(release_device_memory)),
      max_entries_(max_entries) {
  if (max_entries < 0) {
    throw py::value_error("max_entries must be a non-negative int or None, got " + std::to_string(max_entries));
  }
}

void ShapeCache::release_device_memory(const c10::Device& device, const py::object& self) {
  {
    auto evicted = evict_unpinned(device);
  }  // the evicted entries are destroyed before the allocator's cache is emptied
  if (release_device_memory_.is_none()) return;
  py::object device_obj = py::reinterpret_steal<py::object>(THPDevice_New(device));
  release_device_memory_(device_obj, self);
}

EntryLru& ShapeCache::lru(const c10::Device& device) {
  auto it = devices_.find(device);
  if (it != devices_.end()) return *it->second.lru;
  py::object device_obj = py::reinterpret_steal<py::object>(THPDevice_New(device));
  const int64_t budget = budget_for_device_(device_obj).cast<int64_t>();
  // Python may have re-entered and created it meanwhile.
  it = devices_.find(device);
  if (it != devices_.end()) return *it->second.lru;
  DeviceCache created{std::make_unique<EntryLru>(budget, max_entries_), SharedBytes{}};
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

py::list ShapeCache::entries(const c10::Device& device) {
  py::list out;
  lru(device).for_each([&](const ShapeKey&, const Entry& entry, int64_t, int pins) {
    out.append(py::make_tuple(entry.id, entry.runner, pins > 0));
  });
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

std::vector<EntryLru::Evicted> ShapeCache::set_shared_bytes(const c10::Device& device, SharedBytes bytes) {
  if (bytes.pool < 0 || bytes.workspace < 0) {
    throw py::value_error("shared bytes must be >= 0, got pool=" + std::to_string(bytes.pool) +
                          " workspace=" + std::to_string(bytes.workspace));
  }
  EntryLru& entries = lru(device);
  devices_.at(device).shared = bytes;
  return entries.set_shared_bytes(bytes.pool + bytes.workspace);
}

py::dict ShapeCache::stats(std::optional<uint64_t> function_id) const {
  int64_t entry_bytes = 0, pool_bytes = 0, workspace_bytes = 0, evictions = 0, rejections = 0, peak_bytes = 0,
          pool_rebuilds = 0;
  py::list entries;
  py::dict per_device;
  for (const c10::Device& device : device_order_) {
    const DeviceCache& cache = devices_.at(device);
    const EntryLru& lru = *cache.lru;
    const LruCounters& c = lru.counters();
    std::ostringstream name;
    name << device;
    py::dict figures;
    figures["budget"] = lru.budget_bytes() == EntryLru::kUnlimited ? py::object(py::none()) : py::int_(lru.budget_bytes());
    figures["bytes"] = lru.total_bytes();
    figures["entry_bytes"] = lru.entry_bytes();
    figures["pool_bytes"] = cache.shared.pool;
    figures["workspace_bytes"] = cache.shared.workspace;
    figures["peak_bytes"] = c.peak_bytes;
    figures["entries"] = lru.size();
    figures["evictions"] = c.evictions;
    figures["rejections"] = c.rejections;
    figures["pool_rebuilds"] = cache.pool_rebuilds;
    per_device[py::str(name.str())] = figures;
    entry_bytes += lru.entry_bytes();
    pool_bytes += cache.shared.pool;
    workspace_bytes += cache.shared.workspace;
    evictions += c.evictions;
    rejections += c.rejections;
    peak_bytes += c.peak_bytes;
    pool_rebuilds += cache.pool_rebuilds;
    lru.for_each([&](const ShapeKey&, const Entry& entry, int64_t bytes, int pins) {
      if (function_id && entry.function_id != *function_id) return;
      py::dict e;
      e["id"] = entry.id;
      e["bucket"] = entry.bucket;
      e["device"] = name.str();
      e["backend"] = entry.backend;
      e["bytes"] = bytes;
      e["hits"] = entry.hits;
      e["build_seconds"] = entry.build_seconds;
      e["last_use"] = entry.last_use;
      e["pinned"] = pins > 0;
      entries.append(e);
    });
  }
  py::dict out;
  out["bytes"] = entry_bytes + pool_bytes + workspace_bytes;
  out["entry_bytes"] = entry_bytes;
  out["pool_bytes"] = pool_bytes;
  out["workspace_bytes"] = workspace_bytes;
  out["peak_bytes"] = peak_bytes;
  out["evictions"] = evictions;
  out["rejections"] = rejections;
  out["pool_rebuilds"] = pool_rebuilds;
  out["max_entries"] = max_entries_ == EntryLru::kUnlimited ? py::object(py::none()) : py::int_(max_entries_);
  out["devices"] = per_device;
  out["entries"] = entries;
  return out;
}

}  // namespace shapecache
