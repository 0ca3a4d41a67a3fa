// BudgetedLru: entries with a size in bytes, kept under a byte budget and an entry count,
// evicting the least recently used entry that is not pinned.
//
// Policy:
//   - Every entry has the bytes it holds on its device; the cache may also be charged bytes
//     held outside any entry (a shared graph pool, a workspace): `shared_bytes`.
//   - Invariant 2 (README), kept by `make_room`: after an insertion, entry bytes + shared bytes
//     <= budget and entry count <= max_entries.
//   - An insertion that cannot fit even after evicting every unpinned entry is rejected
//     and evicts nothing: a doomed insertion never costs the user entries they had.
//   - Room may be made before an entry exists (`make_room_for`, by the same rule), so that
//     building it never holds the budget and the new entry at once.
//   - A pinned entry (one that is running) is never evicted, erased or cleared. While one
//     is pinned the invariant may not hold (nothing else could be evicted); `unpin` restores
//     it, so it holds whenever no entry is pinned.
//   - `find` makes the entry most recently used; `peek` leaves it where it is.
// Not thread-safe: the owner serialises access.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <list>
#include <optional>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

namespace shapecache {

struct LruCounters {
  int64_t inserts = 0;     // entries accepted
  int64_t rejections = 0;  // insertions refused because the entry could not fit
  int64_t evictions = 0;   // entries removed to make room (not erase/clear)
  int64_t peak_bytes = 0;  // highest entry bytes + shared bytes ever accounted
};

template <typename Key, typename Value, typename Hash = std::hash<Key>>
class BudgetedLru {
 public:
  static constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

  struct Evicted {
    Key key;
    Value value;
    int64_t bytes;
  };

  struct InsertResult {
    bool inserted = false;           // false: rejected (did not fit) or the key was present
    std::vector<Evicted> evicted;    // entries removed to make room, least recently used first
    std::optional<Value> returned;   // the value, handed back when not inserted, so that its
                                     // destruction happens where the caller chooses
  };

  explicit BudgetedLru(int64_t budget_bytes = kUnlimited, int64_t max_entries = kUnlimited)
      : budget_bytes_(budget_bytes), max_entries_(max_entries) {
    check_limits(budget_bytes, max_entries);
  }

  // The entry for `key`, or nullptr; a found entry becomes most recent. (Hits and misses are
  // the caller's to count: a miss policy also looks entries up that no call asked for.)
  Value* find(const Key& key) {
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return &it->second->value;
  }

  // The entry for `key`, or nullptr, left where it is in the order (what a background job
  // looks at is not a use).
  Value* peek(const Key& key) {
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &it->second->value;
  }

  bool contains(const Key& key) const { return index_.count(key) != 0; }

  void pin(const Key& key) { ++node(key).pins; }
  // Unpins, then applies the budget rule again: room that could not be made while the entry
  // was pinned (shared bytes grown, an entry resized, limits lowered meanwhile) is made now.
  // Returns what that evicted, possibly the entry itself.
  std::vector<Evicted> unpin(const Key& key) {
    Node& n = node(key);
    if (n.pins == 0) throw std::logic_error("BudgetedLru::unpin: entry is not pinned");
    --n.pins;
    return evict_while_over(0, 0);
  }
  int pin_count(const Key& key) const {
    auto it = index_.find(key);
    return it == index_.end() ? 0 : it->second->pins;
  }

  // Inserts `value` as the most recently used entry, holding `bytes`. Makes room first by
  // the budget rule; rejects (and evicts nothing) when no amount of eviction makes room.
  InsertResult insert(Key key, Value value, int64_t bytes) {
    if (bytes < 0) throw std::invalid_argument("BudgetedLru::insert: bytes must be >= 0, got " + std::to_string(bytes));
    InsertResult result;
    if (index_.count(key)) {
      result.returned.emplace(std::move(value));
      return result;
    }
    auto room = make_room(bytes, 1);
    result.evicted = std::move(room.evicted);
    if (!room.fits) {
      ++counters_.rejections;
      result.returned.emplace(std::move(value));
      return result;
    }
    order_.push_front(Node{key, std::move(value), bytes, 0});
    index_.emplace(std::move(key), order_.begin());
    entry_bytes_ += bytes;
    ++counters_.inserts;
    note_peak();
    result.inserted = true;
    return result;
  }

