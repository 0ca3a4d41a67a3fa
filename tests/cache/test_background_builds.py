"""build="background": a miss runs the call uncached at once and queues the bucket's build for
the device's worker thread; the bucket's calls run uncached until the entry is in, then hit it.

Most tests drive the C++ dispatcher with a builder that waits on an event, standing in for a
compiler that takes minutes; one builds with the real compile backend.
"""

import threading
import time
import warnings

import pytest
import torch

import shapecache as sc
from shapecache import _background
from shapecache._backends import BuiltEntry
from shapecache._backends.guards import GuardRecord
from shapecache._extension import _C

WAIT = 30  # seconds: a generous bound on a build that should take milliseconds


class GatedBuilder:
    """Builds an eager entry of `nbytes` once `gate` is set; records each build's input size,
    whether the handle asked it to run the call, the grad mode it ran under and how many
    builds ran at once."""

    def __init__(self, function, nbytes=10, fail_with=None):
        self.function, self.nbytes, self.fail_with = function, nbytes, list(fail_with or [])
        self.gate = threading.Event()
        self.gate.set()
        self.sizes, self.run_calls, self.grad_modes = [], [], []
        self.running = self.most_at_once = 0
        self.started = threading.Event()

    def __call__(self, args, kwargs, handle):
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            self.started.set()
            assert self.gate.wait(WAIT), "the test never opened the gate"
            self.sizes.append(args[0].shape[0])
            self.run_calls.append(handle.run_call)
            self.grad_modes.append(torch.is_grad_enabled())
            if self.fail_with:
                raise self.fail_with.pop(0)
            return BuiltEntry(self.function, self.nbytes, None, "eager", ran_call=False)
        finally:
            self.running -= 1


