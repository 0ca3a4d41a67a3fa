"""The ``"compile"`` backend: one inductor graph per bucket.

Each bucket is captured whole by ``torch.export`` (trace.py) and compiled on the route chosen
for it (compilers.py, exported.py), so that evicting it gives its memory back. Where the call
cannot be exported whole, or the compile options ask for what only ``torch.compile`` does (another backend, CUDA graph trees),
the bucket is built by ``torch.compile(dynamic=False)`` (Dynamo) instead, as follows.

Each Dynamo bucket compiles an entry point of its own: a function of this file that calls the cached
function, with a code object of its own. Dynamo keeps compiled code, guards and its recompile
count per code object, so one per bucket means no bucket ever meets Dynamo's recompile limit
(which would silently run the 9th shape eager) and guards are checked against one bucket's entry
instead of all of them.
The entry point is shapecache's, not the function's own code: torch.compile wraps a function
defined in torch's own files (``nn.Sequential.forward``) in one ``inner`` frame of torch's
that every bucket would share, limit included; Dynamo compiles this frame and inlines the
function instead. Dynamo keeps what it compiled reachable after eviction (see trace.py).
"""

from __future__ import annotations

import contextlib
import gc
import types
import warnings
import weakref
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves

from shapecache._backends import compilers, exported, guards, trace
from shapecache._backends.entry import BuildContext, Builder, BuiltEntry, described, not_built, register
from shapecache._extension import _C
from shapecache._host_memory import memory_ranges, resident_bytes, resident_bytes_of, return_free_memory


@register
class CompiledBuilder(Builder):
    name = "compile"

    def build(self, function, args, kwargs, handle, context: BuildContext, asked: str) -> BuiltEntry:
        """The bucket's entry: one exported graph, compiled on its route (exported.py), or where the
        call cannot be exported whole or the options ask for another backend, Dynamo's build.

        Every failure falls back: where export fails, Dynamo builds; where the compiler fails, or
        the call writes Python state it reads (which a graph would not replay), nothing is kept
        and the bucket runs uncached (the dispatcher remembers it). The call's own exceptions
        reach the caller from the plain call, before anything else is tried.

        In the background (``handle.run_call`` false) the call ran already: the graph is traced
        and compiled, never run. Dynamo compiles only by running the call, which would repeat its
        effects, so a bucket that needs Dynamo is not built there (it runs uncached)."""
        device, run_call = handle.device, handle.run_call
        roots = guards.call_roots(args, kwargs, context.has_owner, context.parameter_names)  # once per build
        hooks = trace.hooks_a_graph_drops(function, args, roots, context.has_owner)
        if compilers.handles(context.compile_options) and not hooks:
            try:
                free_what_entries_left(device)  # what earlier evictions freed goes back to the system first
                compiled = exported.compile_call(function, args, kwargs, handle.tensors, roots, context,
                                                 in_background=not run_call)
                # What the trace left (its copies of the model, the exported program: cycles) was
                # collected as the build ended (trace.dropping_tracing_leftovers); what that
                # freed goes back to the system.
                if device.type == "cpu":
                    return_free_memory()
            except trace.ExportFailed as failure:
                if not run_call:
                    return not_built(function, args, kwargs, f"torch.export could not capture it as one graph ({failure}), "
                                     "and Dynamo compiles only by running the call again", run_call=False)
                _C.run_user_code(function, tuple(args), dict(kwargs))  # a call that fails by itself raises its own error here
                warn_once(function, context, args, f"torch.export could not capture it as one graph ({failure}); its "
                           "buckets are compiled by Dynamo, whose compiled code stays in memory after eviction")
            except trace.ReadsUnguardedState as read:
                return not_built(function, args, kwargs, f"it reads inference tensors kept in a list, a dict, a global "
                                 f"or a closure ({read}), which a graph would hold as constants, and whose updates in "
                                 "place no guard sees", run_call=run_call)
            except trace.WritesState as written:
                return not_built(function, args, kwargs, f"the call writes {written}, which a compiled graph would not "
                                 "write again on later calls", run_call=run_call)
            except Exception as error:  # noqa: BLE001  (inductor's failures share no base class)
                return not_built(function, args, kwargs, f"building it failed: {described(error)}",
                                 run_call=run_call)
            else:
                # The cache runs the graph for the call's result once it has made the entry's
                # guard, which then sees what the run updates (BatchNorm's statistics in
                # training); in the background, the entry's first hit does (miss_policy.h).
                return BuiltEntry(runner=None, graph=compiled.graph, rebuild=compiled.rebuild,
                                  bytes=held_bytes(compiled.constants, device) + compiled.constant_bytes,
                                  backend="compile", guard=compiled.guard, built_from=compiled.built_from,
                                  ran_call=False)
        # Dynamo runs hooks as torch.compile does: on the call's own tensors, on every call.
        why = (f"it runs forward hooks that a graph would not run again ({', '.join(hooks[:3])})" if hooks
               else "its compile options need Dynamo")
        if not run_call:
            return not_built(function, args, kwargs, f"{why}, and Dynamo compiles only by running the call again",
                             run_call=False)
        if hooks:
            warn_once(function, context, args, f"{why}; its buckets are compiled by Dynamo, whose compiled code stays in memory "
                       "after eviction")
        return _build_with_dynamo(function, context, args, kwargs, device, roots)


