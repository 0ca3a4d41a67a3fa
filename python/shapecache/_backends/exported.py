"""A bucket built as one graph: the call is traced (trace.py), its graph comes from the route
chosen for it (compilers.choose_route: the package store, then the compilers in order), and the
entry is made of the two. Evicting the entry gives its memory back: nothing else holds the
compiled graph (inductor_compiler.py says how).

One build at a time (``_background.build_lock``): the trace and inductor change process-wide
state (torch.fx's patches, inductor's configuration) and the modules inductor loads meanwhile
are one entry's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from shapecache import _background
from shapecache._backends import call_index, compilers
from shapecache._backends.compile_process import SavedProgram
from shapecache._backends.package_store import PackageStore
from shapecache._backends.trace import dropping_tracing_leftovers, effects, trace_call


class CompiledCall(NamedTuple):
    """A bucket's compiled graph, as the cache makes its entry from it (BuiltEntry)."""

    graph: Callable  # the call's tensors in key order -> the output's tensors
    rebuild: Callable | None  # puts the output's tensors back into its structure; None: one tensor
    guard: object  # the guards.GuardRecord of what the graph was built from (trace.Trace.guard)
    built_from: object  # the guard over the live state the trace started from (trace.Trace.built_from)
    constants: list  # the tensors the graph holds that the model does not (compilers.CompiledGraph)
    constant_bytes: int = 0  # bytes the graph holds besides `constants` (a package's constants)
    # The model's parameters and buffers the traced graph holds, the live tensors themselves:
    # a graph compiled without freezing is given them on every call, reading them where they are.
    weights: tuple = ()
    # With `without_effects`: the traced graph itself, uncompiled, called as `graph` is: the
    # call's operators without its Python.
    uncompiled: Callable | None = None


class HasEffects(Exception):
    """The traced graph does more than compute its outputs (trace.effects says what)."""


def compile_call(function: Callable, args: tuple, kwargs: dict, tensors: tuple, roots: dict, context,
                 in_background: bool, without_effects: bool = False) -> CompiledCall:
    """The compiled graph of later calls of `function` spelled like this one, at these shapes.
    `tensors` are the call's tensors in key order (``BuildHandle.tensors``), `roots` its module
    trees (guards.call_roots), `context` the cached function's BuildContext; `in_background`:
    the build runs on a background worker. `without_effects`: a graph that writes tensors or
    draws random numbers (trace.effects), or whose trace drew from Python's or numpy's random
    numbers (Trace.draws_outside_torch), raises HasEffects before it is compiled.

    Raises trace.py's refusals; the last compiler's own errors propagate."""
    name = getattr(function, "__qualname__", repr(function))
    with _background.build_lock():
        store = PackageStore.from_environment()
        if store is not None and not without_effects:
            # A call another process traced to a package is served from it untraced, where
            # the call index has its record and the model is as that process traced it.
            indexed = call_index.find(store, function, args, kwargs, tensors, roots, context.compile_options)
            if indexed is not None:
                return indexed
        return _traced_and_compiled(function, args, kwargs, tensors, roots, context, in_background, without_effects,
                                    name)


def _traced_and_compiled(function: Callable, args: tuple, kwargs: dict, tensors: tuple, roots: dict, context,
                         in_background: bool, without_effects: bool, name: str) -> CompiledCall:
    # The collection that drops what the trace left walks the objects the build made, those
    # from before frozen (as on a background worker, where this is left alone). The builder's
    # own collection before it (compile.free_what_entries_left) walks them all: it frees what evictions left.
    with _background.objects_before_frozen(), dropping_tracing_leftovers():
        traced = trace_call(function, args, kwargs, tensors, roots, context.parameter_names, context.has_owner)
        if without_effects and (what := traced.draws_outside_torch or effects(traced.program)):
            traced = None  # (the error's traceback holds this frame)
            raise HasEffects(what)
        route = compilers.choose_route(traced, context.compile_options, in_background, name, context.failed_compilers)
        # Named as the trace ends, from the state it traced (a global changed during the compile
        # is not in it); written once the package's key is known.
        indexed = call_index.prepare(traced, function, args, kwargs, route.options) if route.store else None
        saved = SavedProgram(traced.program)
        try:
            compiled = compilers.compile_on(route, traced, saved, owner=function)
            if compiled.key is not None and indexed is not None:
                call_index.write(route.store, indexed, compiled.key)
            result = CompiledCall(compiled.run, traced.rebuild, traced.guard, traced.built_from, compiled.constants,
                                  compiled.constant_bytes, (*traced.graph.parameters(), *traced.graph.buffers()),
                                  traced.graph if without_effects else None)
        finally:
            saved.remove()
            # What the trace left (its copies of the model, the exported program: cycles) is
            # collected as the block ends, on every way out: the trace is let go of first (a
            # compiler's error keeps this frame in its traceback).
            traced = saved = compiled = None
    return result
