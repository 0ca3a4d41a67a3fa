"""A bucket's upgrade (``backend="auto", upgrade=True``): the entry ``auto`` built at once (the
eager call, or on CUDA its captured graph where that is faster) serves the bucket while the
device's worker compiles the bucket with inductor and measures both forms; the compiled form
takes the entry's place where it pays. The cache keeps the rest of the rule
(``csrc/cache/miss_policy.h``, Upgrade): when an upgrade is asked for (the entry's first hit),
the entry still the one upgraded, the new form's guard holding after its measurement, its added
bytes fitting in the budget's free room (an upgrade never evicts).

The compiled form is inductor's graph of the traced call (exported.py's route), built with
freezing off: it reads the model's weights where they are, so N upgraded sizes cost no copy of
the weights, and its guard does not count an update of them in place as a change
(guards.read_where_they_are): ``load_state_dict`` rebuilds nothing.

Measuring runs both forms again on the call's inputs, never the user's Python: the compiled
graph, and the entry where it is a graph, or for an eager entry its traced graph uncompiled (the
same operators). So only a bucket whose graph computes its outputs and nothing else is
upgraded: one that writes a parameter, a buffer or an input (BatchNorm's running statistics in
training) or draws random numbers (dropout in training, whose draws a compiled graph makes
differently from the plain call; Python's or numpy's, which a graph would hold as constants)
keeps its entry as it is (trace.effects, exported.compile_call). What the trace refuses (Python
state written, hooks) is refused here too.

On CUDA the compiled form is also captured as a CUDA graph into the device's pool, on the
worker (the capture runs on the device's own stream, in thread-local capture mode, under the
device's lock: csrc/cache/cuda/cuda_graph_runner.h), and three forms are measured: the entry,
the compiled graph, and its capture. Each holds more than the one before it (the compiled
graph's kernels; the capture's static inputs and pool blocks besides), and replaces it only
where it pays (`chosen_form`). The captured form reads the weights at the addresses its capture
saw, so its guard is the compiled form's (a weight replaced is a change, an update in place is
read); it is kept only where it and what its capture added to the pool fit in the budget's free
room (graph_pool.keep_in_free_room), and otherwise let go of, the pool left as it was.

Where it runs: the compile on the worker thread, as any background build; the measurement on
the worker too. On CUDA the compiled form's first run holds the device's capture lock (it
autotunes inductor's kernels, which synchronises the device, and no capture may run beside
that), and the forms are timed by CUDA events on the worker's own stream
(cuda_graph.warm_up_stream).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_leaves

from shapecache import _timing
from shapecache._backends import exported, graph_pool, guards, trace
from shapecache._backends.compile import held_bytes, warn_once
from shapecache._backends.cuda_graph import warm_up_stream
from shapecache._backends.entry import BuildContext, BuiltEntry, described
from shapecache._extension import _C
from shapecache._host_memory import return_free_memory

# The compiled form replaces the entry only where it takes at most 1/MIN_SPEEDUP of the entry's
# time per call (the best of REPEATS runs of each, the two forms taking turns). Below that a
# gain is within what repeated timings of one form differ by on a shared machine, and not worth
# a second compiled artifact's host memory and risk. Device bytes are not traded for speed here:
# the compiled form holds no copy of the weights, and where it holds more than the entry did, it
# must fit in the budget's free room (the cache's rule) or it is not kept.
MIN_SPEEDUP = 1.03
REPEATS = 3

# The options of the compiled form: inductor's defaults, with freezing off whatever the
# process's configuration says (a frozen graph folds a copy of the weights into each size's).
COMPILE_OPTIONS = {"options": {"freezing": False}}


def pays(entry_seconds: float, compiled_seconds: float) -> bool:
    """Whether a form taking `compiled_seconds` per call replaces one taking `entry_seconds`
    that holds less."""
    return compiled_seconds * MIN_SPEEDUP <= entry_seconds


def chosen_form(entry_seconds: float, compiled_seconds: float, captured_seconds: float | None = None) -> str:
    """Which form serves the bucket, of "entry" (it stays), "compiled" (inductor's graph) and
    "captured" (that graph captured as a CUDA graph; None: there is none). Each holds more than
    the one before it and is chosen only where it pays against the form that would serve
    otherwise: the compiled form against the entry, the captured one against whichever of those
    two is chosen."""
    form, seconds = "entry", entry_seconds
    if pays(entry_seconds, compiled_seconds):
        form, seconds = "compiled", compiled_seconds
    if captured_seconds is not None and pays(seconds, captured_seconds):
        form = "captured"
    return form


def build(function, args: tuple, kwargs: dict, handle, context: BuildContext) -> BuiltEntry:
    """The bucket's compiled form, where it pays; else a BuiltEntry with no runner that says why
    (the entry stays). `handle.upgrading` is the entry as it is: (backend, runner). A bucket
    that cannot be upgraded is warned of once per reason and model; one that is not faster is
    not (that is what measuring is for)."""
    backend, entry = handle.upgrading
    device = handle.device
    roots = guards.call_roots(args, kwargs, context.has_owner, context.parameter_names)
    hooks = trace.hooks_a_graph_drops(function, args, roots, context.has_owner)
    if hooks:
        return _refused(function, context, args, f"it runs forward hooks that a graph would not run again "
                        f"({', '.join(hooks[:3])})")
    try:
        compiled = exported.compile_call(function, args, kwargs, handle.tensors, roots,
                                         dataclasses.replace(context, compile_options=COMPILE_OPTIONS),
                                         in_background=True, without_effects=True)
    except exported.HasEffects as what:
        return _refused(function, context, args, f"its graph {what}, which measuring it would do again")
    except Exception as error:  # noqa: BLE001  (trace's refusals; inductor's failures share no base class)
        return _refused(function, context, args, f"it could not be compiled ({described(error)})")
    finally:
        if device.type == "cpu":
            return_free_memory()  # what the trace left, collected as it ended
    tensors = handle.tensors
    if backend == "eager":
        # The eager entry is the function itself, whose Python may do what no trace sees (a
        # log line, a counter): it is timed by its traced graph, uncompiled, which runs the
        # same operators without that Python (and so times the call slightly faster than it is).
        def run_entry():
            return compiled.uncompiled(*tensors)
    else:  # a runner over the call's tensors in key order (a CUDA graph, a graph): no Python of the user's
        def run_entry():
            return entry(*tensors)

    def run_compiled():
        return compiled.graph(*tensors)

    # Compiled without freezing, the graph is given the model's weights on every call: an
    # update in place (load_state_dict) is read as it is, and rebuilds nothing.
    guard = guards.read_where_they_are(compiled.guard, compiled.weights)
    compiled_bytes = held_bytes(compiled.constants, device) + compiled.constant_bytes
    compiled_entry = BuiltEntry(runner=None, graph=compiled.graph, rebuild=compiled.rebuild, bytes=compiled_bytes,
                                backend="compile", guard=guard, built_from=compiled.built_from, ran_call=False)
    captured = None
    try:
        _first_run(run_compiled, device)
        if device.type == "cuda" and not capture_refusal(compiled, device):
            captured = _capture(compiled, handle, guard)
        forms = {"entry": run_entry, "compiled": run_compiled}
        if captured is not None:
            forms["captured"] = lambda: captured.runner(*tensors)
        seconds = _measure(forms, device)
        if compiled.built_from is not None and not compiled.built_from.check():
            # The model changed while this was built: what was measured says nothing of it.
            # The cache finds the compiled form stale from the start and asks once more.
            return compiled_entry
        form = chosen_form(seconds["entry"], seconds["compiled"], seconds.get("captured"))
        if form == "captured":
            chosen, captured = captured, None  # handed over to the entry, or let go of there
            kept = _kept_capture(chosen, compiled_bytes, handle)
            if kept is not None:
                return kept
            form = chosen_form(seconds["entry"], seconds["compiled"])
    except Exception as error:  # noqa: BLE001  (out of memory, oneDNN's primitive: never the cache's retry, which evicts)
        return _refused(function, context, args, f"measuring it failed ({described(error)})")
    finally:
        if captured is not None:  # not chosen, or a failure: let go of, the pool left as it was
            _let_go(captured, handle)
    if form == "entry":
        return _not_kept(f"{seconds['compiled'] * 1e3:.3g} ms per call against the entry's "
                         f"{seconds['entry'] * 1e3:.3g} ms ({backend}), under the {MIN_SPEEDUP}x it must gain")
    return compiled_entry


def capture_refusal(compiled: exported.CompiledCall, device: torch.device) -> str:
    """Why the compiled form on `device` is not captured as a CUDA graph; "" where it is.

    - The build has no CUDA graphs, or torch is older than 2.13: there a capture on one thread
      makes another thread's draws from the device's default generator raise (2.11 and 2.12
      register it with every capture: csrc/core/pool_generations.h, A9), and an upgrade
      captures on the worker while the user's threads serve (and draw: diffusers' randn_tensor).
    - inductor's own checks before it captures (torch/_inductor/compile_fx.py, with cudagraphs
      on; 2.11 and 2.13): an op that is unsafe in a graph (tagged ``cudagraph_unsafe``, or with
      sizes known only when it runs), and any tensor of the traced graph on another device
      than `device`: a CPU tensor's work would run once, when captured, its values held.
    """
    if not _C.has_cuda_graphs:
        return "this build of shapecache has no CUDA graphs"
    if not graph_pool.captures_leave_other_threads_draws_alone():
        return f"torch {torch.__version__}: a capture beside the serving threads would make their random draws raise"
    if not isinstance(compiled.uncompiled, torch.fx.GraphModule):
        return "its traced graph is not at hand"
    try:
        return graph_refusal(compiled.uncompiled, device)
    except Exception as error:  # noqa: BLE001  (torch's checks on a graph they do not expect: the capture alone is refused)
        return f"checking its graph failed ({described(error)})"


def graph_refusal(traced: torch.fx.GraphModule, device: torch.device) -> str:
    """inductor's checks of a traced graph before it captures one (`capture_refusal`)."""
    try:
        from torch._inductor.utils import get_first_incompatible_cudagraph_node
    except ImportError:
        return "this torch has no check of what a graph may capture"
    unsafe = get_first_incompatible_cudagraph_node(traced)
    if unsafe is not None:
        return f"it runs {unsafe.target}, which a CUDA graph cannot hold"
    for node in traced.graph.nodes:
        for value in tree_leaves(node.meta.get("val")):
            if isinstance(value, torch.Tensor) and value.device != device:
                return f"{node.name} is on {value.device}"
    return ""


