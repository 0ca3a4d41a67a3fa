"""shapecache: compiled PyTorch models at many input shapes under a memory budget.

    import shapecache as sc

    @sc.cached(budget="8GiB")
    def forward(x): ...

    unet = sc.cached(unet, budget=0.8)
    sc.stats(unet)
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from shapecache import _C  # noqa: F401
from shapecache import ops  # noqa: F401  (fake and autograd registrations of the C++ ops)
from shapecache import weights  # noqa: F401  (module registration hooks for stale-weight checks)
from shapecache.budget import Budget, parse_budget
from shapecache.buckets import exact, multiple_of, power_of_two, sizes
from shapecache.cached import CachedFunction, cached, clear, stats, uncached
from shapecache.prompts import encode_prompts
from shapecache.tuning import TunedConvs, TuningDb, tune_convs
from shapecache.wrap import prewarm, unwrap, wrap

__version__ = "0.1.0"

__all__ = [
    "Budget",
    "CachedFunction",
    "TunedConvs",
    "TuningDb",
    "cached",
    "clear",
    "encode_prompts",
    "exact",
    "multiple_of",
    "parse_budget",
    "power_of_two",
    "prewarm",
    "sizes",
    "stats",
    "tune_convs",
    "uncached",
    "unwrap",
    "wrap",
]
