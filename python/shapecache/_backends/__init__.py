"""Backends: how the entry of a new shape bucket is built.

- ``"eager"``: the function itself; the entry holds no memory. Keys, buckets and padding
  still apply.
- ``"compile"``: one inductor graph per bucket, traced by torch.export (``compile.py``).
- ``"cuda_graph"``: the bucket captured as a CUDA graph (``cuda_graph.py``), replayed from C++.
- ``"compile+cuda_graph"``: the bucket's ``torch.compile`` graph, captured as a CUDA graph.
- ``"auto"``: for CUDA inputs, a CUDA graph when its replay is faster than the eager call
  (measured when the bucket is built), else eager; ``"eager"`` elsewhere (on the CPU,
  inductor's builds cost seconds per bucket and need a C++ toolchain, for a smaller gain).
  With ``upgrade=True``, each bucket's entry is then upgraded in the background to inductor's
  compiled graph where that is faster (``upgrade.py``).

Each backend's builder is a ``Builder`` (entry.py) registered under the backend's name; the
C++ cache calls the one ``make_builder`` returns on a miss, with the call's arguments and a
``_C.BuildHandle``, and it returns a ``BuiltEntry`` (entry.py), which the cache reads once
(``csrc/cache/built_entry.h``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch

import shapecache._backends.compile
import shapecache._backends.cuda_graph
import shapecache._backends.eager  # noqa: F401  (each of the three registers its builders)
from shapecache._backends import upgrade
from shapecache._backends.compile_process import resident_bytes as compiler_resident_bytes
from shapecache._backends.compilers import check_settings as check_compiler_settings
from shapecache._backends.disk_cache import disk_cache_counts, disk_cache_state
from shapecache._backends.entry import BUILDERS, BuildContext, Builder, BuiltEntry, not_built
from shapecache._backends.graph_pool import release_device_memory
from shapecache._backends.guards import record as guard_record
from shapecache._backends.package_store import ENVIRONMENT as SHARED_DIR_VARIABLE
from shapecache._backends.package_store import directory_in as shared_packages_directory
from shapecache._backends.package_trust import untrusted_directory as untrusted_shared_directory
from shapecache._background import forked_mid_build
from shapecache._extension import _C

BACKENDS = ("auto", "eager", "compile", "cuda_graph", "compile+cuda_graph")  # "auto" picks a builder per device
GRAPH_BACKENDS = ("cuda_graph", "compile+cuda_graph")

# The package's seam: what the rest of shapecache uses of the backends.
__all__ = ["BACKENDS", "BUILDERS", "GRAPH_BACKENDS", "SHARED_DIR_VARIABLE", "BuildContext", "Builder", "BuiltEntry",
           "builds_in_background", "check_available", "check_compiler_settings", "compiler_resident_bytes",
           "disk_cache_counts", "disk_cache_state", "dynamo_entry_point", "guard_record", "make_builder",
           "release_device_memory", "resolve_backend", "shared_packages_directory", "untrusted_shared_directory"]

def check_available(backend: str) -> None:
    """Raises ValueError when `backend` cannot run here at all."""
    if backend not in GRAPH_BACKENDS:
        return
    if not _C.has_cuda_graphs:
        from shapecache._built_with import cpu_only_reason

        why = cpu_only_reason() or "it was built against a torch without CUDA"
        raise ValueError(f"backend={backend!r} is not available: {why}. Without it, use 'auto', 'eager' or 'compile'")
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
    bucket's first CUDA graph is captured on the caller's thread, inline, after the warm-up
    that computes the call's result (cuda_graph.py); only an upgrade captures on the worker
    (upgrade.py). Every capture runs on the device's own stream in thread-local capture mode,
    under the device's lock (csrc/cache/cuda/cuda_graph_runner.h)."""
    return resolve_backend(backend, device) not in GRAPH_BACKENDS


def make_builder(function: Callable, backend: str, context: BuildContext) -> Callable:
    """The builder the C++ cache calls on a miss: (args, kwargs, handle) -> BuiltEntry."""
    warned = []

    def build(args: tuple, kwargs: dict, handle) -> BuiltEntry:
        device = handle.device
        if handle.upgrading is not None:
            return upgrade.build(function, args, kwargs, handle, context)
        if device.type == "cuda" and not _C.has_cuda_graphs:
            from shapecache._built_with import warn_if_cpu_only_on_cuda

            warn_if_cpu_only_on_cuda()
        chosen = resolve_backend(backend, device)
        if backend in GRAPH_BACKENDS and chosen == "eager" and not warned:
            warned.append(True)
            warnings.warn(f"shapecache: backend={backend!r} got tensors on {device}; such calls run eager",
                          RuntimeWarning, stacklevel=2)
        if chosen != "eager" and (parent := forked_mid_build()) is not None:
            return not_built(function, args, kwargs, f"this process was forked from process {parent} while a build "
                             "ran there, and what that build had half made (a module half imported, the compiler's "
                             "state) has no thread here to finish it; shapecache.wait on the parent's cached objects "
                             "before forking avoids it", run_call=handle.run_call)
        built = BUILDERS[chosen].build(function, args, kwargs, handle, context, backend)
        if backend == "auto" and context.upgrade and built.failure == "":
            built = dataclasses.replace(built, upgrade=True)
        return built

    return build


def dynamo_entry_point(function: Callable) -> Callable:
    """`function` behind an entry point of its own for ``torch.compile`` (see compile.py): one
    code object per artifact, so that Dynamo's per-code recompile limit never applies."""
    return shapecache._backends.compile.entry_point(function)