class _Capture(NamedTuple):
    runner: object  # a _C.CudaGraphRunner
    bytes: int  # its own: static inputs and the instantiated graph (graph_pool.measured_capture)
    grew: bool  # whether its capture grew the device's pool and workspace


def _capture(compiled: exported.CompiledCall, handle, guard: guards.GuardRecord) -> _Capture | None:
    """The compiled form captured into the device's pool, measured and not charged; None where
    it cannot be captured (the uncaptured form serves: a graph that synchronises, or copies to
    the host, is no worse for it). Its first run is done, so nothing is autotuned or loaded
    inside the capture."""
    graph, rebuild, device = compiled.graph, compiled.rebuild, handle.device

    def call(*tensors):  # as CompiledGraphRunner runs the graph: the output in its structure
        outputs = graph(*tensors)
        return rebuild(outputs) if rebuild is not None else outputs[0]

    tensors = tuple(handle.tensors)
    # What the first run and the timings cached on the worker's stream goes back first, as
    # before every capture (cuda_graph.py): a graph's private pool takes no blocks of another
    # stream, so they would stay reserved beside it, outside any budget.
    graph_pool.empty_allocator_caches(device)
    # The figures before and after under one hold of the device's lock (recursive: the capture
    # takes it again), so that no other thread's capture is counted as this one's growth.
    with graph_pool.device_lock(device):
        pool_before = graph_pool.pool_and_workspace_bytes(device)
        try:
            runner, entry_bytes = graph_pool.measured_capture(
                lambda: _C.capture_cuda_graph(call, None, tensors, {}, tensors, _C.StateGuard(guard)), handle,
                charge=False)
        except Exception:  # noqa: BLE001  (a failed capture is cleaned up in C++: csrc/core/pool_generations.h)
            return None
        grew = graph_pool.pool_and_workspace_bytes(device) > pool_before
    return _Capture(runner, entry_bytes, grew)


