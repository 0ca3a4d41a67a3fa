"""BudgetedLru's invariants, checked against a reference model over random operation sequences."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shapecache._extension import _C

KEYS = st.integers(min_value=0, max_value=7)
BYTES = st.integers(min_value=0, max_value=60)


class LruModel:
    """The policy written out plainly: MRU-first order, pins, budget and count limits."""

    def __init__(self, budget, max_entries):
        self.budget, self.max_entries = budget, max_entries
        self.order = []  # most recently used first
        self.bytes = {}
        self.pins = {}
        self.shared = 0

    def total(self):
        return sum(self.bytes.values()) + self.shared

    def _over(self, incoming_bytes, incoming_count):
        return self.total() + incoming_bytes > self.budget or len(self.order) + incoming_count > self.max_entries

    def _evict_while_over(self, incoming_bytes, incoming_count):
        evicted = []
        for key in reversed(list(self.order)):
            if not self._over(incoming_bytes, incoming_count):
                break
            if self.pins[key] == 0:
                evicted.append(key)
                self._remove(key)
        return evicted

    def _remove(self, key):
        self.order.remove(key)
        del self.bytes[key], self.pins[key]

    def insert(self, key, nbytes):
        if key in self.bytes:
            return False, []
        pinned = [k for k in self.order if self.pins[k] > 0]
        pinned_bytes = sum(self.bytes[k] for k in pinned)
        if nbytes > self.budget - self.shared - pinned_bytes or 1 > self.max_entries - len(pinned):
            return False, []
        evicted = self._evict_while_over(nbytes, 1)
        self.order.insert(0, key)
        self.bytes[key], self.pins[key] = nbytes, 0
        return True, evicted

    def make_room_for(self, nbytes):
        """Room for one more entry of `nbytes`, as an insertion would make it, inserting nothing."""
        pinned = [k for k in self.order if self.pins[k] > 0]
        pinned_bytes = sum(self.bytes[k] for k in pinned)
        if nbytes > self.budget - self.shared - pinned_bytes or 1 > self.max_entries - len(pinned):
            return []
        return self._evict_while_over(nbytes, 1)

    def find(self, key):
        if key not in self.bytes:
            return False
        self.order.remove(key)
        self.order.insert(0, key)
        return True

    def set_entry_bytes(self, key, nbytes):
        """The entry never evicts itself for its own room; if it cannot fit beside the pinned
        ones, it alone goes (unless pinned: then it stays and the others go as far as they can)."""
        others_pinned = sum(b for k, b in self.bytes.items() if k != key and self.pins[k] > 0)
        if nbytes > self.budget - self.shared - others_pinned:
            if self.pins[key] == 0:
                self._remove(key)
                return [key]
            self.bytes[key] = nbytes
            return self._evict_while_over(0, 0)
        self.bytes[key] = 0
        self.pins[key] += 1
        evicted = self._evict_while_over(nbytes, 0)
        self.pins[key] -= 1
        self.bytes[key] = nbytes
        return evicted

    def set_shared(self, nbytes):
        self.shared = nbytes
        return self._evict_while_over(0, 0)

    def set_limits(self, budget, max_entries):
        self.budget, self.max_entries = budget, max_entries
        return self._evict_while_over(0, 0)


class LruMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.lru = _C._testing.IntLru(budget=100, max_entries=4)
        self.model = LruModel(100, 4)

    @rule(key=KEYS, nbytes=BYTES)
    def insert(self, key, nbytes):
        pinned_before = {k for k in self.model.order if self.model.pins[k] > 0}
        result = self.lru.insert(key, key * 10, nbytes)
        expected = self.model.insert(key, nbytes)
        assert tuple(result) == (expected[0], expected[1])
        if result[0]:
            # the invariant the cache exists for
            assert self.lru.total_bytes <= self.lru.budget
            assert len(self.lru) <= self.lru.max_entries
        assert pinned_before <= set(self.lru.keys())

    @rule(nbytes=BYTES)
    def make_room_for(self, nbytes):
        evicted = self.lru.make_room_for(nbytes)
        assert evicted == self.model.make_room_for(nbytes)
        if evicted:
            # room was made: an entry of `nbytes` now fits without evicting anything more
            assert self.lru.total_bytes + nbytes <= self.lru.budget
            assert len(self.lru) + 1 <= self.lru.max_entries

    @rule(key=KEYS)
    def find(self, key):
        found = self.lru.find(key)
        assert (found is not None) == self.model.find(key)
        if found is not None:
            assert found == key * 10

    @precondition(lambda self: self.model.order)
    @rule(data=st.data())
    def pin(self, data):
        key = data.draw(st.sampled_from(self.model.order))
        self.lru.pin(key)
        self.model.pins[key] += 1

    @precondition(lambda self: any(self.model.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from([k for k, p in self.model.pins.items() if p > 0]))
        self.model.pins[key] -= 1
        # the budget rule applies again: what pins kept over the budget goes now
        assert self.lru.unpin(key) == self.model._evict_while_over(0, 0)
        if not any(self.model.pins.values()):
            assert self.lru.total_bytes <= self.lru.budget or len(self.lru) == 0
            assert len(self.lru) <= self.lru.max_entries

    @rule(key=KEYS)
    def erase(self, key):
        removable = key in self.model.bytes and self.model.pins[key] == 0
        assert self.lru.erase(key) == removable
        if removable:
            self.model._remove(key)

    @precondition(lambda self: self.model.order)
    @rule(data=st.data(), nbytes=st.integers(min_value=0, max_value=120))
    def set_entry_bytes(self, data, nbytes):
        key = data.draw(st.sampled_from(self.model.order))
        assert self.lru.set_entry_bytes(key, nbytes) == self.model.set_entry_bytes(key, nbytes)
        if self.lru.pin_count(key) == 0 and key in self.lru.keys():
            assert self.lru.total_bytes <= self.lru.budget

    @rule(nbytes=st.integers(min_value=0, max_value=80))
    def set_shared_bytes(self, nbytes):
        assert self.lru.set_shared_bytes(nbytes) == self.model.set_shared(nbytes)

    @rule(budget=st.integers(min_value=0, max_value=150), max_entries=st.integers(min_value=0, max_value=5))
    def set_limits(self, budget, max_entries):
        assert self.lru.set_limits(budget, max_entries) == self.model.set_limits(budget, max_entries)

    @invariant()
    def same_order_and_bytes(self):
        assert self.lru.keys() == self.model.order
        assert self.lru.total_bytes == self.model.total()
        assert self.lru.counters["peak_bytes"] >= self.lru.total_bytes or self.lru.total_bytes == 0

    @invariant()
    def pinned_entries_present(self):
        for key, pins in self.model.pins.items():
            assert self.lru.pin_count(key) == pins


TestLruMachine = LruMachine.TestCase
TestLruMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_eviction_order_is_least_recently_used():
    lru = _C._testing.IntLru(budget=30)
    for key in (1, 2, 3):
        assert lru.insert(key, key, 10) == (True, [])
    lru.find(1)  # 2 is now the least recently used
    assert lru.insert(4, 4, 20) == (True, [2, 3])
    assert lru.keys() == [4, 1]
    assert lru.counters["evictions"] == 2


def test_pinned_entry_survives_and_doomed_insert_evicts_nothing():
    lru = _C._testing.IntLru(budget=100)
    lru.insert(1, 1, 70)
    lru.insert(2, 2, 20)
    lru.pin(1)
    # 40 bytes fit only if the pinned 70 went: rejected, and entry 2 is kept.
    assert lru.insert(3, 3, 40) == (False, [])
    assert lru.keys() == [2, 1]
    assert lru.counters["rejections"] == 1
    lru.unpin(1)
    assert lru.insert(3, 3, 40) == (True, [1])


def test_counters():
    lru = _C._testing.IntLru(max_entries=1)
    lru.insert(1, 1, 5)
    assert lru.find(1) == 1 and lru.find(2) is None
    lru.insert(2, 2, 7)
    c = lru.counters
    assert (c["inserts"], c["evictions"], c["peak_bytes"]) == (2, 1, 7)
    assert "hits" not in c  # a lookup counts nothing: hits are the cached function's (FunctionCounters)


def test_shared_bytes_share_the_budget():
    lru = _C._testing.IntLru(budget=100)
    lru.insert(1, 1, 40)
    lru.insert(2, 2, 40)
    assert lru.set_shared_bytes(50) == [1]
    assert lru.total_bytes == 90
    assert lru.could_fit(50) and not lru.could_fit(51)  # 100 - 50 shared, after evicting entry 2


def test_unpin_without_pin_is_an_error():
    lru = _C._testing.IntLru()
    lru.insert(1, 1, 0)
    with pytest.raises(RuntimeError, match="not pinned"):
        lru.unpin(1)


def test_negative_limits_rejected():
    with pytest.raises(ValueError, match="budget must be >= 0"):
        _C._testing.IntLru(budget=-1)


def test_set_bytes_evicts_others_least_recent_first_and_never_itself():
    lru = _C._testing.IntLru(budget=100)
    for key in (1, 2, 3):
        lru.insert(key, key, 20)
    # 1 is the least recently used; growing it to 70 needs 30 more bytes: 1 itself stays,
    # 2 (now the least recent of the others) goes, and 3 then still fits.
    assert lru.set_entry_bytes(1, 70) == [2]
    assert lru.keys() == [3, 1]
    assert lru.total_bytes == 90


def test_set_bytes_that_cannot_fit_removes_only_that_entry():
    lru = _C._testing.IntLru(budget=100)
    lru.insert(1, 1, 30)
    lru.insert(2, 2, 30)
    lru.pin(2)
    assert lru.set_entry_bytes(1, 80) == [1]  # 80 beside the pinned 30 cannot fit: 1 goes, 2 stays
    assert lru.keys() == [2]
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        lru.set_entry_bytes(2, -1)
    with pytest.raises(IndexError):
        lru.set_entry_bytes(7, 1)


def test_room_made_before_an_entry_exists_bounds_what_is_held_while_it_is_built():
    lru = _C._testing.IntLru(budget=100)
    for key in (1, 2, 3):
        lru.insert(key, key, 30)
    assert lru.make_room_for(30) == [1]  # 90 + 30 would pass 100: the least recent goes first
    assert lru.total_bytes == 60
    assert lru.insert(4, 4, 30) == (True, [])  # the room is there: nothing more is evicted
    assert lru.make_room_for(101) == []  # could never fit: nothing is evicted for it
    assert lru.keys() == [4, 3, 2]
    with pytest.raises(ValueError, match="bytes must be >= 0, got -1"):
        lru.make_room_for(-1)


def test_an_entry_fits_in_place_only_in_the_room_free_now():
    # What an upgrade asks before it replaces an entry (miss_policy.h): never evict for it.
    lru = _C._testing.IntLru(budget=100)
    lru.insert(1, 1, 30)
    lru.insert(2, 2, 40)
    lru.set_shared_bytes(10)
    assert lru.fits_in_place(1, 50)  # 30 -> 50: 20 more, in the 20 free
    assert not lru.fits_in_place(1, 51)  # one byte past the free room: evicting 2 would make room, and is not done
    assert lru.fits_in_place(2, 0)  # smaller always fits
    assert not lru.fits_in_place(3, 0)  # no such entry
    unlimited = _C._testing.IntLru(budget=None)
    unlimited.insert(1, 1, 5)
    assert unlimited.fits_in_place(1, 2**62)
    assert lru.keys() == [2, 1] and lru.total_bytes == 80  # asking changed nothing
    assert lru.peek(1) == 1 and lru.peek(3) is None
    assert lru.keys() == [2, 1]  # a look is not a use
    assert lru.find(1) == 1 and lru.keys() == [1, 2]  # a find is


def test_room_free_now_counts_shared_bytes_as_measured_and_never_evictions():
    # What an upgrade's CUDA graph asks before its capture's growth of the pool is charged.
    lru = _C._testing.IntLru(budget=100)
    lru.insert(1, 1, 30)
    lru.set_shared_bytes(10)
    assert lru.fits_free_with_shared(50, 20)  # 30 + 20 + 50 = 100
    assert not lru.fits_free_with_shared(51, 20)  # evicting 1 would make room, and is not counted
    assert lru.fits_free_with_shared(0, 70) and not lru.fits_free_with_shared(0, 71)
    assert _C._testing.IntLru(budget=None).fits_free_with_shared(2**62, 2**40)
    # Over its entry count (a limit lowered while entries were pinned), any charge would evict.
    counted = _C._testing.IntLru(budget=100, max_entries=2)
    counted.insert(1, 1, 10)
    counted.insert(2, 2, 10)
    counted.pin(1)
    counted.pin(2)
    counted.set_limits(100, 1)
    assert not counted.fits_free_with_shared(0, 0)
