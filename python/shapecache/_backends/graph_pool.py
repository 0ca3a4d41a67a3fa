"""A device's graph pool: what it and each graph cost, and rebuilding it largest first.

Every CUDA graph of a device is captured into one memory pool
(csrc/cache/cuda/cuda_graph_runner.h). Captured largest first, the pool is as large as the largest bucket
needs: every smaller graph reuses blocks the largest one freed. Captured in another order,
each larger graph adds blocks of its own and the pool ends up larger than any one bucket.

Costs come from the allocator's own figures, never estimates:
- the pool: the bytes of the allocator's segments that belong to it;
- an entry: its static inputs (outside the pool), plus the device memory its capture took
  that the allocator does not see (the instantiated graph's own), which is the drop in
  ``torch.cuda.mem_get_info``'s free bytes less the growth of the allocator's reserve.

The pool only shrinks once no graph uses it: dropping one graph returns its blocks to the
pool, not to the device. So when a new bucket would take the pool past the budget, evicting
entries cannot help; `rebuild_largest_first` drops every graph of the device, lets the pool
go, and captures them all again, largest first, under the budget rule. A new graph that leaves
no room even alone in an emptied pool (a VAE decoder at a large size under a budget sized for
the UNet) is given up there, before the others are captured beside it: the pool is rebuilt
without it, and its bucket runs eager. Every graph's outputs stay in the pool while it lives, so
a graph captured into a larger one's blocks still grows it (on a GPU by whole segments, 2 MiB
for small outputs): a rebuilt pool keeps the others only while it leaves the new bucket room.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from shapecache._extension import _C


def release_device_memory(handle) -> None:
    """Frees what an out-of-memory error or an eviction left behind on `handle.device`: garbage
    (a failed call's frames and tensors), the device allocator's cached blocks (retired pool
    generations among them) and the pinned host allocator's, whose graph pools hold the host
    memory of captured copies; then charges the pool's new size through `handle` (a
    _C.BuildHandle)."""
    device = handle.device
    gc.collect()
    # Invariant 1: torch.cuda is touched for a CUDA device only (CPU use never initializes it).
    if device.type == "cpu":
        from shapecache._host_memory import return_free_memory

        return_free_memory()
    if device.type == "cuda":
        empty_allocator_caches(device)
        if _C.has_cuda_graphs:
            charge_shared_bytes(handle)


def empty_allocator_caches(device) -> None:
    """Gives the device allocator's cached blocks (every device's: the caching allocator's
    emptyCache walks all of them) and the pinned host allocator's back, as torch.cuda.graph
    does before each capture (torch/cuda/graphs.py, 2.11 and 2.13). Not during a capture,
    which torch's allocator forbids."""
    with every_device_lock(), torch.cuda.device(device):
        torch.cuda.empty_cache()
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)  # CUDA builds of torch have it
        if host_empty_cache is not None:
            host_empty_cache()


def captures_leave_other_threads_draws_alone(version: str | None = None) -> bool:
    """Whether, with torch `version` (default: this one), a capture on one thread leaves another
    thread's random draws from the device's default generator working: from 2.13, which keeps
    the generator's capture state per capture. On 2.11 and 2.12 every capture registers that
    generator and puts it in capture mode for every thread, whose draws then raise "Offset
    increment outside graph capture" (csrc/core/pool_generations.h, A9; docs/gpu.md). A
    pre-release of 2.13 counts as older."""
    return torch.torch_version.TorchVersion(version or torch.__version__) >= (2, 13)


def device_lock(device):
    """The device's capture and replay lock (_C.cuda_device_lock), for what must not run beside
    another thread's capture: synchronising the device, or freeing its memory (cudaFree
    synchronises). No lock is needed where the build has no CUDA graphs."""
    return _C.cuda_device_lock(device) if _C.has_cuda_graphs else contextlib.nullcontext()


def every_device_lock() -> contextlib.ExitStack:
    """Every device's capture and replay lock, taken in index order: torch.cuda.empty_cache()
    releases the cached blocks of every device (the caching allocator's emptyCache walks all
    of them), which must not run beside a capture on any. Nothing holds one device's lock
    while taking another's, so the order cannot deadlock."""
    stack = contextlib.ExitStack()
    if _C.has_cuda_graphs:
        for index in range(torch.cuda.device_count()):
            stack.enter_context(_C.cuda_device_lock(torch.device("cuda", index)))
    return stack