def _kept_capture(captured: _Capture, compiled_bytes: int, handle) -> BuiltEntry | None:
    """The captured form's entry, where it fits in the budget's free room with the pool as it is
    (charged then); else None, and the capture let go of, on every way out."""
    entry_bytes = captured.bytes + compiled_bytes  # the runner holds the compiled graph, and with it its constants
    try:
        graph_pool.keep_in_free_room(handle, captured.runner, entry_bytes, captured.grew)
    except graph_pool.NotKept:  # let go of there
        return None
    except BaseException:
        _let_go(captured, handle)
        raise
    return BuiltEntry(runner=None, bytes=entry_bytes, backend="compile+cuda_graph", entry_runner=captured.runner,
                      ran_call=False)


def _let_go(captured: _Capture, handle) -> None:
    """Lets go of a capture not kept without evicting (an upgrade never evicts); a failure to
    rebuild the pool without it is warned of, never raised over what the upgrade returns."""
    try:
        graph_pool.let_go_of_new(handle, captured.runner, captured.grew, evict=False)
    except Exception as error:  # noqa: BLE001  (its graph is released first: what failed is the rebuild)
        warnings.warn(f"shapecache: rebuilding the graph pool of {handle.device} without an upgrade's graph failed "
                      f"({described(error)})", RuntimeWarning, stacklevel=2)


