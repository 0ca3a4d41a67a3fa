"""Backends: how the entry of a new shape bucket is built.

- ``"eager"``: the function itself; the entry holds no memory. Keys, buckets and padding
  still apply.
- ``"compile"``: ``torch.compile(dynamic=False)`` per bucket. Each bucket compiles its own
  copy of the function's code object: Dynamo keeps compiled code, guards and its recompile
  count per code object, so one copy per bucket means no bucket ever meets Dynamo's
  recompile limit (which would silently run the 9th shape eager), guards are checked
  against one bucket's entry instead of all of them, and evicting a bucket frees its
  compiled code with the copy.
- ``"cuda_graph"``: the bucket captured as a CUDA graph (csrc/ops/cuda/cuda_graph_runner.h:
  one pool and one stream per device, largest first), replayed from C++.
- ``"compile+cuda_graph"``: the bucket's ``torch.compile`` graph, captured as a CUDA graph.
- ``"auto"``: for CUDA inputs, a CUDA graph when its replay is faster than the eager call
  (measured when the bucket is built), else eager; ``"eager"`` elsewhere (on the CPU,
  inductor's builds cost seconds per bucket and need a C++ toolchain, for a smaller gain).

A builder returns ``(runner, bytes, output, backend)``: the runner serves later calls of the
bucket, ``bytes`` is the device memory the entry holds beyond what the uncached call leaves
behind (allocator figures on CUDA), and ``output`` is the result of the call that built it.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shapecache import _C, graph_pool, timing

BACKENDS = ("auto", "eager", "compile", "cuda_graph", "compile+cuda_graph")
GRAPH_BACKENDS = ("cuda_graph", "compile+cuda_graph")


def check_available(backend: str) -> None:
    """Raises ValueError when `backend` cannot run here at all."""
    if backend not in GRAPH_BACKENDS:
        return
    if not _C.has_cuda_graphs:
        raise ValueError(
            f"backend={backend!r} is not available: this build of shapecache has no CUDA code (it was built "
            "against a torch without CUDA); use 'auto', 'eager' or 'compile'"
        )
    if not torch.cuda.is_available():
        raise ValueError(f"backend={backend!r} is not available: no CUDA device is visible; use 'auto' or 'eager'")


@dataclass(frozen=True)
class BuildContext:
    """What a builder needs besides the call: where entries go and how calls are spelled."""

    cache: object  # the ShapeCache the entry will join (its budget, its shared bytes)
    has_owner: bool  # the call's first argument is the module a method belongs to
    parameter_names: tuple  # positional parameter names (without the owner), as keys use them
    compile_options: dict


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that builds entries on `device`."""
    if backend == "auto":
        return "cuda_graph" if device.type == "cuda" and _C.has_cuda_graphs else "eager"
    if backend in GRAPH_BACKENDS and device.type != "cuda":
        return "eager"
    return backend


def make_builder(function: Callable, backend: str, context: BuildContext) -> Callable:
    """The builder the C++ cache calls on a miss: (args, kwargs, device) -> entry."""
    warned = []

    def build(args: tuple, kwargs: dict, device: torch.device):
        chosen = resolve_backend(backend, device)
        if backend in GRAPH_BACKENDS and chosen == "eager" and not warned:
            warned.append(True)
            warnings.warn(f"shapecache: backend={backend!r} got tensors on {device}; such calls run eager",
                          RuntimeWarning, stacklevel=2)
        if chosen == "eager":
            return function, 0, function(*args, **kwargs), "eager"
        if chosen == "compile":
            return _build_compiled(function, context.compile_options, args, kwargs, device)
        return _build_graph(function, args, kwargs, device, context, compiled=chosen == "compile+cuda_graph",
                            keep_only_if_faster=backend == "auto")

    return build


def _build_compiled(function, compile_options, args, kwargs, device):
    copy = fresh_code_copy(function)
    runner = torch.compile(copy, dynamic=False, **compile_options)
    compiled = _dynamo_compiled(copy)
    allocated_before = _allocated(device)
    output = runner(*args, **kwargs)
    held = max(0, _allocated(device) - allocated_before - _tensor_bytes(output, device))
    if not compiled():
        warnings.warn(
            f"shapecache: torch.compile made no graph for a new bucket of {getattr(function, '__qualname__', function)}; "
            "that bucket runs eager (is torch.compile disabled, or does the function run no tensor code?)",
            RuntimeWarning,
            stacklevel=2,
        )
        return runner, held, output, "eager"
    return runner, held, output, "compile"


