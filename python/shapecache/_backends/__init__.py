"""Backends: how the entry of a new shape bucket is built.

- ``"eager"``: the function itself; the entry holds no memory. Keys, buckets and padding
  still apply.
- ``"compile"``: one inductor graph per bucket, traced by torch.export (``compile.py``).
- ``"cuda_graph"``: the bucket captured as a CUDA graph (``cuda_graph.py``), replayed from C++.
- ``"compile+cuda_graph"``: the bucket's ``torch.compile`` graph, captured as a CUDA graph.
- ``"auto"``: for CUDA inputs, a CUDA graph when its replay is faster than the eager call
  (measured when the bucket is built), else eager; ``"eager"`` elsewhere (on the CPU,
  inductor's builds cost seconds per bucket and need a C++ toolchain, for a smaller gain).

The C++ cache calls a builder on a miss with the call's arguments and a ``_C.BuildHandle``
(the device, whether to run the call, and all the builder may do to the cache); it returns a
``_C.BuiltEntry`` (``csrc/cache/built_entry.h``). Inline, the builder runs the call and returns
its output; in the background (``handle.run_call`` false) the call has run already, uncached,
and the builder only builds: it runs nothing that would repeat the call's effects.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shapecache._extension import _C

BACKENDS = ("auto", "eager", "compile", "cuda_graph", "compile+cuda_graph")
GRAPH_BACKENDS = ("cuda_graph", "compile+cuda_graph")


BuiltEntry = _C.BuiltEntry


@dataclass(frozen=True)
class BuildContext:
    """What a builder needs besides the call and its handle: how calls are spelled."""

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


def builds_in_background(backend: str, device: torch.device) -> bool:
    """Whether ``build="background"`` queues `backend`'s builds on `device` for a worker. A
    CUDA graph is captured on the caller's thread, inline: the capture records the caller's
    stream, and another thread's work on the device meanwhile would be captured into the graph
    or break it (``cudaStreamCaptureModeGlobal``)."""
    return resolve_backend(backend, device) not in GRAPH_BACKENDS


def make_builder(function: Callable, backend: str, context: BuildContext) -> Callable:
    """The builder the C++ cache calls on a miss: (args, kwargs, handle) -> BuiltEntry."""
    warned = []

    def build(args: tuple, kwargs: dict, handle) -> BuiltEntry:
        device = handle.device
        chosen = resolve_backend(backend, device)
        if backend in GRAPH_BACKENDS and chosen == "eager" and not warned:
            warned.append(True)
            warnings.warn(f"shapecache: backend={backend!r} got tensors on {device}; such calls run eager",
                          RuntimeWarning, stacklevel=2)
        if chosen == "eager":  # the dispatcher runs it: no frame of this builder under the call
            return BuiltEntry(function, 0, None, "eager", ran_call=False)
        if chosen == "compile":
            from shapecache._backends.compile import build_compiled

            return build_compiled(function, context, args, kwargs, handle)
        from shapecache._backends.cuda_graph import build_graph

        return build_graph(function, args, kwargs, handle, context, compiled=chosen == "compile+cuda_graph",
                           keep_only_if_faster=backend == "auto")

    return build