def _first_run(run_compiled, device: torch.device) -> None:
    """The compiled form's first run: lazy loading, and on CUDA inductor's autotuning, which
    synchronises the device and so runs under the device's lock (no capture may run beside it);
    the lock holds other threads' captures and replays off for that run alone."""
    if device.type != "cuda":
        run_compiled()
        return
    stream = warm_up_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with graph_pool.device_lock(device), torch.cuda.device(device), torch.cuda.stream(stream):
        run_compiled()


def _measure(forms: dict, device: torch.device) -> dict:
    """The best of REPEATS seconds per call of each of `forms` (name -> run), taking turns (a
    burst of other work meanwhile slows them all); on CUDA by events on the worker's stream,
    which need no lock (stream_seconds waits for its own stream only)."""
    times = {name: [] for name in forms}
    stream = warm_up_stream(device) if device.type == "cuda" else None
    for _ in range(REPEATS):
        for name, run in forms.items():
            if stream is None:
                times[name].append(_timing.seconds(run, device))
            else:
                times[name] += _timing.stream_seconds(run, stream, 1)
    return {name: min(seconds) for name, seconds in times.items()}


def _refused(function, context: BuildContext, args: tuple, why: str) -> BuiltEntry:
    warn_once(function, context, args, f"a bucket is not upgraded: {why}; it keeps the entry backend='auto' built")
    return _not_kept(why)


def _not_kept(why: str) -> BuiltEntry:
    return BuiltEntry(runner=None, bytes=0, backend="compile", failure=why, ran_call=False)
