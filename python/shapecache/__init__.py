"""shapecache: compiled PyTorch models at many input shapes under a memory budget.

    import shapecache as sc

    @sc.cached(budget="8GiB")
    def forward(x): ...

    unet = sc.cached(unet, budget=0.8)
    sc.stats(unet)

Importing the package loads nothing: torch and the C++ extension load on the first use of a
name below (so that, for instance, the pytest plugin costs test sessions nothing).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from shapecache._version import __version__ as __version__

# Public name -> the module that defines it. No module is named like a name it defines: importing
# a submodule sets the package's attribute of that name, which would hide the name.
_PUBLIC = {
    "Budget": "shapecache.budget",
    "parse_budget": "shapecache.budget",
    "exact": "shapecache.buckets",
    "multiple_of": "shapecache.buckets",
    "one_of": "shapecache.buckets",
    "power_of_two": "shapecache.buckets",
    "CachedFunction": "shapecache.cache",
    "cached": "shapecache.cache",
    "clear": "shapecache.cache",
    "stats": "shapecache.cache",
    "uncached": "shapecache.cache",
    "wait": "shapecache.cache",
    "CacheStats": "shapecache.statistics",
    "DeviceStats": "shapecache.statistics",
    "EntryStats": "shapecache.statistics",
    "PipelineStats": "shapecache.statistics",
    "TunedConvs": "shapecache.ops",
    "TuningDb": "shapecache.ops",
    "tune_convs": "shapecache.ops",
    "encode_prompts": "shapecache.diffusers",
    "prewarm": "shapecache.diffusers",
    "wrap": "shapecache.diffusers",
}
_SUBPACKAGES = ("buckets", "budget", "cache", "diffusers", "ops", "scenarios", "statistics", "testing")

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name == "_C":  # the extension, loaded after torch and checked (see _extension.py)
        value = importlib.import_module("shapecache._extension")._C
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"shapecache.{name}")
    else:
        raise AttributeError(f"module 'shapecache' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_SUBPACKAGES})


if TYPE_CHECKING:  # what __getattr__ gives, for type checkers and editors
    from shapecache.buckets import exact, multiple_of, one_of, power_of_two  # noqa: F401
    from shapecache.budget import Budget, parse_budget  # noqa: F401
    from shapecache.cache import CachedFunction, cached, clear, stats, uncached, wait  # noqa: F401
    from shapecache.diffusers import encode_prompts, prewarm, wrap  # noqa: F401
    from shapecache.ops import TunedConvs, TuningDb, tune_convs  # noqa: F401
    from shapecache.statistics import CacheStats, DeviceStats, EntryStats, PipelineStats  # noqa: F401
