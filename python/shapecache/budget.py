"""Budgets: how many bytes a cache may hold on each device.

A budget is given as
- an int: bytes;
- a string: a number with a unit, ``"512MiB"``, ``"20GiB"``, ``"1.5GB"``, ``"4096"`` (bytes),
  a percentage of the device's memory, ``"80%"``, or a fraction of it, ``"0.8"`` (as the float);
- a float in (0, 1]: that fraction of the device's total memory (CUDA: the card's memory;
  CPU: physical RAM), resolved the first time the cache sees the device;
- None: ``SHAPECACHE_BUDGET`` if set, else half of the device's memory.

Everything the cache holds on a device counts against it: its entries, the shared graph pool
and the convolution workspace. Memory the model holds without the cache (weights, the
activations of uncached calls) does not.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shapecache._checks import INT64_MAX

if TYPE_CHECKING:  # parsing needs no torch: the pytest plugin checks budgets without loading it
    import torch

__all__ = ["Budget", "parse_budget"]

DEFAULT_FRACTION = 0.5

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")
_ACCEPTED = (
    "an int number of bytes, a string such as '512MiB', '20GiB', '1.5GB' or '80%', "
    "or a float fraction of the device's memory in (0, 1]"
)


@dataclass(frozen=True)
class Budget:
    """A parsed budget: exactly one of `bytes` and `fraction` is set."""

    bytes: int | None = None
    fraction: float | None = None

    def bytes_for(self, device: torch.device) -> int:
        """The byte budget on `device`. The meta device holds no memory: any fraction of it is
        no limit."""
        if self.bytes is not None:
            return self.bytes
        if device.type == "meta":
            return INT64_MAX
        return int(self.fraction * device_memory_bytes(device))

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        return f"{self.fraction:.0%} of device memory"


def parse_budget(value, *, argument: str = "budget") -> Budget:
    """Parses a budget (see the module's docstring); raises ValueError/TypeError naming `argument`."""
    if value is None:
        from_env = os.environ.get("SHAPECACHE_BUDGET")
        if from_env:
            return parse_budget(from_env, argument="SHAPECACHE_BUDGET")
        return Budget(fraction=DEFAULT_FRACTION)
    if isinstance(value, bool):
        raise TypeError(f"{argument}={value!r}: expected {_ACCEPTED}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{argument}={value!r}: a byte budget must be >= 0; expected {_ACCEPTED}")
        if value > INT64_MAX:
            raise ValueError(f"{argument}={value!r}: a byte budget must be at most 2**63 - 1; expected {_ACCEPTED}")
        return Budget(bytes=value)
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(
                f"{argument}={value!r}: a float budget is a fraction of the device's memory in (0, 1]; "
                f"for bytes pass an int or a string such as '20GiB'"
            )
        return Budget(fraction=value)
    if isinstance(value, str):
        percent = _PERCENT.match(value)
        if percent:
            fraction = float(percent.group(1)) / 100.0
            if not 0.0 < fraction <= 1.0:
                raise ValueError(f"{argument}={value!r}: a percentage of the device's memory must be in (0%, 100%]")
            return Budget(fraction=fraction)
        size = _SIZE.match(value)
        if size and size.group(2).lower() in _UNITS:
            unit = _UNITS[size.group(2).lower()]
            number = float(size.group(1))
            if unit == 1 and "." in size.group(1):
                # Half a byte means nothing: "0.5" (from a command line, say) is the float 0.5.
                if not 0.0 < number <= 1.0:
                    raise ValueError(
                        f"{argument}={value!r}: a number with a decimal point and no unit is a fraction of the "
                        f"device's memory, in (0, 1]; for bytes give a whole number or a unit such as '{value}GiB'"
                    )
                return Budget(fraction=number)
            return parse_budget(int(number * unit), argument=argument)
        raise ValueError(f"{argument}={value!r}: cannot read this size; expected {_ACCEPTED}")
    raise TypeError(f"{argument}={value!r} (type {type(value).__name__}): expected {_ACCEPTED}")


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of `device`: the card's memory for CUDA, physical RAM for the CPU."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    raise ValueError(
        f"budget: a fraction of the memory of a {device.type!r} device cannot be resolved; "
        f"give the budget in bytes (an int or a string such as '8GiB')"
    )


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
