// What a cache reports of one device and of one entry, defined once: each list below makes
// its struct's fields, the dicts of ShapeCache::stats, and the names Python checks its typed
// definitions against (_C.DEVICE_FIGURES, _C.ENTRY_FIGURES; shapecache.statistics).
#pragma once

#include <cstdint>
#include <string>

namespace shapecache {

// X(name, summed over devices into the cache's totals, what it is). Every field is int64_t.
#define SHAPECACHE_DEVICE_FIGURES(X)                                                                   \
  X(bytes, true, "entry_bytes + pool_bytes + workspace_bytes: what is charged to the budget")         \
  X(entry_bytes, true, "what the entries hold")                                                        \
  X(pool_bytes, true, "the device's CUDA graph pool (the generations in use)")                         \
  X(workspace_bytes, true, "the tuned convolutions' workspace arena")                                  \
  X(peak_bytes, true, "the highest `bytes` ever accounted")                                            \
  X(entry_count, false, "entries held (the totals list them: `entries`)")                              \
  X(evictions, true, "entries evicted to make room")                                                   \
  X(rejections, true, "entries that could not fit and were not kept")                                  \
  X(pool_rebuilds, true, "times every graph of the device was captured again, largest first")

struct DeviceFigures {
#define SHAPECACHE_FIGURE_FIELD(name, summed, what) int64_t name = 0;
  SHAPECACHE_DEVICE_FIGURES(SHAPECACHE_FIGURE_FIELD)
#undef SHAPECACHE_FIGURE_FIELD

  // Calls f(name, value, summed) for each figure, in the list's order.
  template <class F>
  void for_each(F&& f) const {
#define SHAPECACHE_FIGURE_VISIT(name, summed, what) f(#name, name, summed);
    SHAPECACHE_DEVICE_FIGURES(SHAPECACHE_FIGURE_VISIT)
#undef SHAPECACHE_FIGURE_VISIT
  }
};

// X(type, name, what it is)
#define SHAPECACHE_ENTRY_FIGURES(X)                                                               \
  X(uint64_t, id, "unique in the process")                                                        \
  X(std::string, bucket, "the key, readable: argument shapes, dtypes, devices, values")          \
  X(std::string, device, "the device it runs on")                                                 \
  X(std::string, backend, "what built it: eager, compile, cuda_graph, compile+cuda_graph")        \
  X(int64_t, bytes, "memory the entry holds, charged to the budget")                             \
  X(int64_t, hits, "calls served after the build")                                                \
  X(double, build_seconds, "wall time of the build, its first call included")                     \
  X(double, last_use, "unix time of the last call")                                               \
  X(bool, pinned, "running now: never evicted while so")

struct EntryFigures {
#define SHAPECACHE_FIGURE_FIELD(type, name, what) type name{};
  SHAPECACHE_ENTRY_FIGURES(SHAPECACHE_FIGURE_FIELD)
#undef SHAPECACHE_FIGURE_FIELD

  // Calls f(name, value) for each figure, in the list's order.
  template <class F>
  void for_each(F&& f) const {
#define SHAPECACHE_FIGURE_VISIT(type, name, what) f(#name, name);
    SHAPECACHE_ENTRY_FIGURES(SHAPECACHE_FIGURE_VISIT)
#undef SHAPECACHE_FIGURE_VISIT
  }
};

}  // namespace shapecache
