"""Memory figures of a device, and a monitor that records them step by step.

On CUDA: the caching allocator's allocated, reserved and peak-allocated bytes. On the CPU:
the process's resident memory (allocated and reserved alike) and its peak resident size, so
that the same tests and scenarios run, with real numbers, where there is no GPU. A monitor
counts the peak from its own start (reset_peak), not from the process's.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass

import torch

from shapecache.budget import format_bytes, parse_budget

__all__ = ["MemoryFigures", "VramMonitor", "memory_figures", "reset_peak"]


@dataclass(frozen=True)
class MemoryFigures:
    allocated: int
    reserved: int
    peak: int

    def as_dict(self) -> dict:
        return asdict(self)


def memory_figures(device) -> MemoryFigures:
    device = torch.device(device)
    if device.type == "cuda":
        return MemoryFigures(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                             torch.cuda.max_memory_allocated(device))
    if device.type == "cpu":
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return MemoryFigures(resident, resident, max(resident, _peak_resident()))
    raise ValueError(f"device={device!r}: memory figures are read on 'cuda' and 'cpu' devices")


def reset_peak(device) -> bool:
    """Starts the device's peak figure anew from what is held now; False where it cannot be
    (the CPU's peak then stays the process's since its start)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:  # Linux: writing 5 to clear_refs resets the peak resident size (VmHWM) to the current one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_resident() -> int:
    """VmHWM, the peak resident size since the process started or reset_peak; ru_maxrss where
    /proc cannot be read."""
    from shapecache._host_memory import process_status_bytes

    peak = process_status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class VramMonitor:
    """Records memory figures at each step of a test and checks them against a ceiling.

        def test_loop(vram_monitor):
            for size in sizes:
                run(size)
                vram_monitor.record(f"{size}")
            vram_monitor.assert_below("20GiB")
    """

    def __init__(self, device=None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        reset_peak(self.device)  # the peak of this monitor's steps, not of what ran before it
        self.steps: list[dict] = []

    def record(self, label=None) -> MemoryFigures:
        """Reads the figures now and keeps them under `label` (default: the step number)."""
        figures = memory_figures(self.device)
        self.steps.append({"step": label if label is not None else len(self.steps), **figures.as_dict()})
        return figures

    def peak(self, figure: str = "peak") -> int:
        return max((s[figure] for s in self.steps), default=0)

    def assert_below(self, ceiling, figure: str = "peak") -> None:
        """Fails, with the table of steps, if any recorded `figure` exceeds `ceiling`."""
        if figure not in ("allocated", "reserved", "peak"):
            raise ValueError(f"figure={figure!r}: expected 'allocated', 'reserved' or 'peak'")
        limit = parse_budget(ceiling, argument="ceiling")
        limit_bytes = limit.bytes_for(self.device)
        over = [s for s in self.steps if s[figure] > limit_bytes]
        if over:
            raise AssertionError(
                f"{figure} memory on {self.device} went above {format_bytes(limit_bytes)} at step(s) "
                f"{[s['step'] for s in over]}:\n{self.table()}"
            )

    def table(self) -> str:
        lines = [f"{'step':>12} {'allocated':>12} {'reserved':>12} {'peak':>12}"]
        for s in self.steps:
            lines.append(f"{str(s['step']):>12} {format_bytes(s['allocated']):>12} {format_bytes(s['reserved']):>12} "
                         f"{format_bytes(s['peak']):>12}")
        return "\n".join(lines)
