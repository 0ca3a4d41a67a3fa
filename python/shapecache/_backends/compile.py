"""The ``"compile"`` backend: ``torch.compile(dynamic=False)`` per bucket.

Each bucket compiles an entry point of its own: a function of this file that calls the cached
function, with a code object of its own. Dynamo keeps compiled code, guards and its recompile
count per code object, so one per bucket means no bucket ever meets Dynamo's recompile limit
(which would silently run the 9th shape eager), guards are checked against one bucket's entry
instead of all of them, and evicting a bucket frees its compiled code with its entry point.
The entry point is shapecache's, not the function's own code: torch.compile wraps a function
defined in torch's own files (``nn.Sequential.forward``) in one ``inner`` frame of torch's
that every bucket would share, limit included; Dynamo compiles this frame and inlines the
function instead.
"""

from __future__ import annotations

import gc
import types
import warnings
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves

from shapecache._backends import BuiltEntry
from shapecache._backends.host_memory import heap_bytes


def build_compiled(function, compile_options, args, kwargs, device) -> BuiltEntry:
    copy = entry_point(function)
    runner = torch.compile(copy, dynamic=False, **compile_options)
    compiled = _dynamo_compiled(copy)
    # What the build leaves allocated beyond its output: on the CPU, inductor's compiled module
    # with what it keeps (frozen constants among them). The heap figure is the process's: the
    # garbage collector runs first, so that garbage it would free during the build is not
    # taken from this entry's figure (a collection costs milliseconds; a build, seconds).
    if device.type == "cpu":
        gc.collect()
    allocated_before = allocated_bytes(device)
    output = runner(*args, **kwargs)
    held = max(0, allocated_bytes(device) - allocated_before - tensor_bytes(output, device))
    if not compiled():
        warnings.warn(
            f"shapecache: torch.compile made no graph for a new bucket of {getattr(function, '__qualname__', function)}; "
            "that bucket runs eager (is torch.compile disabled, or does the function run no tensor code?)",
            RuntimeWarning,
            stacklevel=2,
        )
        return BuiltEntry(runner, held, output, "eager")
    return BuiltEntry(runner, held, output, "compile")


def _dynamo_compiled(copy) -> Callable[[], bool]:
    """A check, to run after the first call, of whether Dynamo compiled the entry point `copy`:
    its own code object has cache entries. (Where torch lacks that debug accessor, Dynamo's
    process-wide graph counter stands in; it misses graphs that hit Dynamo's cache.)"""
    from torch._dynamo import eval_frame
    from torch._dynamo.utils import counters

    code = copy.__code__
    entries = getattr(eval_frame, "_debug_get_cache_entry_list", None)
    if entries is not None:
        return lambda: len(entries(code)) > 0
    before = counters["stats"]["unique_graphs"]
    return lambda: counters["stats"]["unique_graphs"] > before


def entry_point(function: Callable) -> Callable:
    """A function with a code object of its own that calls `function` (see the module's docstring)."""

    def call(*args, **kwargs):
        return function(*args, **kwargs)

    return fresh_code_copy(call)


def fresh_code_copy(function: types.FunctionType) -> types.FunctionType:
    """`function` with a code object of its own (a nested ``def`` shares its code object with
    every function made from it)."""
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    return copy


def allocated_bytes(device: torch.device) -> int:
    """Bytes allocated on `device` now: the CUDA caching allocator's figure, or on the CPU the
    C library's heap in use (see host_memory.py); 0 where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        return heap_bytes() or 0
    return 0


def tensor_bytes(output, device: torch.device) -> int:
    """Bytes of the distinct storages of the tensors in `output` on `device`."""
    seen = {}
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.device == device:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
