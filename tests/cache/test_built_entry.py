"""What a builder returns (BuiltEntry), as the cache reads it once the builder has returned
(csrc/cache/built_entry.h): the runner and guard it makes from it, the state the build started
from, the graph's first run, and results it refuses."""

import warnings

import pytest
import torch

from shapecache._backends import BuiltEntry
from shapecache._backends.guards import record
from shapecache._extension import _C


def dispatcher(builder):
    cache = _C.ShapeCache(lambda device: 10**9, None)
    return _C.ShapeDispatcher(lambda x: x * 2, builder, cache, [], ["x"], None, False)


def no_background_builds(timeout: float = 120.0) -> None:
    """Waits until no background build of any earlier test is waiting or running."""
    import time

    deadline = time.monotonic() + timeout
    while _C.pending_builds():
        assert time.monotonic() < deadline, "an earlier test's background builds did not end"
        time.sleep(0.05)


class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2.0


def test_a_graph_serves_the_bucket_from_the_call_tensors_and_its_first_run_is_the_answer():
    graph_calls = []

    def graph(*tensors):
        graph_calls.append(len(tensors))
        return [tensors[0] * 2]

    f = dispatcher(lambda args, kwargs, handle: BuiltEntry(None, 0, graph=graph, backend="compile", ran_call=False))
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))  # the build's first run
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))  # a hit
    assert graph_calls == [1, 1]
    (entry,) = f.stats()["entries"]
    assert entry["backend"] == "compile" and entry["hits"] == 1


@pytest.mark.parametrize("error", [RuntimeError, torch.OutOfMemoryError])
def test_a_graph_whose_first_run_raises_leaves_its_bucket_uncached_with_the_plain_answer(error):
    # Out of memory too: the graph needs more than the plain call, which answers; nothing is
    # evicted and nothing is built again.
    builds = []

    def graph(*tensors):
        raise error("a kernel that cannot run")

    def builder(args, kwargs, handle):
        builds.append(1)
        return BuiltEntry(None, 0, graph=graph, backend="compile", ran_call=False)

    f = dispatcher(builder)
    with pytest.warns(RuntimeWarning, match=f"its first run raised {error.__name__}: a kernel that cannot run"):
        out = f(torch.ones(3))
    assert len(builds) == 1
    assert torch.equal(out, torch.full((3,), 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    assert f.stats()["entries"] == [] and f.stats()["fallbacks"] == 1


def test_a_change_while_the_entry_was_built_leaves_it_stale_and_it_is_built_again():
    holder = Holder()
    builds = []

    def builder(args, kwargs, handle):
        built_from = _C.StateGuard(record({"holder": holder}))
        builds.append(holder.scale)
        if len(builds) == 1:
            holder.scale = 3.0  # another thread's change, made while this build compiled
        scale = holder.scale
        return BuiltEntry(lambda x: x * scale, 0, backend="compile", guard=record({"holder": holder}),
                          built_from=built_from, ran_call=False)

    f = dispatcher(builder)
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))  # the plain call's answer, not the stale entry's
    f(torch.ones(2))  # built again, from the state as it is now
    assert builds == [2.0, 3.0]
    assert f.stats()["invalidations"] == 1
    f(torch.ones(2))
    assert len(builds) == 2


def test_a_tensor_updated_in_place_after_the_record_read_it_makes_the_guard_stale():
    t = torch.zeros(2)
    recorded = record({}, tensors=[("t", t)])
    t.add_(1)  # after the record, before the guard is made from it (when the cache reads the entry)
    guard = _C.StateGuard(recorded)
    assert not guard.check() and "t" in guard.changed
    assert _C.StateGuard(record({}, tensors=[("t", t)])).check()


def test_a_runner_made_in_cpp_serves_with_its_own_guard_and_takes_no_second_one():
    # A runner made already (a CUDA graph's; here the graph runner of another function's
    # entry, which computes the same) holds the guard it was made with: the cache reads that one.
    holder = Holder()
    cache = _C.ShapeCache(lambda device: 10**9, None)
    made = _C.ShapeDispatcher(lambda x: x * holder.scale, lambda args, kwargs, handle: BuiltEntry(
        None, 0, graph=lambda t: [t * holder.scale], guard=record({"holder": holder}), ran_call=False),
        cache, [], ["x"], None, False)
    made(torch.ones(3))
    guards_given = [record({"holder": holder}), None]

    def reuse(args, kwargs, handle):
        if not guards_given:
            return BuiltEntry(None, 0, failure="built once only", ran_call=False)
        ((_, runner, _),) = handle.entries()
        return BuiltEntry(None, 0, backend="compile", entry_runner=runner, guard=guards_given.pop(0), ran_call=False)

    served = _C.ShapeDispatcher(lambda x: x * holder.scale, reuse, cache, [], ["x"], None, False)
    with pytest.raises(ValueError, match="entry_runner holds its own guard; its guard and built_from must be None"):
        served(torch.ones(3))
    assert served.stats()["entries"] == []
    assert torch.equal(served(torch.ones(3)), torch.full((3,), 2.0))
    assert served.stats()["entries"][0]["backend"] == "compile"
    holder.scale = 3.0  # what the runner's own guard holds: the entry is stale, and built again
    with pytest.warns(RuntimeWarning, match="built once only"):
        assert torch.equal(served(torch.ones(3)), torch.full((3,), 3.0))
    assert served.stats()["invalidations"] == 1