def charge_shared_bytes(handle) -> None:
    """Charges the device's pool and workspace, as the allocator holds them now, to the
    cache's budget (growth evicts least recently used entries)."""
    handle.set_shared_bytes(**_shared_figures(handle.device))


def charge_shared_bytes_if_free(handle, entry_bytes: int) -> bool:
    """`charge_shared_bytes` where the pool and workspace as they are now and an entry of
    `entry_bytes` fit in the budget's free room (evicting nothing); whether it charged them."""
    return handle.set_shared_bytes_if_free(**_shared_figures(handle.device), bytes=entry_bytes)


def _shared_figures(device) -> dict:
    return {"pool": _C.cuda_graph_pool_bytes(device), "workspace": _C.workspace_stats(device)["bytes"]}


def pool_and_workspace_bytes(device) -> int:
    return sum(_shared_figures(device).values())


def measured_capture(capture, handle, charge: bool = True) -> tuple:
    """Runs `capture() -> runner`; returns (runner, the entry's own bytes) and, with `charge`,
    charges the pool as it is afterwards through `handle`."""
    device = handle.device
    # Under the device's lock from the first figure to the last: another thread's capture or
    # replay between them would be counted as this one's (and a synchronisation beside a
    # capture breaks it). The lock is recursive: capture() takes it again.
    with device_lock(device):
        torch.cuda.synchronize(device)
        free_before, _ = torch.cuda.mem_get_info(device)
        reserved_before = torch.cuda.memory_reserved(device)
        runner = capture()
        torch.cuda.synchronize(device)
        free_after, _ = torch.cuda.mem_get_info(device)
        reserved_after = torch.cuda.memory_reserved(device)
    unseen = max(0, (free_before - free_after) - (reserved_after - reserved_before))
    if charge:
        charge_shared_bytes(handle)
    return runner, runner.static_input_bytes + unseen


def measured_recapture(runner, handle, charge: bool = True) -> int:
    """Captures a released `runner` again; returns its bytes as `measured_capture` does."""

    def recapture():
        runner.recapture()
        return runner

    return measured_capture(recapture, handle, charge)[1]


def pool_over_budget(handle, entry_bytes: int, shared_bytes: int | None = None) -> bool:
    """Whether the pool and workspace (as charged, or `shared_bytes` measured and not yet
    charged), with one more entry of `entry_bytes`, exceed the budget even if every other entry
    went (the budget rule's own check, BudgetedLru::could_fit, with no entry pinned)."""
    return not handle.could_fit(entry_bytes, shared_bytes)


def is_graph(runner) -> bool:
    return isinstance(runner, _C.CudaGraphRunner)


class GraphTooLarge(Exception):
    """The new bucket's graph, captured alone into an emptied pool, leaves no room under the
    budget: it was released, and the pool rebuilt without it."""

    def __init__(self, entry_bytes: int, shared_bytes: int):
        super().__init__(f"alone in an emptied pool it needs {shared_bytes} bytes of pool and workspace and "
                         f"{entry_bytes} of its own")
        self.entry_bytes, self.shared_bytes = entry_bytes, shared_bytes


class PoolLayer(NamedTuple):
    """What the pool's rules call on the device. CUDA_LAYER is the CUDA layer's; the pool
    lifecycle test (tests/core/test_pool_generations.py) runs the same rules on the CPU with
    its model of torch's allocators in their place."""

    graphs_of: Callable  # runner -> whether it is a graph of this pool
    recapture: Callable  # (released runner, handle, charge) -> the entry's bytes
    release: Callable  # handle -> frees what no graph holds, and charges the pool as it is then
    shared_bytes: Callable  # handle -> the device's pool and workspace bytes now
    charge: Callable  # handle -> charges the pool and workspace as they are now
    # (handle, bytes) -> charges them as `charge` does where they and an entry of `bytes` fit
    # in the budget's free room, evicting nothing; returns whether it charged them
    charge_if_free: Callable
    lock: Callable  # device -> its capture lock, as a context manager


CUDA_LAYER = PoolLayer(graphs_of=is_graph, recapture=measured_recapture, release=release_device_memory,
                       shared_bytes=lambda handle: pool_and_workspace_bytes(handle.device),
                       charge=charge_shared_bytes, charge_if_free=charge_shared_bytes_if_free, lock=device_lock)


class NotKept(Exception):
    """The new bucket's graph was released, and the pool's bytes it took given back: its bucket
    runs eager. `reason` says why, for a warning (None: nothing to warn about)."""

    def __init__(self, reason: str | None):
        super().__init__(reason)
        self.reason = reason


