"""The ``"cuda_graph"`` and ``"compile+cuda_graph"`` backends: each bucket captured as a CUDA
graph (``csrc/cache/cuda/cuda_graph_runner.h``: one pool and one stream per device) after an
eager warm-up on a side stream, and replayed from C++. The pool's size and rebuilds are
``graph_pool.py``'s."""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch
from torch.utils._pytree import tree_leaves

from shapecache import _timing
from shapecache._backends import called_code, graph_pool, guards
from shapecache._backends.compile import entry_point
from shapecache._backends.entry import BuildContext, Builder, BuiltEntry, described, register
from shapecache._extension import _C

_warm_up_streams = threading.local()


def warm_up_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per building thread and device, for its warm-ups and `auto`'s timings:
    the same stream for every build, since cuBLAS keeps a workspace per (handle, stream) pair,
    outside any budget (a new stream per build would leave one behind each; handles are per
    thread already, so a stream per thread adds none), and a stream no other thread queues
    work on, so that the CUDA events timing a build's calls bracket that build's work alone."""
    streams = getattr(_warm_up_streams, "by_device", None)
    if streams is None:
        streams = _warm_up_streams.by_device = {}
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return stream


@register
class CudaGraphBuilder(Builder):
    """The bucket captured from the function itself; with ``backend="auto"``, kept only where
    its replay beats the eager call."""

    name = "cuda_graph"

    def build(self, function, args, kwargs, handle, context: BuildContext, asked: str) -> BuiltEntry:
        return _build_graph(function, args, kwargs, handle, context, compiled=False,
                            keep_only_if_faster=asked == "auto")


@register
class CompiledCudaGraphBuilder(Builder):
    """The bucket's ``torch.compile`` graph, captured."""

    name = "compile+cuda_graph"

    def build(self, function, args, kwargs, handle, context: BuildContext, asked: str) -> BuiltEntry:
        return _build_graph(function, args, kwargs, handle, context, compiled=True, keep_only_if_faster=False)


def graph_compile_options(compile_options: dict) -> dict:
    """torch.compile's arguments for a bucket's captured graph: the cache's `compile_options`
    with inductor's freezing off, whatever the process's setting (the CPU route's builds turn it
    on): a frozen graph holds a copy of the weights (folded into its constants), one per size,
    which on a GPU is the growth the cache exists to prevent (an SDXL UNet's weights are about
    5 GB in fp16). Unfrozen, inductor lifts parameters and buffers as graph inputs, read where
    they are: N sizes cost N graphs' working memory and one set of weights, and an update in
    place (load_state_dict) is read by the graph as it is. CacheOptions refuses freezing asked
    for with a graph backend.

    torch.compile takes a `mode` or `options`, not both: a mode's options (inductor's own
    list_mode_options, what torch.compile applies for it, 2.11 and 2.13) go into `options`
    under the ones given. A backend other than inductor is given the options as they are."""
    options = dict(compile_options)
    if options.get("backend", "inductor") != "inductor":
        return options
    from torch._inductor import list_mode_options

    mode = options.pop("mode", None)
    inductor = {**list_mode_options(mode or "default", dynamic=False), **(options.pop("options", None) or {})}
    return {**options, "options": {**inductor, "freezing": False}}


