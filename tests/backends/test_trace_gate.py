"""A trace of the user's code kept apart from the runs of user code that shapecache makes on
other threads (csrc/cache/trace_gate.h, trace.py: _apart_from_other_threads), so that what the
trace writes into shared Python state is put back without undoing another thread's write; and
a trace the caller interrupts leaves what the call wrote, as the plain call does."""

import threading
import time

import torch

import shapecache as sc
from shapecache._extension import _C


def test_a_closed_gate_holds_other_threads_runs_of_user_code_and_lets_this_threads_through():
    started, release = threading.Event(), threading.Event()

    def slow(x):
        started.set()
        assert release.wait(30)
        return x + 1

    cached = sc.cached(slow, backend="eager")
    x = torch.ones(2)
    elsewhere = threading.Thread(target=cached, args=(x,))
    elsewhere.start()
    assert started.wait(30)
    assert _C.runs_elsewhere()[1] == 1  # in progress on the other thread
    assert not _C.close_trace_gate(0.2)  # it does not end in time: a trace beside it is not alone
    _C.open_trace_gate()
    release.set()
    elsewhere.join(30)

    before = _C.runs_elsewhere()[0]
    assert _C.close_trace_gate(5.0)  # none in progress: alone
    done = threading.Event()
    held = threading.Thread(target=lambda: (cached(x), done.set()))
    try:
        held.start()
        time.sleep(0.3)
        assert not done.is_set()  # waits at the gate
        torch.testing.assert_close(cached(x), x + 1)  # this thread's own runs pass
        assert _C.runs_elsewhere()[0] == before  # and are not counted as another thread's
    finally:
        _C.open_trace_gate()
    held.join(30)
    assert done.is_set() and _C.runs_elsewhere() == (before + 1, 0)


def test_a_thread_inside_a_run_of_user_code_cannot_close_the_gate():
    # It would wait for its own run, or for another thread's that waits for it.
    def closes(x):
        return torch.full_like(x, float(_C.close_trace_gate(1.0)))

    out = sc.cached(closes, backend="eager")(torch.ones(2))
    _C.open_trace_gate()
    assert out.tolist() == [0.0, 0.0]


STATE = {"interrupted": False}


def interrupted_once(x):
    """Interrupted on its first call (as Ctrl-C would), after noting so; answers after."""
    if not STATE["interrupted"]:
        STATE["interrupted"] = True
        raise KeyboardInterrupt
    return x * 2


def test_a_call_interrupted_during_its_trace_leaves_what_it_wrote_as_the_plain_call_does():
    # The trace was the call: the caller got its KeyboardInterrupt, so what it wrote stays
    # (only fake tensors would go), and the next call answers as the plain function's does.
    def calls(function):
        STATE["interrupted"] = False
        results = []
        for _ in range(2):
            try:
                results.append(function(torch.ones(2)).tolist())
            except KeyboardInterrupt:
                results.append("interrupted")
        return results

    with torch.no_grad():
        plain = calls(interrupted_once)
        cached = calls(sc.cached(interrupted_once, backend="compile"))
    assert plain == cached == ["interrupted", [2.0, 2.0]]
