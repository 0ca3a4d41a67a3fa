"""Invariant 3: a cache miss never fails the user's call because of the cache.

Out of memory while building: evict the device's unpinned entries, empty the allocator's
cache, retry once; then run uncached and count a fallback. Only an out-of-memory error of the
plain call reaches the user, carrying the cache's state. The builders here raise the real
torch.OutOfMemoryError a set number of times.
"""

import pytest
import torch

from shapecache._backends import BuiltEntry
from shapecache._extension import _C


class FlakyBuilder:
    """Runs the function eagerly, declaring `nbytes` per entry, after `failures` OOMs."""

    def __init__(self, function, failures, nbytes=10):
        self.function, self.failures, self.nbytes, self.calls = function, failures, nbytes, 0

    def __call__(self, args, kwargs, device):
        self.calls += 1
        if self.calls <= self.failures:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return BuiltEntry(self.function, self.nbytes, self.function(*args, **kwargs), "eager")


def cached(function, builder, budget=100):
    cache = _C.ShapeCache(lambda device: budget, None)
    return _C.ShapeDispatcher(function, builder, cache, [], ["x"], None, False)


def double(x):
    return x * 2


def test_one_out_of_memory_evicts_retries_and_keeps_the_entry():
    f = cached(double, FlakyBuilder(double, failures=0))
    f(torch.ones(1))
    f(torch.ones(2))  # two entries held
    builder = FlakyBuilder(double, failures=1)
    g = _C.ShapeDispatcher(double, builder, f.cache, [], ["x"], None, False)  # shares f's cache
    assert torch.equal(g(torch.ones(3)), torch.full((3,), 2.0))
    st = g.stats()
    assert builder.calls == 2 and st["oom_retries"] == 1 and st["fallbacks"] == 0
    assert [e["bucket"] for e in f.cache.stats()["entries"]] == ["x=(3,) float32 cpu"]  # f's entries were evicted
    assert f.cache.stats()["evictions"] == 2


class CpuAllocatorFailure(FlakyBuilder):
    """Fails its first build with torch's own CPU allocator error (a plain RuntimeError), as
    a process under a memory limit meets it, or with MemoryError."""

    def __init__(self, function, error):
        super().__init__(function, failures=0)
        self.error = error

    def __call__(self, args, kwargs, device):
        if self.calls == 0:
            self.calls = 1
            if self.error is MemoryError:
                raise MemoryError()
            torch.empty(1 << 50, dtype=torch.uint8)  # a PiB: the allocator refuses it
        return super().__call__(args, kwargs, device)


@pytest.mark.parametrize("error", ["cpu allocator", MemoryError])
def test_a_cpu_allocation_failure_is_out_of_memory_too(error):
    builder = CpuAllocatorFailure(double, error)
    f = cached(double, builder)
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    st = f.stats()
    assert builder.calls == 2 and st["oom_retries"] == 1 and st["fallbacks"] == 0 and len(st["entries"]) == 1


class PrimitiveFailure(FlakyBuilder):
    """Fails its first `failures` builds as oneDNN does when an allocation inside primitive
    creation fails (a process under RLIMIT_DATA meets it at a new convolution size): torch
    surfaces dnnl's error as a RuntimeError with its text only."""

    def __call__(self, args, kwargs, device):
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("could not create a primitive")
        return BuiltEntry(self.function, self.nbytes, self.function(*args, **kwargs), "eager")


def test_a_onednn_primitive_that_could_not_be_created_is_retried_after_making_room():
    builder = PrimitiveFailure(double, failures=1)
    f = cached(double, builder)
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    st = f.stats()
    assert builder.calls == 2 and st["oom_retries"] == 1 and st["fallbacks"] == 0 and len(st["entries"]) == 1


