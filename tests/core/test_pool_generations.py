"""The CUDA graph pool's lifecycle (csrc/core/pool_generations.h), run on the CPU against a model of
torch's allocators.

The model is what torch 2.11 to 2.13 do with a pool id, in c10/cuda/CUDACachingAllocator.cpp and
the CachingHostAllocator (the same rules for both), and the order of the steps in
ATen/cuda/CUDAGraph.cpp's capture_begin, capture_end and reset. Where torch asserts, the model
records a violation instead of aborting, and the test fails on it. Random sequences of captures
(failing at any step), releases and rebuilds must never incref a dead pool, leave a pool
recording, or lose count of a live graph.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shapecache._extension import _C


class Injected(RuntimeError):
    """A failure the test injects at one step of a capture."""


class AllocatorModel:
    """One of torch's allocators (device or host), as far as pool ids go."""

    def __init__(self, name):
        self.name = name
        self.use_count = {}  # pool id -> use count; an id stays known after reaching 0 (never emptied here)
        self.recording = set()
        self.violations = []

    def begin(self, pool):  # beginAllocateToPool: incref (or create), then refuse a second recording
        if pool in self.use_count:
            if self.use_count[pool] <= 0:
                self.violations.append(f"{self.name}: incref of pool {pool} whose use count reached 0 (torch aborts)")
            self.use_count[pool] += 1
        else:
            self.use_count[pool] = 1
        if pool in self.recording:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.recording.add(pool)

    def end(self, pool):  # endAllocateToPool
        if pool not in self.recording:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.recording.remove(pool)

    def release(self, pool):  # releasePool
        if pool not in self.use_count:
            self.violations.append(f"{self.name}: release of unknown pool {pool}")
            return
        self.use_count[pool] -= 1
        if self.use_count[pool] < 0:
            self.violations.append(f"{self.name}: pool {pool} released below 0 (torch asserts)")


STEPS = ("device_begin", "host_begin", "stream_begin", "body", "stream_end", "graph_check")


class GraphModel:
    """torch's CUDAGraph: capture_begin, capture_end and reset, step by step, failing where told."""

    def __init__(self, device, host, fail_at):
        self.device, self.host, self.fail_at = device, host, fail_at
        self.pool = None
        self.ended = False
        self.destroyed = False

    def _step(self, name):
        if self.fail_at == name:
            raise Injected(name)

    def capture_begin(self, pool):
        self.pool = pool
        self._step("device_begin")
        self.device.begin(pool)
        self._step("host_begin")
        self.host.begin(pool)
        self._step("stream_begin")

    def capture_end(self):
        self._step("stream_end")
        self.device.end(self.pool)
        self.host.end(self.pool)
        self._step("graph_check")
        self.ended = True

    def reset(self):  # the destructor: releases only a capture that ended
        if self.ended and not self.destroyed:
            self.device.release(self.pool)
            self.host.release(self.pool)
        self.destroyed = True


class PoolLifecycle(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.device = AllocatorModel("device")
        self.host = AllocatorModel("host")
        self.pool = _C.PoolGenerations()
        self.next_id = 1
        self.live = []  # graphs whose capture succeeded and that are not released

    def open_pool(self):  # at::cuda::graph_pool_handle(): a fresh id every time
        self.next_id += 1
        return (0, self.next_id)

    def capture(self, fail_at):
        graph = GraphModel(self.device, self.host, fail_at)

        def body():
            if fail_at == "body":
                raise Injected("body")

        try:
            pool = self.pool.capture(
                self.open_pool, graph.capture_begin, body, graph.capture_end, lambda: graph.ended,
                self.device.end, self.device.release, self.host.end, self.host.release,
            )
        except Injected:
            assert fail_at is not None
            self.drop(graph)  # the failed capture's graph is destroyed by the caller
            return
        assert fail_at is None and tuple(pool) == graph.pool
        self.live.append(graph)

    def drop(self, graph):
        ended = graph.ended
        graph.reset()
        if ended:
            self.pool.graph_released(graph.pool)

    @rule()
    def capture_succeeds(self):
        self.capture(None)

    @rule(step=st.sampled_from(STEPS))
    def capture_fails(self, step):
        self.capture(step)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release_one(self, data):
        graph = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.drop(graph)

    @rule(count=st.integers(1, 4))
    def release_all_and_capture_again(self, count):
        # A pool rebuild, clear() then new calls, an out-of-memory retry: every graph goes,
        # then captures start over. With one pool id for the process this aborted torch.
        while self.live:
            self.drop(self.live.pop())
        for _ in range(count):
            self.capture(None)

    @invariant()
    def torch_never_asserts(self):
        assert self.device.violations == [] and self.host.violations == []

    @invariant()
    def no_pool_is_left_recording(self):
        assert self.device.recording == set() and self.host.recording == set()

    @invariant()
    def every_live_graph_is_counted_in_its_generation(self):
        live = {}
        for graph in self.live:
            live[graph.pool] = live.get(graph.pool, 0) + 1
        for generation in self.pool.generations:
            pool = tuple(generation["id"])
            assert generation["graphs"] == live.get(pool, 0)
            assert self.device.use_count.get(pool, 0) == live.get(pool, 0)
            assert self.host.use_count.get(pool, 0) == live.get(pool, 0)
            assert not generation["recording"]
        assert self.pool.live_graphs == len(self.live)

    @invariant()
    def only_the_newest_generation_may_be_open(self):
        generations = self.pool.generations
        assert all(g["retired"] for g in generations[:-1])


TestPoolLifecycle = PoolLifecycle.TestCase
TestPoolLifecycle.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)


def test_capture_after_every_graph_is_released_opens_a_fresh_pool():
    machine = PoolLifecycle()
    machine.capture(None)
    first = machine.live[0].pool
    machine.drop(machine.live.pop())
    machine.capture(None)
    assert machine.live[0].pool != first  # the old id reached use count 0: never begun again
    assert [g["retired"] for g in machine.pool.generations] == [True, False]
    machine.torch_never_asserts()


@pytest.mark.parametrize("step", STEPS)
def test_a_failed_capture_leaves_both_allocators_clean_and_the_next_capture_works(step):
    machine = PoolLifecycle()
    machine.capture(None)
    machine.capture(step)
    machine.capture(None)
    machine.torch_never_asserts()
    machine.no_pool_is_left_recording()
    machine.every_live_graph_is_counted_in_its_generation()
    assert len(machine.live) == 2


def test_a_second_capture_while_one_records_is_refused_before_touching_the_allocators():
    machine = PoolLifecycle()
    inner_error = []

    def body():
        try:
            machine.pool.capture(machine.open_pool, lambda pool: machine.device.begin(tuple(pool)), lambda: None,
                                 lambda: None, lambda: False, machine.device.end, machine.device.release,
                                 machine.host.end, machine.host.release)
        except RuntimeError as error:
            inner_error.append(str(error))

    graph = GraphModel(machine.device, machine.host, None)
    machine.pool.capture(machine.open_pool, graph.capture_begin, body, graph.capture_end, lambda: graph.ended,
                         machine.device.end, machine.device.release, machine.host.end, machine.host.release)
    assert inner_error and "a capture is underway in this pool already" in inner_error[0]
    assert machine.device.use_count[graph.pool] == 1  # the refused capture took no reference