  // Makes room for an entry that does not exist yet: evicts least recently used unpinned
  // entries until one more entry of `expected_bytes` fits by the budget rule, or nothing when
  // no amount of eviction would make that room. An owner calls it before building an entry it
  // can only estimate, so that the build runs beside at most budget - expected bytes: the peak
  // while building is then the budget plus the build's own transient memory, where room made
  // only at insertion would add a whole entry to it. The cost: if the built entry turns out
  // not to fit at all, it is rejected and the entries evicted for the estimate stay gone.
  std::vector<Evicted> make_room_for(int64_t expected_bytes) {
    if (expected_bytes < 0)
      throw std::invalid_argument("BudgetedLru::make_room_for: bytes must be >= 0, got " + std::to_string(expected_bytes));
    return make_room(expected_bytes, 1).evicted;
  }

  // Whether an entry of `bytes` could be inserted now, possibly after evictions.
  bool could_fit(int64_t bytes) const {
    return fits_after_evicting_all_unpinned(bytes, 1, shared_bytes_);
  }
  // The same, were the shared bytes `shared_bytes`: a figure measured before it is charged,
  // whose charge would evict entries for an insertion that cannot happen.
  bool could_fit_with_shared(int64_t bytes, int64_t shared_bytes) const {
    return fits_after_evicting_all_unpinned(bytes, 1, shared_bytes);
  }
  // Whether `bytes` more fit in the room the budget has free now, without evicting anything,
  // were the shared bytes `shared_bytes`: what an upgrade's CUDA graph asks before its capture's
  // growth of the pool is charged (an upgrade never evicts).
  bool fits_free_with_shared(int64_t bytes, int64_t shared_bytes) const {
    return bytes <= budget_bytes_ - shared_bytes - entry_bytes_ && !over(0, 0);  // (over: the count too)
  }

  // New limits; evicts least recently used unpinned entries until they hold (as far as
  // unpinned entries allow).
  std::vector<Evicted> set_limits(int64_t budget_bytes, int64_t max_entries) {
    check_limits(budget_bytes, max_entries);
    budget_bytes_ = budget_bytes;
    max_entries_ = max_entries;
    return evict_while_over(0, 0);
  }

  // Bytes the owner holds outside any entry (shared pool, workspace), charged against the
  // same budget. Growth evicts least recently used unpinned entries, as far as they allow.
  std::vector<Evicted> set_shared_bytes(int64_t bytes) {
    if (bytes < 0) throw std::invalid_argument("BudgetedLru::set_shared_bytes: bytes must be >= 0");
    shared_bytes_ = bytes;
    note_peak();
    return evict_while_over(0, 0);
  }

  // `key`'s artifact was rebuilt and now holds `bytes`. Kept under the budget rule like an
  // insertion, the entry itself never evicted to make its own room: if it cannot fit even
  // after evicting every other unpinned entry, it alone is removed (returned, as evicted);
  // otherwise least recently used others are evicted until it fits. A pinned entry that
  // cannot fit stays, and the others go as far as they allow (as shared growth does).
  std::vector<Evicted> set_entry_bytes(const Key& key, int64_t bytes) {
    if (bytes < 0) throw std::invalid_argument("BudgetedLru::set_entry_bytes: bytes must be >= 0");
    auto it = index_.find(key);
    if (it == index_.end()) throw std::out_of_range("BudgetedLru: no entry for this key");
    Node& n = *it->second;
    entry_bytes_ -= n.bytes;
    n.bytes = 0;
    // Whether it fits is a question of bytes: a count over the limit (lowered while entries
    // were pinned) is not this entry's doing, and others are evicted for it as usual.
    const bool fits = bytes <= budget_bytes_ - shared_bytes_ - pinned_bytes();
    std::vector<Evicted> evicted;
    if (fits) {
      ++n.pins;  // out of reach of its own evictions
      evicted = evict_while_over(bytes, 0);
      --n.pins;
    } else if (n.pins == 0) {
      evicted.push_back(remove(it->second));
      ++counters_.evictions;
      return evicted;
    }
    n.bytes = bytes;
    entry_bytes_ += bytes;
    note_peak();
    if (!fits) evicted = evict_while_over(0, 0);
    return evicted;
  }

  // Whether `key`'s entry could hold `bytes` instead of what it holds, in the room the budget
  // has free now, without evicting anything.
  bool fits_in_place(const Key& key, int64_t bytes) const {
    auto it = index_.find(key);
    if (it == index_.end()) return false;
    return bytes - it->second->bytes <= budget_bytes_ - shared_bytes_ - entry_bytes_;
  }

  // Removes `key` unless it is pinned; returns it.
  std::optional<Evicted> erase(const Key& key) {
    auto it = index_.find(key);
    if (it == index_.end() || it->second->pins > 0) return std::nullopt;
    return remove(it->second);
  }

  // Evicts every unpinned entry (counted as evictions, unlike clear); returns them.
  std::vector<Evicted> evict_unpinned() {
    std::vector<Evicted> removed = clear();
    counters_.evictions += static_cast<int64_t>(removed.size());
    return removed;
  }