def test_a_onednn_failure_that_persists_reaches_the_user_as_itself_not_as_out_of_memory():
    def unsupported(x):
        raise RuntimeError("could not create a primitive")

    f = cached(unsupported, PrimitiveFailure(unsupported, failures=2))
    with pytest.warns(RuntimeWarning, match="ran out of memory twice"):
        with pytest.raises(RuntimeError, match="^could not create a primitive$") as raised:
            f(torch.ones(3))
    assert not isinstance(raised.value, torch.OutOfMemoryError)
    assert f.stats()["oom_retries"] == 1 and f.stats()["fallbacks"] == 1


def test_room_for_an_entry_like_the_last_is_made_before_the_next_build():
    held_while_building = []
    cache = _C.ShapeCache(lambda device: 1000, None)

    def builder(args, kwargs, device):
        held_while_building.append(cache.stats()["devices"].get("cpu", {}).get("bytes", 0))
        return BuiltEntry(double, 300, double(*args), "eager")

    f = _C.ShapeDispatcher(double, builder, cache, [], ["x"], None, False)
    for n in range(1, 6):
        f(torch.ones(n))
    # Three entries of 300 fit in 1000; from the fourth build on, one goes before building, so
    # no build runs beside more than 1000 - 300 bytes (after the build, as many entries stay).
    assert held_while_building == [0, 300, 600, 600, 600]
    assert len(cache.stats()["entries"]) == 3 and cache.stats()["evictions"] == 2


def test_other_runtime_errors_of_a_build_are_not_retried():
    def broken(args, kwargs, device):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        cached(double, broken)(torch.ones(3))


def test_two_out_of_memory_errors_run_the_call_uncached():
    builder = FlakyBuilder(double, failures=2)
    f = cached(double, builder)
    with pytest.warns(RuntimeWarning, match="ran out of memory twice .* such calls run uncached"):
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    st = f.stats()
    assert (st["oom_retries"], st["fallbacks"], st["builds"], len(st["entries"])) == (1, 1, 0, 0)
    # the next call builds normally
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0)) and len(f.stats()["entries"]) == 1


def test_only_the_plain_calls_out_of_memory_reaches_the_user_with_the_caches_state():
    def too_big(x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    keeper = cached(double, FlakyBuilder(double, failures=0), budget=1000)
    keeper(torch.ones(1))
    f = _C.ShapeDispatcher(too_big, FlakyBuilder(too_big, failures=2), keeper.cache, [], ["x"], None, False)
    with pytest.warns(RuntimeWarning, match="ran out of memory twice"):
        with pytest.raises(torch.OutOfMemoryError) as raised:
            f(torch.ones(3))
    message = str(raised.value)
    assert "the cache on cpu holds 0 bytes in 0 entries (0 pinned)" in message
    assert "budget 1000 bytes" in message and "the uncached call ran out of memory too" in message
    assert "Tried to allocate 80.00 GiB" in str(raised.value.__cause__)
    assert f.stats()["fallbacks"] == 1 and keeper.cache.stats()["entries"] == []


def test_other_errors_are_not_retried():
    def broken(args, kwargs, device):
        raise ValueError("a bug in the model")

    f = cached(double, broken)
    with pytest.raises(ValueError, match="a bug in the model"):
        f(torch.ones(1))
    assert f.stats()["oom_retries"] == 0 and f.stats()["fallbacks"] == 0


def test_a_bucket_whose_entry_exceeds_the_whole_budget_runs_uncached_instead_of_building_per_call():
    builder = FlakyBuilder(double, failures=0, nbytes=101)  # the budget is 100
    f = cached(double, builder)
    with pytest.warns(RuntimeWarning, match=r"holds 101 bytes, .* the bucket's calls run uncached from now on"):
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    for _ in range(3):
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    st = f.stats()
    assert builder.calls == 1 and st["uncached_calls"] == 3 and st["fallbacks"] == 1 and st["entries"] == []
    builder.nbytes = 10
    f(torch.ones(4))  # other buckets are built as before
    f.clear()  # and clear() lets the large one be tried again
    f(torch.ones(3))
    assert builder.calls == 3 and len(f.stats()["entries"]) == 1