@pytest.mark.parametrize("returned,error,message", [
    (BuiltEntry(lambda x: x, 0, graph=lambda *t: t), ValueError, "one of a runner, a graph and an entry_runner, not several"),
    (BuiltEntry(None, 0), ValueError, "with no runner needs a failure"),
    (BuiltEntry(lambda x: x, 0, guard={"not": "a record"}), TypeError, "guard must be a GuardRecord or None, got dict"),
    (BuiltEntry(None, 0, entry_runner=lambda x: x), TypeError, "entry_runner must be a shapecache._C runner, got function"),
    (("a", "tuple"), TypeError, "must return a shapecache BuiltEntry, got tuple"),
])
def test_a_result_that_is_no_entry_is_refused_naming_what_is_wrong(returned, error, message):
    f = dispatcher(lambda args, kwargs, handle: returned)
    with pytest.raises(error, match=message):
        f(torch.ones(2))
    assert f.stats()["entries"] == []


def test_an_inline_build_that_built_nothing_answers_with_the_plain_call():
    f = dispatcher(lambda args, kwargs, handle: BuiltEntry(None, 0, failure="no compiler here", ran_call=False))
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
    assert f.stats()["entries"] == []


def test_an_entry_that_raises_on_a_hit_is_one_fallback_and_its_bucket_runs_uncached():
    runs = []

    def graph(*tensors):
        runs.append(len(runs))
        if len(runs) > 1:  # its first run (the build's) answers; the hit raises
            raise RuntimeError("a kernel that fails on its second run")
        return [tensors[0] * 2]

    f = dispatcher(lambda args, kwargs, handle: BuiltEntry(None, 0, graph=graph, backend="compile", ran_call=False))
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    with pytest.warns(RuntimeWarning, match=r"raised \(RuntimeError: a kernel that fails on its second run\) where the "
                                            r"uncached call did not; that bucket runs uncached from now on"):
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))  # the plain call answers
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    stats = f.stats()
    assert (stats["fallbacks"], stats["uncached_calls"], stats["entries"], len(runs)) == (1, 1, [], 2)


def test_entries_released_counts_each_entry_let_go_once_and_nothing_for_builds_and_hits():
    # What a build reads to decide whether a full garbage collection can free anything
    # (compile.free_what_entries_left). The interpreter's collector is held off, so that no
    # other test's cache ends meanwhile.
    import gc

    def graph(*tensors):
        return [tensors[0] * 2]

    def failing(*tensors):
        raise RuntimeError("a kernel that cannot run")

    def builder(args, kwargs, handle):
        fails = args[0].shape[0] == 7
        return BuiltEntry(None, 400, graph=failing if fails else graph, backend="compile", ran_call=False)

    cache = _C.ShapeCache(lambda device: 1000, None)  # two entries of 400 bytes fit, not three
    f = _C.ShapeDispatcher(lambda x: x * 2, builder, cache, [], ["x"], None, False)
    no_background_builds()  # an earlier test's, which would let go of what it built meanwhile
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = _C.entries_released()
        for n in (1, 2, 1, 2):  # two builds, two hits
            assert torch.equal(f(torch.ones(n)), torch.full((n,), 2.0))
        assert _C.entries_released() == start
        f(torch.ones(3))  # the least recently used is evicted
        assert len(f.stats()["entries"]) == 2 and f.stats()["evictions"] == 1
        assert _C.entries_released() == start + 1
        with pytest.warns(RuntimeWarning, match="its first run raised"):
            # Room for it is made first (one more eviction); built, it is never inserted.
            assert torch.equal(f(torch.ones(7)), torch.full((7,), 2.0))
        assert f.stats()["evictions"] == 2 and _C.entries_released() == start + 3
        held = len(f.stats()["entries"])
        cache.clear()
        assert held == 1 and _C.entries_released() == start + 4
    finally:
        if enabled:
            gc.enable()


def test_an_entry_released_between_its_check_and_its_run_is_served_as_a_stale_miss_and_built_again():
    # A CUDA graph released by another thread's pool rebuild while the hit waited for the
    # device's lock (csrc/cache/entry_runner.h, EntryReleased): never run, never given up.
    runners = []

    def builder(args, kwargs, handle):
        runners.append(_C._testing.ReleasedBeforeRun(lambda x: x * 2))
        return BuiltEntry(None, 0, backend="compile", entry_runner=runners[-1], ran_call=False)

    f = dispatcher(builder)
    x = torch.arange(3.0)
    assert torch.equal(f(x), x * 2) and torch.equal(f(x), x * 2)  # built, then a hit
    assert len(runners) == 1
    runners[0].released = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no bucket given up, no fallback warned of
        assert torch.equal(f(x), x * 2)
    assert len(runners) == 2  # built again
    stats = f.stats()
    assert stats["fallbacks"] == 0 and len(stats["entries"]) == 1
    assert torch.equal(f(x), x * 2) and len(runners) == 2  # the new entry serves
