// The counters of one cached function, defined once: the list below makes the struct's
// fields and the names Python reads (ShapeDispatcher::stats, _C.FUNCTION_COUNTERS, from which
// shapecache.statistics and the pipeline totals are checked and summed).
#pragma once

#include <cstdint>

namespace shapecache {

// X(name, what it counts)
#define SHAPECACHE_FUNCTION_COUNTERS(X)                                                                    \
  X(calls, "every call, cached or not")                                                                    \
  X(hits, "served by an existing entry")                                                                   \
  X(misses, "no entry: one was built, or queued for a background build")                                  \
  X(builds, "entries built, inline or in the background (== misses unless a build failed or was dropped)") \
  X(background_builds, "buckets' first builds that ran on a background worker, kept or not (not upgrades)") \
  X(fallbacks,                                                                                             \
    "ran uncached instead of keeping an entry: it did not fit, building ran out of memory twice or "      \
    "failed, or the entry raised where the uncached call did not")                                         \
  X(uncached_calls,                                                                                        \
    "ran uncached without trying: an argument that cannot be keyed, padded outputs that cannot be "       \
    "cropped, a bucket given up (too large, failed, or rebuilt on every call), a miss whose build "        \
    "could not be queued (the background queue was full), or a compiled graph's call while torch.export "  \
    "traced on another thread")                                                                            \
  X(oom_retries, "builds retried after an out-of-memory error")                                            \
  X(invalidations, "entries found stale (what they were built from changed) and rebuilt")                 \
  X(busy_misses,                                                                                           \
    "calls of a bucket being built (by another thread, a recursion, or a background worker): ran uncached") \
  X(upgrades, "entries replaced by their bucket's compiled form, measured faster (backend='auto', upgrade=True)") \
  X(upgrades_not_kept,                                                                                     \
    "compiled forms built and not kept: not faster by the threshold, stale, no room beside the entries, "  \
    "or failed")

struct FunctionCounters {
#define SHAPECACHE_COUNTER_FIELD(name, what) int64_t name = 0;
  SHAPECACHE_FUNCTION_COUNTERS(SHAPECACHE_COUNTER_FIELD)
#undef SHAPECACHE_COUNTER_FIELD

  // Calls f(name, value) for each counter, in the list's order.
  template <class F>
  void for_each(F&& f) const {
#define SHAPECACHE_COUNTER_VISIT(name, what) f(#name, name);
    SHAPECACHE_FUNCTION_COUNTERS(SHAPECACHE_COUNTER_VISIT)
#undef SHAPECACHE_COUNTER_VISIT
  }
};

}  // namespace shapecache
