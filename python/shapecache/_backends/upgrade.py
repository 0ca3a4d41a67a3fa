"""A bucket's upgrade (``backend="auto", upgrade=True``): the entry ``auto`` built at once (the
eager call, or on CUDA its captured graph where that is faster) serves the bucket while the
device's worker compiles the bucket with inductor and measures both forms; the compiled form
takes the entry's place where it pays. The cache keeps the rest of the rule
(``csrc/cache/miss_policy.h``, Upgrade): the entry still the one upgraded, the new form's guard
holding, its added bytes fitting in the budget's free room (an upgrade never evicts).

The compiled form is inductor's graph of the traced call (compile.py's route), built with
freezing off: it reads the model's weights where they are, so N upgraded sizes cost no copy of
the weights, and an update in place (``load_state_dict``) is read as it is.

Where it runs: the compile on the worker thread, as any background build; the measurement on
the worker too. On CUDA the measurement holds the device's capture lock (its first run
autotunes inductor's kernels, which synchronises the device, and no capture may run beside
that) and is timed by CUDA events on the worker's own stream (cuda_graph.warm_up_stream).
"""

from __future__ import annotations

import dataclasses

import torch

from shapecache import _timing
from shapecache._backends import graph_pool
from shapecache._backends.cuda_graph import warm_up_stream
from shapecache._backends.entry import BUILDERS, BuildContext, BuiltEntry, described
from shapecache._extension import _C

# The compiled form replaces the entry only where it takes at most 1/MIN_SPEEDUP of the entry's
# time per call (the best of REPEATS runs of each). Below that a gain is within what repeated
# timings of one form differ by on a shared machine, and not worth a second compiled artifact's
# host memory and risk. Device bytes are not traded for speed here: the compiled form holds no
# copy of the weights, and where it holds more than the entry did, it must fit in the budget's
# free room (the cache's rule) or it is not kept.
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
    (the entry stays). `handle.upgrading` is the entry as it is: (backend, runner)."""
    backend, entry = handle.upgrading
    compiled = BUILDERS["compile"].build(function, args, kwargs, handle,
                                         dataclasses.replace(context, compile_options=COMPILE_OPTIONS), "auto")
    if compiled.graph is None:
        return _not_kept(compiled.failure or f"it was built as {compiled.backend!r}, not as one graph")
    tensors = handle.tensors
    if backend == "eager":  # the entry is the function itself, called as the plain call is
        def run_entry():
            return _C.run_user_code(entry, tuple(args), dict(kwargs))
    else:  # a runner over the call's tensors in key order (a CUDA graph, a graph)
        def run_entry():
            return entry(*tensors)

    def run_compiled():
        return compiled.graph(*tensors)

    try:
        entry_seconds, compiled_seconds = _measure(run_entry, run_compiled, handle.device)
    except (torch.OutOfMemoryError, MemoryError) as error:
        return _not_kept(f"measuring it ran out of memory ({described(error)})")
    if not pays(entry_seconds, compiled_seconds):
        return _not_kept(f"{compiled_seconds * 1e3:.3g} ms per call against the entry's {entry_seconds * 1e3:.3g} ms "
                         f"({backend}), under the {MIN_SPEEDUP}x it must gain")
    return compiled


def _measure(run_entry, run_compiled, device: torch.device) -> tuple[float, float]:
    """The best of REPEATS seconds per call of each form, after one run of the compiled form (its
    first: lazy loading, and on CUDA inductor's autotuning)."""
    if device.type != "cuda":
        run_compiled()
        return (min(_timing.timings(run_entry, device, REPEATS)),
                min(_timing.timings(run_compiled, device, REPEATS)))
    stream = warm_up_stream(device)
    with graph_pool.device_lock(device):
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            run_compiled()
        return (min(_timing.stream_seconds(run_entry, stream, REPEATS)),
                min(_timing.stream_seconds(run_compiled, stream, REPEATS)))


def _not_kept(why: str) -> BuiltEntry:
    return BuiltEntry(runner=None, bytes=0, backend="compile", failure=why, ran_call=False)
