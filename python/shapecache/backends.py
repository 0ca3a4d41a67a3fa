"""Backends: how the entry of a new shape bucket is built.

- ``"eager"``: the function itself; the entry holds no memory. Keys, buckets and padding
  still apply.
- ``"compile"``: ``torch.compile(dynamic=False)`` per bucket. Each bucket compiles its own
  copy of the function's code object: Dynamo keeps compiled code, guards and its recompile
  count per code object, so one copy per bucket means no bucket ever meets Dynamo's
  recompile limit (which would silently run the 9th shape eager), guards are checked
  against one bucket's entry instead of all of them, and evicting a bucket frees its
  compiled code with the copy.
- ``"auto"``: ``"compile"`` on CUDA devices, ``"eager"`` elsewhere (on the CPU, inductor's
  builds cost seconds per bucket and need a C++ toolchain, for a smaller gain than on GPUs).

A builder returns ``(runner, bytes, output, backend)``: the runner serves later calls of the
bucket, ``bytes`` is the device memory the entry holds beyond what the uncached call leaves
behind (allocator figures on CUDA; on the CPU, compiled code holds no tensors: 0), and
``output`` is the result of the call that built it.
"""

from __future__ import annotations

import gc
import types
import warnings
from collections.abc import Callable

import torch

BACKENDS = ("auto", "eager", "compile")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that builds entries on `device`."""
    if backend == "auto":
        return "compile" if device.type == "cuda" else "eager"
    return backend


def make_builder(function: Callable, backend: str, compile_options: dict) -> Callable:
    """The builder the C++ cache calls on a miss: (args, kwargs, device) -> entry."""

    def build(args: tuple, kwargs: dict, device: torch.device):
        chosen = resolve_backend(backend, device)
        if chosen == "eager":
            return function, 0, function(*args, **kwargs), "eager"
        if chosen == "compile":
            return _build_compiled(function, compile_options, args, kwargs, device)
        raise ValueError(f"backend={chosen!r}: expected one of {BACKENDS}")

    return build


def _build_compiled(function, compile_options, args, kwargs, device):
    from torch._dynamo.utils import counters

    runner = torch.compile(fresh_code_copy(function), dynamic=False, **compile_options)
    graphs_before = counters["stats"]["unique_graphs"]
    allocated_before = _allocated(device)
    output = runner(*args, **kwargs)
    held = max(0, _allocated(device) - allocated_before - _tensor_bytes(output, device))
    if counters["stats"]["unique_graphs"] == graphs_before:
        warnings.warn(
            f"shapecache: torch.compile made no graph for a new bucket of {getattr(function, '__qualname__', function)}; "
            "that bucket runs eager (is torch.compile disabled, or does the function run no tensor code?)",
            RuntimeWarning,
            stacklevel=2,
        )
        return runner, held, output, "eager"
    return runner, held, output, "compile"


def release_device_memory(device: torch.device) -> None:
    """Frees what an out-of-memory error left behind on `device`: garbage (a failed call's
    frames and tensors) and the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()


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