def _dynamo_compiled(copy) -> Callable[[], bool]:
    """A check, to run after the first call, of whether Dynamo compiled `copy`: its own code
    object has cache entries. (Callables without a code object of their own fall back to
    Dynamo's process-wide graph counter, which misses graphs that hit Dynamo's cache.)"""
    from torch._dynamo import eval_frame
    from torch._dynamo.utils import counters

    function = copy.__func__ if isinstance(copy, types.MethodType) else copy
    code = getattr(function, "__code__", None)
    entries = getattr(eval_frame, "_debug_get_cache_entry_list", None)
    if isinstance(function, types.FunctionType) and code is not None and entries is not None:
        return lambda: len(entries(code)) > 0
    before = counters["stats"]["unique_graphs"]
    return lambda: counters["stats"]["unique_graphs"] > before


def _build_graph(function, args, kwargs, device, context: BuildContext, *, compiled: bool, keep_only_if_faster: bool):
    from shapecache.weights import snapshot

    owner, call_args = (args[0], args[1:]) if context.has_owner else (None, args)
    runnable = torch.compile(fresh_code_copy(function), dynamic=False, **context.compile_options) if compiled \
        else function
    weights = snapshot(owner) if isinstance(owner, torch.nn.Module) else None

    # Warm-up on a side stream: cuDNN's benchmarking, lazy initialisation and compilation
    # happen here, never inside capture. Its output is the call's result (the eager numbers).
    caller = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(caller)
    with torch.cuda.device(device), torch.cuda.stream(side):
        output = runnable(*args, **kwargs)
    caller.wait_stream(side)
    for t in _tensors(output):
        t.record_stream(caller)  # made on the side stream, used and freed on the caller's

    eager_seconds = None
    if keep_only_if_faster:
        eager_seconds = min(timing.timings(lambda: runnable(*args, **kwargs), device, repeats=2))

    cache = context.cache
    runner, entry_bytes = graph_pool.measured_capture(
        lambda: _C.capture_cuda_graph(runnable, owner, tuple(call_args), dict(kwargs), list(context.parameter_names),
                                      weights),
        device, cache)
    if graph_pool.pool_over_budget(device, cache, entry_bytes):
        # Evicting entries cannot shrink the pool (see shapecache/graph_pool.py): rebuild it.
        rebuilt = graph_pool.rebuild_largest_first(device, cache, runner)
        if rebuilt is None:  # a graph of the device is running up the stack: keep what runs
            cache.evict_unpinned(device)
            runner.release()
            graph_pool.release_device_memory(device, cache)
            rebuilt = graph_pool.measured_recapture(runner, device, cache)
        entry_bytes = rebuilt

    name = "compile+cuda_graph" if compiled else "cuda_graph"
    if keep_only_if_faster:
        # The best of several: the first replay of a graph includes its upload.
        replay_seconds = min(timing.timings(lambda: runner(*call_args, **kwargs), device, repeats=3))
        if replay_seconds >= eager_seconds:
            return function, 0, output, "eager"
    return runner, entry_bytes, output, name


def fresh_code_copy(function: Callable) -> Callable:
    """`function` with a code object of its own (methods: their function's copy, rebound).

    Callables that are not Python functions (modules, partials, builtins) come back as they
    are and share Dynamo's cache across buckets.
    """
    if isinstance(function, types.MethodType):
        return types.MethodType(fresh_code_copy(function.__func__), function.__self__)
    if not isinstance(function, types.FunctionType):
        return function
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__module__ = function.__module__
    copy.__dict__.update(function.__dict__)
    return copy


def _allocated(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return 0


def _tensor_bytes(output, device: torch.device) -> int:
    """Bytes of the distinct storages of the tensors in `output` on `device`."""
    if device.type != "cuda":
        return 0
    seen = {}
    for t in _tensors(output):
        if t.device == device:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