def _build_graph(function, args, kwargs, handle, context: BuildContext, *, compiled: bool,
                 keep_only_if_faster: bool) -> BuiltEntry:
    if not handle.run_call:  # builds_in_background keeps graphs off the worker
        raise RuntimeError("a CUDA graph is captured on the caller's thread, not in the background")
    device = handle.device
    owner, call_args = (args[0], args[1:]) if context.has_owner else (None, args)
    runnable = torch.compile(entry_point(function), dynamic=False, **graph_compile_options(context.compile_options)) \
        if compiled else function
    # Warm-up on a side stream: cuDNN's benchmarking, lazy initialisation and compilation
    # happen here, never inside capture. Its output is the call's result (the eager numbers).
    caller = torch.cuda.current_stream(device)
    side = warm_up_stream(device)
    side.wait_stream(caller)
    # The globals the call's code reads are guarded (guards.py); Dynamo guards its own.
    recording = contextlib.nullcontext({}) if compiled else called_code.recording_calls()
    with torch.cuda.device(device), torch.cuda.stream(side), recording as called:
        output = _C.run_user_code(runnable, tuple(args), dict(kwargs))
    caller.wait_stream(side)
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor):
            t.record_stream(caller)  # made on the side stream, used and freed on the caller's
    # A graph bakes in the Python state its capture read, as a compiled graph does: the same
    # guard (guards.py) over the call's module trees and the function's globals and closures,
    # recorded after the warm-up, whose lazy initialisation the capture then reads. What the
    # capture itself writes makes it stale: the bucket is given up (miss_policy.h).
    guard = guards.guard(guards.call_roots(args, kwargs, context.has_owner, context.parameter_names),
                         functions=[function], called=called)

    eager_seconds = None
    if keep_only_if_faster:
        # On the warm-up's stream too: the caching allocator keeps freed blocks per stream, so
        # eager runs on the caller's stream would cache a second set of the call's temporaries
        # beside the warm-up's, outside any budget.
        eager_seconds = min(_timing.stream_seconds(
            lambda: _C.run_user_code(runnable, tuple(args), dict(kwargs)), side, repeats=2))

    # What the warm-up and the eager timing cached on the side stream goes back to the device,
    # as torch.cuda.graph does before each capture: a graph's private pool takes no blocks
    # from other streams, so they would stay reserved beside it, outside any budget (on the
    # per-size loop of an SDXL UNet, 11.0 GiB reserved after the first size, against 6.7 GiB
    # for per-size graphs made with torch.cuda.graph).
    if not torch.cuda.is_current_stream_capturing():
        graph_pool.empty_allocator_caches(device)
    pool_before = graph_pool.pool_and_workspace_bytes(device)
    what = getattr(function, '__qualname__', function)
    try:
        # Measured, not yet charged: keep_new_graph decides whether it stays, under the budget.
        runner, entry_bytes = graph_pool.measured_capture(
            lambda: _C.capture_cuda_graph(runnable, owner, tuple(call_args), dict(kwargs), handle.tensors, guard),
            handle, charge=False)
    except torch.OutOfMemoryError:
        raise  # the cache's own retry: evict, empty the allocator's cache, build again
    except Exception as error:  # noqa: BLE001  (the call computed its result already: never fail it here)
        # A function that cannot be captured (a synchronising call, a CPU round trip): the
        # allocators were cleaned up (csrc/core/pool_generations.h); this bucket runs eager.
        warnings.warn(f"shapecache: {what} could not be captured as a CUDA graph ({described(error)}); "
                      "its bucket runs eager", RuntimeWarning, stacklevel=2)
        return BuiltEntry(function, 0, output, "eager")

    def replay_pays() -> bool:
        # Replayed from the side stream as its caller (the replay is ordered after and before
        # its caller's stream), so that the events bracket this replay and no other thread's
        # work; the best of several: the first replay of a graph includes its upload.
        side.wait_stream(caller)
        replay_seconds = min(_timing.stream_seconds(lambda: runner(*handle.tensors), side, repeats=3))
        caller.wait_stream(side)
        return replay_seconds < eager_seconds

    try:
        entry_bytes = graph_pool.keep_new_graph(handle, runner, entry_bytes, pool_before,
                                                pays=replay_pays if keep_only_if_faster else None)
    except graph_pool.NotKept as not_kept:
        if not_kept.reason is not None:
            warnings.warn(f"shapecache: the CUDA graph of a bucket of {what} on {device} was not kept "
                          f"({not_kept.reason}); its bucket runs eager", RuntimeWarning, stacklevel=2)
        return BuiltEntry(function, 0, output, "eager")
    except torch.OutOfMemoryError:
        raise  # the cache's own retry
    except Exception as error:  # noqa: BLE001  (the call computed its result already: never fail it here)
        runner.release()
        warnings.warn(f"shapecache: capturing {what} again while its device's graph pool was rebuilt failed "
                      f"({described(error)}); its bucket runs eager", RuntimeWarning, stacklevel=2)
        return BuiltEntry(function, 0, output, "eager")
    name = "compile+cuda_graph" if compiled else "cuda_graph"
    return BuiltEntry(None, entry_bytes, output, name, entry_runner=runner)  # the runner holds `guard`