def keep_new_graph(handle, runner, entry_bytes: int, pool_before: int, *, pays: Callable[[], bool] | None = None,
                   layer: PoolLayer = CUDA_LAYER) -> int:
    """The new bucket's graph, just captured into the pool, measured and not yet charged: kept
    under the budget rule, or given up. Returns the entry's bytes, or raises NotKept.

    The order is the rule: whether the graph pays (`pays()`, with ``backend="auto"``: its
    replay against the eager call) is asked before anything is charged, since a charge may
    evict other entries for a graph that then goes; one that does not pay (or whose timed
    replays raise) is released and the pool left as it found it: where its capture grew the
    pool, the pool is rebuilt without it (unless a graph of the device runs up the stack). A
    kept graph whose pool leaves room is charged; otherwise the pool is rebuilt largest first
    (`rebuild_largest_first`). Where a graph of the device runs up the stack, the pool cannot
    be dropped: every unpinned entry goes and the new graph is captured again alone."""
    if pays is not None:
        try:
            paid, reason = pays(), None
        except Exception as error:  # noqa: BLE001  (its timed replays: the call's result is computed already)
            paid, reason = False, f"its replay failed: {error!r}"
        if not paid:
            let_go_of_new(handle, runner, layer.shared_bytes(handle) > pool_before, layer)
            raise NotKept(reason)
    if not pool_over_budget(handle, entry_bytes, layer.shared_bytes(handle)):
        layer.charge(handle)
        return entry_bytes
    # Evicting entries cannot shrink the pool (the module's docstring): rebuild it.
    try:
        rebuilt = rebuild_largest_first(handle, runner, pool_before, layer=layer)
    except GraphTooLarge as too_large:
        # The pool was rebuilt without it: the bucket runs eager, its temporaries held only while
        # it runs, in the allocator's cache, outside the budget like any eager call's.
        raise NotKept(f"it leaves no room under the budget ({too_large})") from None
    if rebuilt is None:  # a graph of the device is running up the stack: keep what runs
        handle.evict_unpinned()
        runner.release()
        layer.release(handle)
        rebuilt = layer.recapture(runner, handle, True)
    return rebuilt


def keep_in_free_room(handle, runner, entry_bytes: int, grew: bool, *, layer: PoolLayer = CUDA_LAYER) -> int:
    """An upgrade's graph (upgrade.py), just captured into the pool, measured and chosen: kept
    where it and the pool as it is now fit in the budget's free room, and the pool charged then;
    else let go of (`let_go_of_new`; `grew`: whether its capture grew the pool) and NotKept
    raised. An upgrade never evicts (csrc/cache/miss_policy.h, Upgrade), so unlike
    `keep_new_graph` nothing is rebuilt to make room. The check counts the whole entry's bytes,
    not what it adds to the entry it replaces: the cache checks that, once the entry is looked
    up again (BudgetedLru::fits_in_place)."""
    if layer.charge_if_free(handle, entry_bytes):
        return entry_bytes
    let_go_of_new(handle, runner, grew, layer, evict=False)
    raise NotKept(None)


def let_go_of_new(handle, runner, grew: bool, layer: PoolLayer = CUDA_LAYER, *, evict: bool = True) -> None:
    """Releases a new graph that is not kept and leaves the pool as it found it: where its
    capture grew the pool (`grew`), what it added stays there (a pool shrinks only whole), where
    a charge would evict entries for it, so the pool is rebuilt without it. Where a graph of the
    device runs up the stack (or on another thread) it cannot be: the pool is charged as it is,
    which may evict; with `evict` False (an upgrade) only where it fits in the budget's free
    room, else the growth is charged at the device's next charge (the next capture, eviction or
    rebuild), evicting then."""
    runner.release()
    if grew and rebuild_without_new(handle, layer):
        return
    if evict:
        layer.release(handle)
    else:
        layer.charge_if_free(handle, 0)


def rebuild_without_new(handle, layer: PoolLayer = CUDA_LAYER) -> bool:
    """Drops every graph of the handle's device in its cache, lets the pool empty and captures
    them again largest first (as `rebuild_largest_first` does where the new graph cannot stay),
    charged once done. False (nothing rebuilt) where a graph of the device runs up the stack."""
    queue = _dropped_graphs(handle, layer)
    if queue is None:
        return False
    _recapture_alone(handle, _Rounds(handle, layer), _largest_inputs_first(queue))
    return True


