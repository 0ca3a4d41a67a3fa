"""Timing of work that may run on a GPU. `seconds` and `timings` are wall-clock, each call
timed from an idle device to an idle device, so the queued kernels count and earlier work does
not; `stream_seconds` times by CUDA events on one stream, for what may run beside another
thread's capture."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Waits for `device`'s queued work (nothing to wait for on the CPU), under the device's
    capture lock: a device-wide synchronisation beside another thread's capture would wait on,
    or break, that capture (csrc/cache/cuda/cuda_graph_runner.h). Every synchronisation of the
    library goes through here or holds that lock (tests/backends/test_device_rules.py)."""
    if device.type == "cuda":
        from shapecache._extension import _C

        # (graph_pool.device_lock's rule; that module is the backends' own, not this one's to import)
        with _C.cuda_device_lock(device) if _C.has_cuda_graphs else contextlib.nullcontext():
            torch.cuda.synchronize(device)


def seconds(call: Callable[[], object], device: torch.device) -> float:
    """Seconds `call()` takes, its device work included."""
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - start


def timings(call: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """`seconds` of `repeats` calls."""
    return [seconds(call, device) for _ in range(repeats)]


def stream_seconds(call: Callable[[], object], stream: torch.cuda.Stream, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls as `stream` ran them: the call's work is queued on
    `stream`, or ordered after what it held and before what it is given next (a CUDA graph's
    replay on its own stream). Timed by CUDA events recorded on `stream`, so a gap while the
    host launched kernels counts; waiting for the last event waits for `stream` alone, never
    the whole device, which may not be synchronised beside another thread's capture. What
    `stream` held before is waited for first, so the first call's launches are not hidden
    behind it. The calls run with `stream` (and its device) current."""
    stream.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        for start, end in events:
            start.record(stream)
            call()
            end.record(stream)
    events[-1][1].synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]