def _build_with_dynamo(function, context, args, kwargs, device, roots) -> BuiltEntry:
    copy = entry_point(function)
    runner = torch.compile(copy, dynamic=False, **context.compile_options)
    compiled = _dynamo_compiled(copy)
    try:
        with _held_bytes(device) as held:
            output = _C.run_user_code(runner, tuple(args), dict(kwargs))
    except Exception as error:  # noqa: BLE001
        return not_built(function, args, kwargs, f"torch.compile failed: {described(error)}")
    if not compiled():
        warnings.warn(
            f"shapecache: torch.compile made no graph for a new bucket of {getattr(function, '__qualname__', function)}; "
            "that bucket runs eager (is torch.compile disabled, or does the function run no tensor code?)",
            RuntimeWarning,
            stacklevel=2,
        )
        return BuiltEntry(runner, held.bytes(output), output, "eager")
    # Dynamo guards what its graph read itself; shapecache's guard over the whole module trees
    # makes its entries stale on the same changes as every other backend's.
    guard = guards.record(roots, functions=[function], hooks_state=False)
    return BuiltEntry(runner, held.bytes(output), output, "compile", guard)


def held_bytes(constants: list, device: torch.device) -> int:
    """What a compiled graph's own tensors hold on `device`: on the CPU, their resident pages
    (shapecache/_host_memory.py); elsewhere their storages' bytes. Read from the tensors
    themselves, it is the entry's whatever other threads allocate or free during the build."""
    mine = [t for t in constants if t.device == device]
    return resident_bytes_of(mine) if device.type == "cpu" else sum(memory_ranges(mine).values())


class _HeldBytes:
    def __init__(self, device):
        self.device = device
        self.before = self.after = 0

    def bytes(self, output) -> int:
        """What the build left allocated beyond its output."""
        return max(0, self.after - self.before - tensor_bytes(output, self.device))


@contextlib.contextmanager
def _held_bytes(device):
    """Measures what the block leaves allocated on `device` (a Dynamo build, whose compiled
    tensors are not listed): on the CPU, what it leaves resident (shapecache/_host_memory.py).
    Other threads' allocations and frees during the block move the figure.
    On both sides the garbage collector runs and the heap's free pages are given back, so that
    neither garbage nor freed pages of the build or of earlier evictions are counted (a
    collection and a trim cost milliseconds; a build, seconds)."""
    held = _HeldBytes(device)
    _settle(device)
    held.before = allocated_bytes(device)
    yield held
    _settle(device)
    held.after = allocated_bytes(device)


def _settle(device) -> None:
    if device.type == "cpu":
        gc.collect()
        return_free_memory()


# _C.entries_released() at the last full collection that walked every object (none frozen);
# none was let go before the process's first build.
_collected_at = [0]


def free_what_entries_left(device) -> None:
    """Before a CPU build: a full garbage collection where entries were let go since the last
    (their compiled graphs hold reference cycles), and the heap's free pages back to the
    system. Skipped where none was: a full collection walks every object of the process, a
    tenth of a second or more with inductor loaded, and would be most of the build of a size
    whose package is shared (call_index). A collection with objects frozen (a background build,
    _background.objects_before_frozen) leaves theirs, so the count is not taken as collected."""
    if device.type != "cpu":
        return
    released = _C.entries_released()
    if released != _collected_at[0]:
        frozen_before = gc.get_freeze_count()
        gc.collect()
        # Taken as collected only where nothing was frozen before or after (a background build
        # may freeze between the two steps, or while a callback of the collection runs).
        if frozen_before == 0 and gc.get_freeze_count() == 0:
            _collected_at[0] = released  # read before collecting: a release during it is collected next time
    return_free_memory()


_warned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cached model or function -> reasons warned of


def warn_once(function, context: BuildContext, args: tuple, text: str) -> None:
    """Warns of `text` once per reason and cached model (its owner: every Sequential shares
    one forward function), or per function where there is none."""
    reason = text.split(" (")[0]  # a failure's details (its shapes) differ from bucket to bucket
    key = args[0] if context.has_owner and args else function
    try:
        reasons = _warned.setdefault(key, set())
        if reason in reasons:
            return
        reasons.add(reason)
    except TypeError:  # not weakly referenceable: warn every time
        pass
    warnings.warn(f"shapecache: {getattr(function, '__qualname__', function)}: {text}", RuntimeWarning, stacklevel=3)


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
    process's resident anonymous memory (see shapecache/_host_memory.py); 0 where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        return resident_bytes() or 0
    return 0


def tensor_bytes(output, device: torch.device) -> int:
    """Bytes of the distinct storages of the tensors in `output` on `device`."""
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.device == device]
    return sum(memory_ranges(tensors).values())