def _dropped_graphs(handle, layer: PoolLayer) -> list | None:
    """Releases every valid graph of the handle's device and erases the stale ones; returns the
    released ones' (entry id, runner), or None (nothing released) where one is pinned."""
    graphs = [(entry_id, runner, pinned) for entry_id, runner, pinned in handle.entries()
              if layer.graphs_of(runner)]
    if any(pinned for _, _, pinned in graphs):
        return None
    queue = []
    for entry_id, runner, _ in graphs:
        if runner.valid():
            queue.append((entry_id, runner))
        else:
            handle.erase_entry(entry_id)  # stale: rebuilt from the caller's call when next used
    handle.count_pool_rebuild()
    for _, runner in queue:
        runner.release()
    return queue


def _recapture_alone(handle, rounds, others: list) -> None:
    """Captures the released `others` (largest first) into the emptied pool, without the new
    graph, and charges each once the rounds are over."""
    rounds.release(handle)
    captured = rounds.largest_first(others, room_for=0)
    rounds.release(handle)  # charges the pool as the round left it
    _settle(handle, captured)


def rebuild_largest_first(handle, new_runner, pool_before: int, *, layer: PoolLayer = CUDA_LAYER) -> int | None:
    """Drops every graph of the handle's device in its cache and `new_runner`'s, lets the pool
    empty, and captures `new_runner` alone first: its capture is what took the pool past the
    budget, and alone in the empty pool it needs what it will ever need. A graph that leaves
    no room even then is given up: released, the pool emptied again, the others captured, and
    GraphTooLarge raised. If alone it needs at least `pool_before` (the pool and workspace
    before its first capture, which the others needed), it is the largest: it stays, and the
    others are captured after it into its blocks. Otherwise the pool is emptied once more and
    every graph captured again largest first (most input bytes first: for one model, a
    bucket's temporaries grow with its input), so that each reuses the blocks a larger one
    left. A round's captures are charged when it ends, under the budget rule, which may evict
    least recently used entries (one just recaptured among them). Returns `new_runner`'s
    bytes, or None (nothing rebuilt) when a graph of the device is running up the stack and
    cannot be dropped.

    Graphs that other caches captured into the device's pool keep it from emptying: the
    rebuild is then correct but frees less. The new graph's capture is measured under the
    device's capture lock (`layer.lock`) up to the figure read after it, so that another
    thread's capture is not counted as its.
    """
    queue = _dropped_graphs(handle, layer)
    if queue is None:
        return None
    rounds = _Rounds(handle, layer)
    release = layer.release
    new_runner.release()
    release(handle)

    # The caller's own bucket (its errors are its builder's to handle), measured before its
    # pool is charged: a charge past the budget would evict every entry for a graph that
    # cannot stay. Captures below are charged once a round is over, for the same reason.
    with layer.lock(handle.device):
        new_bytes = layer.recapture(new_runner, handle, False)
        alone = rounds.shared_bytes()
    others = _largest_inputs_first(queue)
    if not handle.could_fit(new_bytes, alone):
        new_runner.release()
        _recapture_alone(handle, rounds, others)
        raise GraphTooLarge(new_bytes, alone)
    # Every other graph needed at most the pool as it was before the new one (`pool_before`):
    # a new graph that needs at least that alone stays first, and the others reuse its blocks.
    # Else all go largest first by input bytes, which for one model ranks their temporaries.
    if alone >= pool_before or not others:
        captured = rounds.within_budget(others, room_for=new_bytes,
                                        captured=[_Captured(None, new_runner, new_bytes, alone, alone)])
    else:
        new_runner.release()
        release(handle)
        captured = rounds.largest_first(_largest_inputs_first(queue + [(None, new_runner)]), room_for=new_bytes)
    release(handle)  # charges the pool as the round left it
    return _settle(handle, captured)


def _largest_inputs_first(pairs: list) -> list:
    """(entry id, runner) pairs, most input bytes first; sorted() is stable, so among equals
    the most recently used (listed first) goes first."""
    return sorted(pairs, key=lambda item: item[1].static_input_bytes, reverse=True)


class _Captured(NamedTuple):
    entry_id: int | None  # None: the new bucket's
    runner: object
    entry_bytes: int
    growth: int  # how much its capture grew the pool and workspace
    pool_after: int  # the pool and workspace after its capture


