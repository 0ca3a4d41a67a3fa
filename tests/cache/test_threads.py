"""Invariant 7: any thread may call a cached function, stats, clear or uncached at any time; a
bucket missed by several calls at once is built once; a call that computed its result returns it."""

import functools
import gc
import threading
import time
import warnings

import pytest
import torch

import shapecache as sc


@pytest.fixture
def gc_that_switches_threads():
    """A garbage collection on every few allocations, whose callback lets other threads run: the
    window in which building Python objects inside an LRU walk let another thread change it."""
    threshold = gc.get_threshold()

    def yield_the_gil(phase, info):
        time.sleep(0)

    gc.callbacks.append(yield_the_gil)
    gc.set_threshold(5, 1, 1)
    yield
    gc.set_threshold(*threshold)
    gc.callbacks.remove(yield_the_gil)


@pytest.mark.parametrize("build", ["inline", "background"])
def test_calls_stats_clear_and_evictions_from_many_threads(gc_that_switches_threads, build):
    # In the background, builds also end on the worker's thread meanwhile, and a thread waits for them.
    f = sc.cached(lambda x: x * 2, max_entries=3, build=build)
    sizes = list(range(1, 9))
    inputs = {n: torch.arange(n, dtype=torch.float32) for n in sizes}
    failures = []
    deadline = time.monotonic() + 1.5

    def caller(seed):
        i = seed
        while time.monotonic() < deadline:
            n = sizes[i % len(sizes)]
            if not torch.equal(f(inputs[n]), inputs[n] * 2):
                failures.append(f"wrong result at {n}")
            i += 3

    def reader():
        while time.monotonic() < deadline:
            st = sc.stats(f)
            ids = [e["id"] for e in st["entries"]]
            if len(ids) > 3 or len(set(ids)) != len(ids):
                failures.append(f"inconsistent stats: {ids}")

    def clearer():
        while time.monotonic() < deadline:
            sc.clear(f)
            time.sleep(0.001)

    def waiter():
        while time.monotonic() < deadline:
            sc.wait(f, timeout=0.01)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=reader) for _ in range(2)] + [threading.Thread(target=clearer)]
    threads += [threading.Thread(target=waiter)] if build == "background" else []
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert failures == []
    assert sc.wait(f, timeout=30)
    st = sc.stats(f)
    assert st["calls"] == st["hits"] + st["misses"] + st["busy_misses"] + st["uncached_calls"]
    assert st["pending_builds"] == 0 and (build == "inline") == (st["background_builds"] == 0)


def test_a_bucket_missed_by_several_threads_at_once_is_built_once():
    started = threading.Barrier(4)

    @sc.cached(backend="eager")
    def slow(x):
        time.sleep(0.2)  # the build runs this: the GIL is free for the other threads meanwhile
        return x + 1

    results = []

    def call():
        started.wait()
        results.append(slow(torch.ones(3)))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 4 and all(torch.equal(r, torch.full((3,), 2.0)) for r in results)
    st = sc.stats(slow)
    assert (st["builds"], st["busy_misses"], len(st["entries"])) == (1, 3, 1)


def test_a_recursive_call_of_the_bucket_being_built_runs_uncached():
    @sc.cached(backend="eager")
    def countdown(x, n: int):
        return x if n == 0 else countdown(x, n - 1) + 1  # n is keyed: each level its own bucket

    assert torch.equal(countdown(torch.zeros(2), 3), torch.full((2,), 3.0))
    assert (sc.stats(countdown)["builds"], sc.stats(countdown)["busy_misses"]) == (4, 0)

    @sc.cached(backend="eager")
    def same(x):
        if x.sum() > 0:
            return same(x - 1) + 1  # same shape: the same bucket, being built right now
        return x

    assert torch.equal(same(torch.ones(2)), torch.ones(2))
    st = sc.stats(same)
    assert (st["builds"], st["busy_misses"]) == (1, 1)


def deepest(function) -> int:
    """The deepest recursion `function(x, n)` reaches before RecursionError."""
    low, high = 1, 5000
    while low < high:
        middle = (low + high + 1) // 2
        try:
            function(torch.zeros(1), middle)
            low = middle
        except RecursionError:
            high = middle - 1
    return low


def test_a_cached_recursive_function_goes_as_deep_as_under_any_decorator():
    # Each level used to cost the builder's frame besides the call's: 312 levels against 498
    # for a plain decorator and 996 undecorated (recursion limit 1000).
    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            return function(*args, **kwargs)

        return wrapper

    @decorate
    def decorated(x, n: int):
        return x if n == 0 else decorated(x, n - 1) + 1

    @sc.cached(backend="eager")
    def cached(x, n: int):
        return x if n == 0 else cached(x, n - 1) + 1  # every level a new bucket: a build each

    assert deepest(cached) >= 0.95 * deepest(decorated)
    assert torch.equal(cached(torch.zeros(1), 100), torch.full((1,), 100.0))  # and the entries serve the next call


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the warning, reported instead
def test_an_entry_that_cannot_be_kept_says_why_and_never_fails_the_computed_call():
    @sc.cached(backend="eager", max_entries=1)
    def f(x):
        if x.shape[0] == 2:
            return f(torch.ones(3)).sum() + x  # runs while the (2,) entry runs, and is pinned
        return x

    f(torch.ones(2))  # builds (2,); its inner call builds (3,), then (2,) evicts it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # -W error: the warning must not turn the result into an error
        out = f(torch.ones(2))  # hit on (2,), pinned; the inner (3,) cannot be kept beside it
    assert torch.equal(out, torch.full((2,), 4.0))
    assert sc.stats(f)["fallbacks"] == 1


def test_the_rejection_warning_names_the_count_limit_when_bytes_are_not_the_reason():
    @sc.cached(backend="eager", max_entries=1)
    def g(x):
        if x.shape[0] == 2:
            return g(torch.ones(3)).sum() + x
        return x

    g(torch.ones(2))
    with pytest.warns(RuntimeWarning, match=r"was not kept: all 1 entries on cpu are running, and max_entries=1 leaves "
                                             r"no room beside them; the bucket is built again"):
        g(torch.ones(2))
