"""Caps on this process's memory, set and taken back, and what a failed allocation looks like.

A budget becomes a real limit, on whichever device a test or a scenario runs:
- CUDA: ``torch.cuda.set_per_process_memory_fraction``. The caching allocator refuses to grow
  past that share of the device and raises ``torch.OutOfMemoryError``; the cap counts all the
  process's memory on the device.
- CPU: the soft limit of RLIMIT_DATA, set to the data segment's present size plus the budget,
  so that the cap counts what is allocated from then on. Of the limits Linux offers, that is
  the one torch's allocator meets cleanly: it counts the heap and private writable mappings
  (where tensors and Python objects live) and not the libraries' code, so an allocation past
  it fails with torch's "DefaultCPUAllocator: can't allocate memory" or Python's MemoryError
  (RLIMIT_AS counts every mapping, reserved or not, and RLIMIT_RSS is ignored by Linux). The
  hard limit is never touched, so lifting the cap restores the soft limit exactly.
  The data segment counts address space that is reserved and never written, which a cache's
  budget does not (it counts resident memory, see ``shapecache._host_memory``): a
  frozen model with Linear layers reserves more than it writes (MKL's packed weights) and
  meets this cap sooner than its resident memory says.

Both caps belong to the process, not to a thread: every thread's allocations count against
them while they are set, and a child process inherits the CPU cap (a fork copies rlimits).
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shapecache.budget import format_bytes

__all__ = ["CapUnavailable", "MemoryCap", "allocation_failure", "cap_cuda_memory", "cap_data_segment", "out_of_memory"]


class CapUnavailable(RuntimeError):
    """No cap can be set here (no RLIMIT_DATA, no /proc/self/status, no CUDA device)."""


@dataclass
class MemoryCap:
    """A cap in force: `device`, the `budget` in bytes, `limit` (CPU: the data segment's soft
    limit; CUDA: the bytes the allocator may reserve) and how it was set, in words."""

    device: torch.device
    budget: int
    limit: int
    description: str
    _lift: Callable[[], None] | None = field(default=None, repr=False)

    def lift(self) -> None:
        """Restores what was there before the cap; a second call does nothing."""
        lift, self._lift = self._lift, None
        if lift is not None:
            lift()

    @property
    def in_force(self) -> bool:
        return self._lift is not None


def data_segment_bytes() -> int:
    """This process's data segment (VmData), the figure RLIMIT_DATA is compared with."""
    from shapecache._host_memory import process_status_bytes

    size = process_status_bytes("VmData")
    if size is None:
        raise CapUnavailable("cannot read the data segment's size (VmData) from /proc/self/status")
    return size


def cap_data_segment(budget: int) -> MemoryCap:
    """Caps the data segment at its present size plus `budget` bytes (the soft RLIMIT_DATA, or
    the hard limit where that is lower); raises CapUnavailable where it cannot."""
    if not hasattr(resource, "RLIMIT_DATA"):
        raise CapUnavailable("this platform has no RLIMIT_DATA")
    start = data_segment_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = start + budget if hard == resource.RLIM_INFINITY else min(hard, start + budget)
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    except (OSError, ValueError) as error:
        raise CapUnavailable(f"setrlimit(RLIMIT_DATA) refused {limit} bytes ({error})") from None
    lowered = " (lowered to the hard limit)" if limit < start + budget else ""
    description = (f"RLIMIT_DATA soft limit {format_bytes(limit)}{lowered}: the data segment's "
                   f"{format_bytes(start)} when the cap was set + {format_bytes(budget)}")
    return MemoryCap(torch.device("cpu"), budget, limit, description,
                     lambda: resource.setrlimit(resource.RLIMIT_DATA, (soft, hard)))


def cap_cuda_memory(budget: int, device) -> MemoryCap:
    """Caps the process's memory on CUDA `device` at `budget` bytes of its total; raises
    CapUnavailable without CUDA, ValueError when `budget` is more than the device has."""
    if not torch.cuda.is_available():
        raise CapUnavailable("no CUDA device")
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    if not 0 < budget <= total:
        raise ValueError(f"budget={budget} bytes: expected at most {device}'s {total} bytes")
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = getter(device) if getter else 1.0
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
    description = f"torch.cuda.set_per_process_memory_fraction({budget / total:.4f}) of {format_bytes(total)}"
    return MemoryCap(device, budget, budget, description,
                     lambda: torch.cuda.set_per_process_memory_fraction(before, device))


# What a failed allocation says where it is no MemoryError: torch's CPU allocator, Dynamo
# wrapping std::bad_alloc, a thread whose stack cannot be mapped under the cap, oneDNN.
_ALLOCATION_FAILURES = ("can't allocate memory", "MemoryError: std::bad_alloc", "can't start new thread",
                        "could not create a primitive")


def out_of_memory(error: BaseException | None) -> bool:
    """Whether `error` is a failed allocation: CUDA's OutOfMemoryError, Python's MemoryError, or
    a RuntimeError saying so (_ALLOCATION_FAILURES), itself or as the cause of the error that
    wraps it (Dynamo raises a MemoryError from C++'s
    std::bad_alloc as ``InternalTorchDynamoError: MemoryError: std::bad_alloc``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(error, RuntimeError) and any(text in str(error) for text in _ALLOCATION_FAILURES):
            return True
        error = error.__cause__ or error.__context__
    return False


def allocation_failure(error: BaseException) -> str:
    """The line of `error` that says which allocation failed."""
    text = str(error).strip()
    if "DefaultCPUAllocator" in text:  # "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: ..."
        text = text[text.index("DefaultCPUAllocator"):]
    return text.splitlines()[0] if text else type(error).__name__