class Counted:
    """x * 2, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return x * 2


def background(function, builder, budget=1000):
    cache = _C.ShapeCache(lambda device: budget, None)
    return _C.ShapeDispatcher(function, builder, cache, [], ["x"], None, False, background=lambda device: True,
                              wake_build_worker=_background.wake)


def wait(f, timeout=WAIT):
    return _background.wait([f], timeout)


def test_a_miss_answers_at_once_and_later_calls_hit_once_the_build_is_in():
    function = Counted()
    builder = GatedBuilder(function)
    builder.gate.clear()
    f = background(function, builder)
    x = torch.ones(3)
    assert torch.equal(f(x), x * 2)  # the builder is still waiting: the call ran uncached
    assert f.pending_builds == 1 and f.stats()["entries"] == []
    assert torch.equal(f(x), x * 2)  # the same bucket, still building: uncached, not queued again
    builder.gate.set()
    assert wait(f)
    assert torch.equal(f(x), x * 2)
    st = f.stats()
    assert (st["misses"], st["busy_misses"], st["hits"], st["builds"], st["background_builds"]) == (1, 1, 1, 1, 1)
    assert st["pending_builds"] == 0 and len(st["entries"]) == 1
    assert builder.sizes == [3] and builder.run_calls == [False]  # built once, told not to run the call
    assert function.calls == 3  # two uncached calls and one hit of the eager entry: the build ran none


def test_builds_run_one_at_a_time_in_request_order():
    builder = GatedBuilder(Counted())
    builder.gate.clear()
    f = background(builder.function, builder)
    for n in (5, 2, 7, 2, 4):
        f(torch.ones(n))
    assert builder.started.wait(WAIT)
    assert f.pending_builds == 4  # 2 was asked for twice: queued once
    builder.gate.set()
    assert wait(f)
    assert builder.sizes == [5, 2, 7, 4] and builder.most_at_once == 1
    assert len(f.stats()["entries"]) == 4


def test_the_build_runs_under_the_callers_grad_mode():
    builder = GatedBuilder(Counted())
    f = background(builder.function, builder)
    with torch.no_grad():
        f(torch.ones(2))
    assert wait(f)
    assert builder.grad_modes == [False]


def test_a_failed_build_warns_once_and_leaves_its_bucket_uncached():
    builder = GatedBuilder(Counted(), fail_with=[ValueError("the compiler broke")])
    f = background(builder.function, builder)
    with pytest.warns(RuntimeWarning, match=r"background build of x=\(3,\).*ValueError: the compiler broke.*uncached"):
        f(torch.ones(3))
        assert wait(f)
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    st = f.stats()
    assert (st["fallbacks"], st["uncached_calls"], st["entries"]) == (1, 1, [])
    assert builder.sizes == [3]  # not built again
    f.clear()  # lets it be built again
    f(torch.ones(3))
    assert wait(f) and len(f.stats()["entries"]) == 1


def test_a_build_out_of_memory_twice_fails_no_call_and_is_tried_again_from_the_next_miss():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    builder = GatedBuilder(Counted(), fail_with=[oom, oom])
    f = background(builder.function, builder)
    with pytest.warns(RuntimeWarning, match="ran out of memory twice"):
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
        assert wait(f)
    st = f.stats()
    assert (st["oom_retries"], st["fallbacks"], st["entries"]) == (1, 1, [])
    f(torch.ones(3))  # queued again, and built this time
    assert wait(f) and len(f.stats()["entries"]) == 1 and builder.sizes == [3, 3, 3]


def test_clear_cancels_the_queued_builds_and_drops_the_running_ones_result():
    builder = GatedBuilder(Counted())
    builder.gate.clear()
    f = background(builder.function, builder)
    for n in (1, 2, 3):
        f(torch.ones(n))
    assert builder.started.wait(WAIT)  # 1 is building, 2 and 3 wait
    assert f.pending_builds == 3
    f.clear()
    assert f.pending_builds == 1
    builder.gate.set()
    assert wait(f)
    assert builder.sizes == [1] and f.stats()["entries"] == []
    f(torch.ones(2))  # the cancelled bucket can be queued again
    assert wait(f) and [e["bucket"] for e in f.stats()["entries"]] == ["x=(2,) float32 cpu"]


def test_background_builds_keep_the_budget():
    builder = GatedBuilder(Counted(), nbytes=40)
    f = background(builder.function, builder, budget=100)
    for n in range(1, 7):
        f(torch.ones(n))
        assert wait(f)
        st = f.stats()
        assert st["bytes"] <= 100 and len(st["entries"]) <= 2
    assert f.stats()["evictions"] == 4


def test_queue_build_builds_without_running_the_call():
    function = Counted()
    builder = GatedBuilder(function)
    f = background(function, builder)
    assert f.queue_build(torch.ones(4))
    assert not f.queue_build(torch.ones(4))  # queued already
    assert wait(f)
    assert not f.queue_build(torch.ones(4))  # built already
    assert function.calls == 0 and builder.sizes == [4]
    f(torch.ones(4))
    assert f.stats()["hits"] == 1


def test_wait_times_out_while_a_build_runs():
    builder = GatedBuilder(Counted())
    builder.gate.clear()
    f = background(builder.function, builder)
    f(torch.ones(1))
    assert not wait(f, timeout=0.05)
    builder.gate.set()
    assert wait(f)


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"build='later': expected 'inline' .* or 'background'"):
        sc.cached(lambda x: x, build="later")
    f = sc.cached(lambda x: x, build="background", backend="eager")
    with pytest.raises(ValueError, match=r"timeout=-1: expected a number >= 0"):
        sc.wait(f, timeout=-1)
    with pytest.raises(TypeError, match=r"wait: expected a function or module wrapped by shapecache.cached"):
        sc.wait(lambda x: x)


@pytest.mark.slow
def test_the_compile_backend_builds_in_the_background_and_answers_as_the_plain_model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 3, 1)).eval()
    plain = [torch.nn.Sequential(*net).eval()]  # the same layers, called without the cache
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        expected = plain[0](x)
        sc.cached(net, backend="compile", build="background", budget="1GiB")
        assert torch.equal(net(x), expected)  # uncached: the plain model's own kernels
        assert sc.wait(net, timeout=300)
        st = sc.stats(net)
        assert [e["backend"] for e in st["entries"]] == ["compile"] and st["background_builds"] == 1
        torch.testing.assert_close(net(x), expected)
        assert sc.stats(net)["hits"] == 1
        net[0].weight.mul_(2)  # the entry is stale: it runs uncached again while it is rebuilt
        expected = plain[0](x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the rebuild warns nothing
            torch.testing.assert_close(net(x), expected)
            assert sc.wait(net, timeout=300)
        torch.testing.assert_close(net(x), expected)
    st = sc.stats(net)
    assert (st["invalidations"], st["background_builds"], st["hits"]) == (1, 2, 2)


def test_waiting_from_inside_a_background_build_is_refused_not_a_deadlock():
    seen = []

    def builder(args, kwargs, handle):
        try:
            _background.wait([f], timeout=None)
        except RuntimeError as error:
            seen.append(str(error))
        return BuiltEntry(Counted(), 0, None, "eager", ran_call=False)

    f = background(Counted(), builder)
    f(torch.ones(1))
    assert wait(f)
    assert seen == ["shapecache.wait was called from a background build, which would wait for itself"]


def test_a_list_the_caller_changes_after_the_miss_is_built_as_it_was_at_the_call():
    seen = []

    def builder(args, kwargs, handle):
        seen.append(list(args[1]))
        return BuiltEntry(lambda x, scales: x * scales[0], 0, None, "eager", ran_call=False)

    cache = _C.ShapeCache(lambda device: 1000, None)
    f = _C.ShapeDispatcher(lambda x, scales: x * scales[0], builder, cache, [], ["x", "scales"], None, False,
                           background=lambda device: True, wake_build_worker=_background.wake)
    scales = [2.0]
    f(torch.ones(2), scales)
    scales[0] = 3.0  # after the call, before the worker builds
    assert wait(f)
    assert seen == [[2.0]]


def test_a_call_that_raises_queues_no_build():
    def failing(x):
        raise ValueError("not ready")

    builder = GatedBuilder(failing)
    f = background(failing, builder)
    with pytest.raises(ValueError, match="not ready"):
        f(torch.ones(2))
    assert f.pending_builds == 0 and wait(f)
    assert builder.sizes == [] and f.stats()["fallbacks"] == 0


def test_the_worker_survives_a_builder_that_raises_anything_and_serves_the_builds_behind_it():
    class Stop(BaseException):
        pass

    builder = GatedBuilder(Counted(), fail_with=[Stop()])
    builder.gate.clear()
    f = background(builder.function, builder)
    f(torch.ones(1))
    f(torch.ones(2))
    with pytest.warns(RuntimeWarning, match=r"background build of x=\(1,\) .*failed"):
        builder.gate.set()
        assert wait(f)
    assert builder.sizes == [1, 2] and [e["bucket"] for e in f.stats()["entries"]] == ["x=(2,) float32 cpu"]

    def wrong_type(args, kwargs, handle):
        return ("not", "a", "BuiltEntry")

    g = background(Counted(), wrong_type)
    with pytest.warns(RuntimeWarning, match="must return a shapecache BuiltEntry, got tuple"):
        g(torch.ones(3))
        assert wait(g)
    assert g.stats()["fallbacks"] == 1


def test_a_build_cleared_while_it_runs_and_then_fails_leaves_the_bucket_free_to_build():
    builder = GatedBuilder(Counted(), fail_with=[ValueError("late")])
    builder.gate.clear()
    f = background(builder.function, builder)
    f(torch.ones(1))
    assert builder.started.wait(WAIT)
    f.clear()
    builder.gate.set()
    assert wait(f)
    assert f.stats()["fallbacks"] == 0
    f(torch.ones(1))
    assert wait(f) and len(f.stats()["entries"]) == 1


def test_queue_build_counts_no_call_and_keeps_the_calls_sum():
    builder = GatedBuilder(Counted())
    f = background(builder.function, builder)
    assert f.queue_build(torch.ones(1)) and wait(f)
    f(torch.ones(1))
    st = f.stats()
    assert st["calls"] == st["hits"] + st["misses"] + st["busy_misses"] + st["uncached_calls"] == 1


def test_wait_inside_the_call_that_queued_the_build_returns_when_it_is_built():
    builder = GatedBuilder(Counted())
    results = []

    def function(x):
        results.append(wait(f, timeout=WAIT))  # the call has not returned: the worker is woken for it
        return x * 2

    f = background(function, builder)
    f(torch.ones(1))
    assert results == [True]


def test_a_busy_worker_does_not_start_a_build_while_the_call_that_queued_it_runs():
    builder = GatedBuilder(Counted())
    builder.gate.clear()
    built_during_the_call = []

    def function(x):
        if x.shape[0] == 2:  # the worker is busy with size 1: free it, and give it time to look
            builder.gate.set()
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline and builder.sizes != [1, 2]:
                time.sleep(0.01)
            built_during_the_call.append(list(builder.sizes))
        return x * 2

    f = background(function, builder)
    f(torch.ones(1))
    assert builder.started.wait(WAIT)  # size 1 is building, held at the gate
    f(torch.ones(2))
    assert built_during_the_call == [[1]]  # size 2's build waited for its call to return
    assert wait(f) and builder.sizes == [1, 2]


def test_a_build_queued_inside_another_cached_call_waits_for_the_outermost_to_return():
    inner_builder = GatedBuilder(Counted())
    inner = background(inner_builder.function, inner_builder)
    built_during_the_outer_call = []

    def outer_function(x):
        inner(x)  # a miss: queues the inner function's build, then returns
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and not inner_builder.sizes:
            time.sleep(0.01)
        built_during_the_outer_call.append(list(inner_builder.sizes))
        return x * 2

    outer = background(outer_function, GatedBuilder(outer_function))
    outer(torch.ones(3))
    assert built_during_the_outer_call == [[]]
    assert wait(inner) and wait(outer) and inner_builder.sizes == [3]


def test_an_entry_whose_first_run_updates_what_it_reads_is_given_up_not_rebuilt_per_call():
    steps = torch.zeros(1)

    def builder(args, kwargs, handle):
        guard = GuardRecord()
        guard.tensors.append((steps, "steps", steps._version))

        def runner(x):
            steps.add_(1)  # as BatchNorm in training updates its statistics
            return x * 2

        return BuiltEntry(runner, 0, None, "compile", guard, ran_call=False)

    f = background(lambda x: (steps.add_(1), x * 2)[1], builder)
    f(torch.ones(1))
    assert wait(f)
    with pytest.warns(RuntimeWarning, match="the call updates what it reads: .*steps"):
        f(torch.ones(1))  # the entry's first run: its update is the call's one update
    for _ in range(3):
        f(torch.ones(1))
    st = f.stats()
    assert (st["hits"], st["uncached_calls"], st["background_builds"], st["invalidations"]) == (1, 3, 1, 0)
    assert steps.item() == 5  # once per call


def test_a_full_queue_runs_misses_uncached_without_queuing():
    builder = GatedBuilder(Counted())
    builder.gate.clear()
    f = background(builder.function, builder)
    f(torch.ones(1))
    assert builder.started.wait(WAIT)  # size 1 runs; the queue holds what waits
    for n in range(2, 2 + 64 + 3):
        f(torch.ones(n))
    assert f.pending_builds == 1 + 64 and f.stats()["uncached_calls"] == 3
    _C.cancel_all_builds()
    builder.gate.set()
    assert wait(f)


def test_a_build_runs_with_short_build_changes_and_the_interval_is_restored_after():
    # Serving threads release the GIL at every torch operator; while a build (pure Python)
    # runs, each would wait a whole switch interval to get it back.
    import sys

    seen = []

    def builder(args, kwargs, handle):
        seen.append(sys.getswitchinterval())
        return BuiltEntry(lambda x: x * 2, 0, None, "eager", ran_call=False)

    before = sys.getswitchinterval()
    f = background(lambda x: x * 2, builder)
    f(torch.ones(3))
    assert wait(f)
    assert seen == [min(before, _background.BUILD_SWITCH_INTERVAL)]
    assert sys.getswitchinterval() == before


class Owner(torch.nn.Module):
    def forward(self, x):
        return x * 2


def owned_background(guarded: bool):
    """A background-building dispatcher of Owner.forward bound to a new Owner, whose builder
    waits for `gate` and records each build's size; its entries guard the module when
    `guarded`. Returns (dispatcher, owner, gate, started, sizes)."""
    from shapecache._backends import guard_record

    gate, started, sizes = threading.Event(), threading.Event(), []

    def builder(args, kwargs, handle):
        started.set()
        assert gate.wait(WAIT), "the test never opened the gate"
        sizes.append(args[1].shape[0])  # args[0] is the module
        guard = guard_record({"self": args[0]}) if guarded else None
        return BuiltEntry(Owner.forward, 0, None, "eager", guard, ran_call=False)

    owner = Owner()
    f = _C.ShapeDispatcher(Owner.forward, builder, _C.ShapeCache(lambda device: 1000, None), [], ["x"], owner, False,
                           background=lambda device: True, wake_build_worker=_background.wake)
    return f, owner, gate, started, sizes


def test_a_queued_build_keeps_no_module_alive_and_is_dropped_when_its_module_is_gone():
    import gc
    import weakref

    f, owner, gate, started, sizes = owned_background(guarded=False)
    f(torch.ones(1))
    assert started.wait(WAIT)  # the first build runs (it holds its module until it ends)
    f(torch.ones(2))  # queued behind it
    gone = weakref.ref(owner)
    del owner
    gate.set()
    assert wait(f)
    gc.collect()
    assert gone() is None
    assert sizes == [1]  # the second build was dropped: nothing could call its entry
    assert f.pending_builds == 0


def test_ctrl_c_with_a_build_running_exits_as_interrupted():
    # A build that runs source from a string (as code generation does) after the interrupt
    # clears CPython's "ended by KeyboardInterrupt" flag; the process must still end by SIGINT.
    import signal
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, signal, threading, time, torch
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a test runner's worker may ignore it
        from shapecache import _background
        from shapecache._backends import BuiltEntry
        from shapecache._extension import _C

        def builder(args, kwargs, handle):
            time.sleep(1.0)  # the interrupt ends the main module meanwhile
            exec("generated = 1")
            return BuiltEntry(lambda x: x, 0, None, "eager", ran_call=False)

        cache = _C.ShapeCache(lambda device: 1000, None)
        f = _C.ShapeDispatcher(lambda x: x, builder, cache, [], ["x"], None, False, background=lambda d: True,
                               wake_build_worker=_background.wake)
        f(torch.ones(1))
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        time.sleep(30)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGINT, (out.returncode, out.stderr[-2000:])
    assert out.stderr.count("KeyboardInterrupt") == 1  # the user's traceback, once


def test_a_cached_function_let_go_of_cancels_its_queued_builds_though_its_entries_hold_its_module():
    # An entry's guard holds the module strongly; the queue holds the cached function weakly,
    # so a function nothing else holds is freed, its queued builds cancelled, and its module goes.
    import gc
    import weakref

    f, owner, gate, started, sizes = owned_background(guarded=True)
    f(torch.ones(1))
    assert started.wait(WAIT)
    f(torch.ones(2))
    f(torch.ones(3))
    gone_owner, gone_function = weakref.ref(owner), weakref.ref(f)
    del owner, f
    gate.set()
    deadline = time.monotonic() + WAIT
    while _C.pending_builds() and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.collect()
    assert _C.pending_builds() == 0 and sizes == [1]
    assert gone_function() is None and gone_owner() is None


def test_a_build_thread_runs_below_the_process_whatever_niceness_the_process_started_at():
    # A host may start its workers niced (Ray: 15); a build's priority is relative to the
    # process's, never an absolute value above it.
    import subprocess
    import sys

    script = ("import os, threading\nos.nice(7)\nfrom shapecache import _background\nseen = []\n"
              "def run():\n    _background.lower_priority()\n"
              "    seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))\n"
              "t = threading.Thread(target=run); t.start(); t.join()\n"
              "print(os.getpriority(os.PRIO_PROCESS, os.getpid()), seen[0])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    process, thread = (int(v) for v in done.stdout.split())
    assert process >= 7
    assert thread == min(19, process + _background.BUILD_NICENESS)


class Recorded(_background.Publication):
    """A publication that notes when it ran (after which builds), or that it was dropped."""

    def __init__(self, key, owner, log, gate=None, builds_done=lambda: None):
        self.key, self.owner, self.log, self.gate, self.builds_done = key, owner, log, gate, builds_done

    def run(self):
        done = self.builds_done()
        if self.gate is not None:
            assert self.gate.wait(WAIT), "the test never opened the gate"
        self.log.append(("ran", self.key) if done is None else ("ran", self.key, done))

    def drop(self):
        self.log.append(("dropped", self.key))


def test_publications_run_on_the_worker_after_the_builds_waiting_and_wait_waits_for_its_owners_own():
    function = Counted()
    builder = GatedBuilder(function)
    builder.gate.clear()
    f = background(function, builder)
    other = background(Counted(), GatedBuilder(Counted()))
    log = []
    gate = threading.Event()
    f(torch.ones(1))  # a build, held at its gate
    assert builder.started.wait(WAIT)
    cpu = torch.device("cpu")
    assert _background.publish_later(cpu, Recorded("a", f.function, log, gate, lambda: list(builder.sizes)))
    assert not _background.publish_later(cpu, Recorded("a", f.function, log))  # its key is queued already
    f(torch.ones(2))  # a second build, queued after the publication
    builder.gate.set()
    assert not wait(f, timeout=0.5)  # the publication is still held
    assert wait(other, timeout=0.5)  # another function's wait does not wait for it
    gate.set()
    assert wait(f)
    assert log == [("dropped", "a"), ("ran", "a", [1, 2])]  # both builds ran before the publication started


def test_publications_beyond_the_limit_are_dropped_not_queued():
    log = []
    gate = threading.Event()
    cpu = torch.device("cpu")
    queued = [_background.publish_later(cpu, Recorded(f"k{i}", wait, log, gate))
              for i in range(_background.MAX_PUBLICATIONS + 2)]
    gate.set()
    deadline = time.monotonic() + WAIT
    while _background._publishing and time.monotonic() < deadline:
        time.sleep(0.01)
    # The first starts running at once (no longer waiting); MAX_PUBLICATIONS wait behind it.
    assert queued.count(True) in (_background.MAX_PUBLICATIONS, _background.MAX_PUBLICATIONS + 1)
    assert sorted(key for what, key in log if what == "ran") == sorted(f"k{i}" for i, q in enumerate(queued) if q)
    assert [key for what, key in log if what == "dropped"] == [f"k{i}" for i, q in enumerate(queued) if not q]
