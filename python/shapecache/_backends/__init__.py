"""Backends: how the entry of a new shape bucket is built.

- ``"eager"``: the function itself; the entry holds no memory. Keys, buckets and padding
  still apply.
- ``"compile"``: one inductor graph per bucket, traced by torch.export (``compile.py``).
- ``"cuda_graph"``: the bucket captured as a CUDA graph (``cuda_graph.py``), replayed from C++.
- ``"compile+cuda_graph"``: the bucket's ``torch.compile`` graph, captured as a CUDA graph.
- ``"auto"``: for CUDA inputs, a CUDA graph when its replay is faster than the eager call
  (measured when the bucket is built), else eager; ``"eager"`` elsewhere (on the CPU,
  inductor's builds cost seconds per bucket and need a C++ toolchain, for a smaller gain).

The C++ cache calls a builder on a miss; it returns a ``BuiltEntry``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from shapecache._extension import _C

BACKENDS = ("auto", "eager", "compile", "cuda_graph", "compile+cuda_graph")
GRAPH_BACKENDS = ("cuda_graph", "compile+cuda_graph")


class BuiltEntry(NamedTuple):
    """What a builder returns to the C++ cache (which reads it as a tuple)."""

    runner: Callable | None  # serves the bucket's later calls (a _C.EntryRunner serves them from C++); None: not built
    bytes: int  # device memory the entry holds beyond what the uncached call leaves behind
    output: Any  # the result of the call that built the entry, or _C.RUN_ENTRY: the cache runs `runner` for it
    backend: str  # what built the runner: "eager", "compile", "cuda_graph", "compile+cuda_graph"
    guard: Any = None  # a _C.StateGuard (guards.py): the entry is stale once what it was built from changed
    failure: str | None = None  # with runner None: why nothing was built (the bucket then runs uncached)


@dataclass(frozen=True)
class BuildContext:
    """What a builder needs besides the call: where entries go and how calls are spelled."""

    cache: object  # the _C.ShapeCache the entry will join (its budget, its shared bytes)
    has_owner: bool  # the call's first argument is the module a method belongs to
    parameter_names: tuple  # positional parameter names (without the owner), as keys use them
    compile_options: dict


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


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that builds entries on `device`."""
    if backend == "auto":
        return "cuda_graph" if device.type == "cuda" and _C.has_cuda_graphs else "eager"
    if backend in GRAPH_BACKENDS and device.type != "cuda":
        return "eager"
    return backend


def make_builder(function: Callable, backend: str, context: BuildContext) -> Callable:
    """The builder the C++ cache calls on a miss: (args, kwargs, device) -> BuiltEntry."""
    warned = []

    def build(args: tuple, kwargs: dict, device: torch.device) -> BuiltEntry:
        chosen = resolve_backend(backend, device)
        if backend in GRAPH_BACKENDS and chosen == "eager" and not warned:
            warned.append(True)
            warnings.warn(f"shapecache: backend={backend!r} got tensors on {device}; such calls run eager",
                          RuntimeWarning, stacklevel=2)
        if chosen == "eager":  # the dispatcher runs it: no frame of this builder under the call
            return BuiltEntry(function, 0, _C.RUN_ENTRY, "eager")
        if chosen == "compile":
            from shapecache._backends.compile import build_compiled

            return build_compiled(function, context, args, kwargs, device)
        from shapecache._backends.cuda_graph import build_graph

        return build_graph(function, args, kwargs, device, context, compiled=chosen == "compile+cuda_graph",
                           keep_only_if_faster=backend == "auto")

    return build
