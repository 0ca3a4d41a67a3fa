"""What a CPU entry holds: the process's resident anonymous memory, read before and after its build.

Resident anonymous memory (Linux's RssAnon) is what a container's memory limit and the
out-of-memory killer count: heap pages, tensors and Python objects that have been written to.
Chosen over the C library's heap in use, which counts address space that was reserved but never
touched (MKL packs each Linear weight of a frozen graph into a buffer several times the
weight's size and writes a small part of it; docs/budgets.md has the figures). Chosen over
torch's CPU allocator statistics, which are off unless enabled and miss what inductor's
compiled modules keep outside tensors. Files mapped
into memory (loaded libraries, compiled kernels) are not anonymous and are not counted.

The figure is the process's, so two things are done to make it an entry's alone:
- Before and after the build the garbage collector runs and the heap's free pages are given back
  (``return_free_memory``): what the build freed, and what entries evicted earlier freed, leave
  the figure. glibc otherwise keeps them resident: it raises its mmap threshold to the largest
  block freed, so after the first large frees, tensors come from the heap and their pages stay
  on free.
- The compiler's one-time start-up (its modules, caches and runtime) happens before the first
  measured build, in a build of a small graph (exported.warm_up);
  otherwise the first entry of a process is charged it and may be taken for larger than the
  whole budget.
Allocations by other threads during a build are still charged to it. Where /proc/self/status
cannot be read (not Linux), CPU entries are charged 0 bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc_function(name: str, restype, *argtypes):
    """glibc's function `name`, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    function.restype = restype
    function.argtypes = list(argtypes)
    return function


def return_free_memory() -> None:
    """Returns the heap's free pages to the operating system (glibc's malloc_trim; nothing elsewhere)."""
    trim = _libc_function("malloc_trim", ctypes.c_int, ctypes.c_size_t)
    if trim is not None:
        trim(0)


def resident_bytes() -> int | None:
    """Anonymous memory of this process resident now (RssAnon), or None where the system cannot say."""
    return process_status_bytes("RssAnon")


def process_status_bytes(field: str) -> int | None:
    """A size that /proc/self/status reports for this process (RssAnon, VmData, VmHWM, ...), in
    bytes; None where the system cannot say."""
    prefix = field.encode() + b":"
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(prefix):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None
