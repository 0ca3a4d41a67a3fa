"""What a thread lets go of during a CUDA graph capture is destroyed when the capture ends
(csrc/core/destroy_after_capture.h, rules D1 to D4), run on the CPU over probes that record
their destruction: (id, whether the destroying thread had a scope open then, whether it was
the thread that let go of it). The CUDA graph runner destroys every graph through this class;
why (torch 2.11 and 2.13 destroy a graph without relaxing the thread's capture mode) is in the
header."""

import threading

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from shapecache._extension import _C

Probe = _C._testing.DestroyAfterCaptureProbe


def ids(probe):
    return [entry[0] for entry in probe.destroyed]


def test_kept_while_capturing_on_this_thread_destroyed_in_order_when_it_ends():
    probe = Probe()
    probe.destroy(1)
    assert probe.destroyed == [(1, False, True)]  # no scope: at once (D2)
    probe.open()
    probe.destroy(2)
    probe.destroy(3)
    assert ids(probe) == [1] and probe.kept == 2  # D1
    probe.close()
    assert probe.destroyed == [(1, False, True), (2, False, True), (3, False, True)]  # D3: in order, scope closed
    assert probe.kept == 0


def test_another_thread_destroys_at_once_while_this_one_captures():
    probe = Probe()
    probe.open()
    other = threading.Thread(target=probe.destroy, args=(7,))
    other.start()
    other.join(timeout=30)
    assert not other.is_alive()
    assert probe.destroyed == [(7, False, True)]  # D2: the other thread has no scope open
    probe.close()


def test_a_destructor_that_lets_go_of_another_object_destroys_it_at_once():
    probe = Probe()
    probe.open()
    probe.destroy(1, then=2)
    probe.close()
    assert ids(probe) == [1, 2] and probe.kept == 0  # D3, D4: no deadlock, nothing left kept


def test_nested_scopes_keep_until_the_outermost_closes():
    probe = Probe()
    probe.open()
    probe.open()
    probe.destroy(1)
    probe.close()
    assert ids(probe) == []
    probe.close()
    assert ids(probe) == [1]


def test_a_capture_that_fails_destroys_what_it_kept():
    probe = Probe()
    probe.destroy_in_failing_capture([4, 5])
    assert probe.destroyed == [(4, False, True), (5, False, True)]
    assert probe.kept == 0


class Deferral(RuleBasedStateMachine):
    """Random opens, closes and releases on this thread: nothing is destroyed with a scope open,
    everything let go of is destroyed once no scope is, in the order it was let go of."""

    def __init__(self):
        super().__init__()
        self.probe = Probe()
        self.depth = 0
        self.next_id = 0
        self.expected = []  # ids destroyed so far, in order
        self.pending = []  # let go of inside the open scope

    @rule()
    def open(self):
        self.probe.open()
        self.depth += 1

    @rule()
    def close(self):
        if self.depth == 0:
            return
        self.probe.close()
        self.depth -= 1
        if self.depth == 0:
            self.expected += self.pending
            self.pending = []

    @rule(chained=st.booleans())
    def destroy(self, chained):
        first = self.next_id
        self.next_id += 2 if chained else 1
        self.probe.destroy(first, then=first + 1 if chained else None)
        released = [first, first + 1] if chained else [first]
        (self.pending if self.depth else self.expected).extend(released)

    @invariant()
    def destroyed_only_outside_scopes_and_in_order(self):
        assert ids(self.probe) == self.expected
        assert all(not scope_open for _, scope_open, _ in self.probe.destroyed)

    def teardown(self):
        while self.depth:
            self.close()
        assert ids(self.probe) == self.expected and self.probe.kept == 0


TestDeferral = Deferral.TestCase
TestDeferral.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
