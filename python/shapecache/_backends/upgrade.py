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

Where it runs: the compile on the worker thread, as any background build; the measurement on
the worker too. On CUDA the compiled form's first run holds the device's capture lock (it
autotunes inductor's kernels, which synchronises the device, and no capture may run beside
that), and both forms are timed by CUDA events on the worker's own stream
(cuda_graph.warm_up_stream).
"""

from __future__ import annotations

import dataclasses

import torch

from shapecache import _timing
from shapecache._backends import exported, graph_pool, guards, trace
from shapecache._backends.compile import held_bytes, warn_once
from shapecache._backends.cuda_graph import warm_up_stream
from shapecache._backends.entry import BuildContext, BuiltEntry, described
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
    """Whether a compiled form taking `compiled_seconds` per call replaces an entry taking
    `entry_seconds`."""
    return compiled_seconds * MIN_SPEEDUP <= entry_seconds


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

    try:
        entry_seconds, compiled_seconds = _measure(run_entry, run_compiled, device)
    except Exception as error:  # noqa: BLE001  (out of memory, oneDNN's primitive: never the cache's retry, which evicts)
        return _refused(function, context, args, f"measuring it failed ({described(error)})")
    if not pays(entry_seconds, compiled_seconds):
        return _not_kept(f"{compiled_seconds * 1e3:.3g} ms per call against the entry's {entry_seconds * 1e3:.3g} ms "
                         f"({backend}), under the {MIN_SPEEDUP}x it must gain")
    # Compiled without freezing, the graph is given the model's weights on every call: an
    # update in place (load_state_dict) is read as it is, and rebuilds nothing.
    return BuiltEntry(runner=None, graph=compiled.graph, rebuild=compiled.rebuild,
                      bytes=held_bytes(compiled.constants, device) + compiled.constant_bytes, backend="compile",
                      guard=guards.read_where_they_are(compiled.guard, compiled.weights),
                      built_from=compiled.built_from, ran_call=False)


def _measure(run_entry, run_compiled, device: torch.device) -> tuple[float, float]:
    """The best of REPEATS seconds per call of each form, the two taking turns (a burst of other
    work meanwhile slows both), after one run of the compiled form (its first: lazy loading, and
    on CUDA inductor's autotuning)."""
    entry_times, compiled_times = [], []
    if device.type != "cuda":
        run_compiled()
        for _ in range(REPEATS):
            entry_times.append(_timing.seconds(run_entry, device))
            compiled_times.append(_timing.seconds(run_compiled, device))
        return min(entry_times), min(compiled_times)
    stream = warm_up_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    # The first run under the device's lock: inductor autotunes its kernels there, and its
    # benchmarking synchronises the device, which must not happen beside a capture. The lock
    # holds other threads' captures and replays off for that run alone; the timed runs need no
    # lock (stream_seconds waits for its own stream only).
    with graph_pool.device_lock(device), torch.cuda.device(device), torch.cuda.stream(stream):
        run_compiled()
    for _ in range(REPEATS):
        entry_times += _timing.stream_seconds(run_entry, stream, 1)
        compiled_times += _timing.stream_seconds(run_compiled, stream, 1)
    return min(entry_times), min(compiled_times)


def _refused(function, context: BuildContext, args: tuple, why: str) -> BuiltEntry:
    warn_once(function, context, args, f"a bucket is not upgraded: {why}; it keeps the entry backend='auto' built")
    return _not_kept(why)


def _not_kept(why: str) -> BuiltEntry:
    return BuiltEntry(runner=None, bytes=0, backend="compile", failure=why, ran_call=False)