class _Rounds:
    """Capture rounds of one rebuild, charging nothing (the rebuild charges once they end)."""

    def __init__(self, handle, layer: PoolLayer):
        self.handle, self.recapture, self.release, self.lock = handle, layer.recapture, layer.release, layer.lock
        self.shared_bytes = lambda: layer.shared_bytes(handle)  # the device's pool and workspace now

    def largest_first(self, order: list, room_for: int) -> list:
        """`within_budget` of `order` (sorted by input bytes); where the pool then leaves no
        room, a graph ranked after others by its inputs needed more than they left (another
        model's: a VAE decoder has small inputs and large temporaries) and its blocks went on
        top of theirs: once more, ranked by how much each capture grew the pool, which for the
        first is all it needs and for a later one no more than that."""
        captured = self.round(order)
        if self.handle.could_fit(room_for, self.shared_bytes()):
            return captured
        by_growth = sorted(captured, key=lambda capture: capture.growth, reverse=True)
        self.release_all(captured)
        return self.within_budget([(c.entry_id, c.runner) for c in by_growth], room_for)

    def within_budget(self, order: list, room_for: int, captured: list = ()) -> list:
        """Captures `order` after `captured` (captured already, into the same pool); returns
        every capture once the pool leaves `room_for` bytes (the new bucket's own) under the
        budget. Otherwise other graphs go, their entries erased (built again from their
        callers' next calls), and the rest are captured again into an emptied pool (a pool
        shrinks only whole): in the order captured, each other graph stays while what its
        capture added to the pool still leaves that room, so one more pass does where
        captures add what they added before. Where the pool still leaves no room, the last
        other graph goes too, and so on: the new bucket fits alone (checked before), so this
        ends."""
        captured = list(captured) + self.round(order)
        while not self.handle.could_fit(room_for, self.shared_bytes()):
            others = [c for c in captured if c.entry_id is not None]
            if not others:
                break
            pool = captured[0].pool_after - captured[0].growth  # before the round
            kept = []
            for capture in captured:
                if capture.entry_id is None or self.handle.could_fit(room_for, pool + capture.growth):
                    kept.append(capture)
                    pool += capture.growth
            if len(kept) == len(captured):  # the sum did not show it: the last other goes
                kept = [k for k in kept if k is not others[-1]]
            self.release_all(captured)
            for capture in captured:
                if not any(capture is k for k in kept):
                    self.handle.erase_entry(capture.entry_id)
            captured = self.round([(c.entry_id, c.runner) for c in kept])
        return captured

    def release_all(self, captured: list) -> None:
        for capture in captured:
            capture.runner.release()
        self.release(self.handle)

    def round(self, order: list) -> list:
        """Captures the released runners of `order` ((entry id or None for the new bucket,
        runner) pairs), in order; returns a _Captured for each. An entry that failed is
        dropped; the new bucket's error is raised."""
        handle, captured = self.handle, []
        for entry_id, runner in order:
            if entry_id is not None and not handle.contains_entry(entry_id):
                continue  # evicted meanwhile (a failed capture's clean-up charges the pool)
            try:
                with self.lock(handle.device):
                    before = self.shared_bytes()
                    entry_bytes = self.recapture(runner, handle, False)
                    after = self.shared_bytes()
                    captured.append(_Captured(entry_id, runner, entry_bytes, after - before, after))
            except Exception as error:
                if entry_id is None:
                    raise  # the caller's own bucket: its builder's error handling takes over
                # Out of memory, its module gone, or a capture that failed: the entry goes, and is
                # built again from its caller's next call.
                if not isinstance(error, (torch.OutOfMemoryError, ReferenceError)):
                    warnings.warn(f"shapecache: recapturing a graph on {handle.device} failed ({error!r}); its "
                                  "entry was dropped", RuntimeWarning, stacklevel=2)
                handle.erase_entry(entry_id)
                del runner, error
                self.release(handle)
        return captured


def _settle(handle, captured: list) -> int | None:
    """Charges each recaptured entry at its new cost (which may evict least recently used
    ones); returns the new bucket's bytes, if it was among them."""
    new_bytes = None
    for entry_id, runner, entry_bytes, _, _ in captured:
        if entry_id is None:
            new_bytes = entry_bytes
        elif handle.contains_entry(entry_id):
            handle.set_entry_bytes(entry_id, entry_bytes)
        else:  # evicted by the round's charge: an entry let go must not keep its graph
            runner.release()
    return new_bytes
