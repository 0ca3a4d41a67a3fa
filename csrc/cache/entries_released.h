// How many entries the process has let go of: evicted, found stale and rebuilt, cleared,
// rejected by the budget, or ended with their cache. An entry's Python objects (a compiled
// graph module, its closures) hold reference cycles, which only a full garbage collection
// frees; a full collection walks every object of the process (a tenth of a second or more
// with inductor loaded). So a build collects before it only where this count moved since the
// last time it did (shapecache/_backends/compile.py, free_what_entries_left).
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

namespace shapecache {

inline std::atomic<uint64_t>& entries_released_counter() {
  static std::atomic<uint64_t> released{0};
  return released;
}

inline uint64_t entries_released() { return entries_released_counter().load(std::memory_order_relaxed); }

// One per build's result: made with a BuiltEntry, moved into the Entry made of it
// (MissPolicy::insert). Whichever holds it last counts one release as it is destroyed: an
// entry let go, or a built result never inserted (a failed first run, a rejection). A move
// carries it, so a moved-from object counts nothing; it is never copied.
class ReleaseMark {
 public:
  explicit ReleaseMark(bool held = true) : held_(held) {}
  ReleaseMark(ReleaseMark&& other) noexcept : held_(std::exchange(other.held_, false)) {}
  ReleaseMark& operator=(ReleaseMark&& other) noexcept {
    if (this != &other) {
      release();
      held_ = std::exchange(other.held_, false);
    }
    return *this;
  }
  ReleaseMark(const ReleaseMark&) = delete;
  ReleaseMark& operator=(const ReleaseMark&) = delete;
  ~ReleaseMark() { release(); }

 private:
  void release() {
    if (held_) entries_released_counter().fetch_add(1, std::memory_order_relaxed);
    held_ = false;
  }
  bool held_;
};

}  // namespace shapecache