  // Removes every unpinned entry; returns them.
  std::vector<Evicted> clear() {
    std::vector<Evicted> removed;
    for (auto it = order_.begin(); it != order_.end();) {
      auto next = std::next(it);
      if (it->pins == 0) removed.push_back(remove(it));
      it = next;
    }
    return removed;
  }

  // Visits entries from most to least recently used: f(key, value, bytes, pins).
  template <typename F>
  void for_each(F&& f) const {
    for (const Node& n : order_) f(n.key, n.value, n.bytes, n.pins);
  }

  int64_t entry_bytes() const { return entry_bytes_; }
  int64_t shared_bytes() const { return shared_bytes_; }
  int64_t total_bytes() const { return entry_bytes_ + shared_bytes_; }
  int64_t budget_bytes() const { return budget_bytes_; }
  int64_t max_entries() const { return max_entries_; }
  int64_t size() const { return static_cast<int64_t>(order_.size()); }
  const LruCounters& counters() const { return counters_; }

  int64_t pinned_bytes() const {
    int64_t bytes = 0;
    for (const Node& n : order_) bytes += n.pins > 0 ? n.bytes : 0;
    return bytes;
  }

  int64_t pinned_count() const {
    int64_t count = 0;
    for (const Node& n : order_) count += n.pins > 0 ? 1 : 0;
    return count;
  }

 private:
  struct Node {
    Key key;
    Value value;
    int64_t bytes;
    int pins;  // > 0 while the entry runs; pinned entries are never removed
  };
  using Order = std::list<Node>;  // front: most recently used

  struct Room {
    bool fits;
    std::vector<Evicted> evicted;
  };

  // The budget rule. Room for `incoming_count` entries of `incoming_bytes` in total means
  // entry bytes + shared bytes + incoming bytes <= budget and size + incoming count <=
  // max entries. If evicting every unpinned entry would not give that room, evict nothing;
  // otherwise evict least recently used unpinned entries until there is room.
  Room make_room(int64_t incoming_bytes, int64_t incoming_count) {
    if (!fits_after_evicting_all_unpinned(incoming_bytes, incoming_count, shared_bytes_)) return Room{false, {}};
    return Room{true, evict_while_over(incoming_bytes, incoming_count)};
  }

  bool over(int64_t incoming_bytes, int64_t incoming_count) const {
    // Written as subtractions so an unlimited budget never overflows.
    return entry_bytes_ + shared_bytes_ > budget_bytes_ - incoming_bytes ||
           size() > max_entries_ - incoming_count;
  }

  bool fits_after_evicting_all_unpinned(int64_t incoming_bytes, int64_t incoming_count, int64_t shared_bytes) const {
    return incoming_bytes <= budget_bytes_ - shared_bytes - pinned_bytes() &&
           incoming_count <= max_entries_ - pinned_count();
  }

  std::vector<Evicted> evict_while_over(int64_t incoming_bytes, int64_t incoming_count) {
    std::vector<Evicted> evicted;
    auto it = order_.end();
    while (over(incoming_bytes, incoming_count) && it != order_.begin()) {
      --it;
      if (it->pins > 0) continue;
      auto victim = it++;  // step past the victim: the next `--it` lands on the entry just more recent
      evicted.push_back(remove(victim));
      ++counters_.evictions;
    }
    return evicted;
  }

  Evicted remove(typename Order::iterator it) {
    Evicted out{std::move(it->key), std::move(it->value), it->bytes};
    entry_bytes_ -= it->bytes;
    index_.erase(out.key);
    order_.erase(it);
    return out;
  }

  Node& node(const Key& key) {
    auto it = index_.find(key);
    if (it == index_.end()) throw std::out_of_range("BudgetedLru: no entry for this key");
    return *it->second;
  }

  void note_peak() {
    if (total_bytes() > counters_.peak_bytes) counters_.peak_bytes = total_bytes();
  }

  static void check_limits(int64_t budget_bytes, int64_t max_entries) {
    if (budget_bytes < 0) throw std::invalid_argument("budget must be >= 0 bytes, got " + std::to_string(budget_bytes));
    if (max_entries < 0) throw std::invalid_argument("max_entries must be >= 0, got " + std::to_string(max_entries));
  }

  Order order_;
  std::unordered_map<Key, typename Order::iterator, Hash> index_;
  int64_t entry_bytes_ = 0;     // sum of entry bytes
  int64_t shared_bytes_ = 0;  // bytes held outside entries, charged to the same budget
  int64_t budget_bytes_;
  int64_t max_entries_;
  LruCounters counters_;
};

}  // namespace shapecache
