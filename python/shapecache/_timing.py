"""Wall-clock timing of work that may run on a GPU: each call is timed from an idle device to
an idle device, so the queued kernels count and earlier work does not."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Waits for `device`'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
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
