"""What a CPU entry holds: the resident pages of its own tensors (``resident_bytes_of``), or,
for a bucket built by Dynamo, the process's resident anonymous memory read before and after its
build (``resident_bytes``).

Resident memory (Linux's RssAnon, and the pages ``mincore`` reports) is what a container's
memory limit and the out-of-memory killer count: pages that have been written to. Chosen over
the C library's heap in use, which counts address space that was reserved but never touched
(MKL packs each Linear weight of a frozen graph into a buffer several times the weight's size
and writes a small part of it; docs/budgets.md has the figures). Chosen over torch's CPU
allocator statistics, which are off unless enabled. Files mapped into memory (loaded
libraries, compiled kernels) are not anonymous and are not counted.

The process's figure is made an entry's as far as it can be:
- Before and after the build the garbage collector runs and the heap's free pages are given back
  (``return_free_memory``): what the build freed, and what entries evicted earlier freed, leave
  the figure. glibc otherwise keeps them resident: it raises its mmap threshold to the largest
  block freed, so after the first large frees, tensors come from the heap and their pages stay
  on free.
- The compiler's one-time start-up (its modules, caches and runtime) happens before the first
  measured build, in a build of a small graph (inductor_compiler.warm_up).
Allocations and frees by other threads during a build still move it: the reason a compiled
graph's entry is measured by its own tensors instead. Where /proc/self/status cannot be read
(not Linux), such entries are charged 0 bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap

import torch


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


_PAGE = mmap.PAGESIZE  # mincore's unit: 4 KiB on x86-64, 64 KiB on some aarch64 kernels


def memory_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the memory `tensor` uses: its storage, whole, or oneDNN's opaque
    buffer; None for a tensor without memory of its own (sparse, a wrapper subclass)."""
    try:
        if tensor.is_mkldnn:
            return torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def memory_ranges(tensors) -> dict[int, int]:
    """address -> bytes of the distinct memory `tensors` use (views of one storage count once)."""
    return dict(filter(None, map(memory_of, tensors)))


def resident_bytes_of(tensors) -> int:
    """Bytes of the memory of `tensors` (CPU; strided or oneDNN's opaque layout) resident now,
    each page once: what they hold whatever other threads allocate or free meanwhile. A page
    reserved but never written is not counted, as RssAnon does not count it. Where the system
    cannot say (no mincore), their whole size."""
    ranges = memory_ranges(tensors)
    mincore = _libc_function("mincore", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    if mincore is None:
        return sum(ranges.values())
    resident: set[int] = set()
    for start, nbytes in ranges.items():
        if not start or nbytes <= 0:
            continue
        first, end = start // _PAGE, -(-(start + nbytes) // _PAGE)
        pages = ctypes.create_string_buffer(end - first)
        if mincore(first * _PAGE, (end - first) * _PAGE, pages) != 0:
            resident.update(range(first, end))  # cannot say: the whole range
            continue
        resident.update(first + i for i, flags in enumerate(pages.raw) if flags & 1)
    return len(resident) * _PAGE
