"""How often one miss enters the C++ core from Python: every function, method, constructor and
property of ``shapecache._C`` called while a cached function builds a new bucket inline.

    python benchmarks/seam_crossings.py [--backend compile eager]

A first miss loads the compiler; the second, at another shape, is the one counted. A call is
counted by wrapping each member of ``_C``'s classes and each of its functions before the
cache is made (the C++ core's own calls into Python are not crossings of this kind). Exits
non-zero when a backend asked for could not build its entry.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import types

import torch

import shapecache as sc
from shapecache._extension import _C

_counting = False
_counts: collections.Counter = collections.Counter()


def _counted(name, member):
    @functools.wraps(member)
    def wrapper(*args, **kwargs):
        if _counting:
            _counts[name] += 1
        return member(*args, **kwargs)

    return wrapper


def _counted_property(name, prop):
    def get(obj):
        if _counting:
            _counts[name] += 1
        return prop.__get__(obj, type(obj))

    return property(get, prop.fset)


def instrument() -> None:
    """Every call into _C from here on goes through a counter."""
    for attr, value in list(vars(_C).items()):
        if isinstance(value, type):
            for name, member in list(vars(value).items()):
                if name != "__init__" and name.startswith("_"):
                    continue
                if isinstance(member, property):
                    setattr(value, name, _counted_property(f"{attr}.{name}", member))
                elif callable(member):
                    setattr(value, name, _counted(f"{attr}.{name}", member))
        elif callable(value) and not isinstance(value, types.ModuleType):
            setattr(_C, attr, _counted(attr, value))


def one_miss(backend: str) -> tuple[collections.Counter, str]:
    global _counting
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()).eval()
    cached = sc.cached(model, backend=backend)
    with torch.no_grad():
        cached(torch.randn(1, 3, 16, 16))  # the compiler's imports and first-use costs
        _counts.clear()
        _counting = True
        try:
            cached(torch.randn(1, 3, 40, 40))
        finally:
            _counting = False
    entries = sc.stats(cached)["entries"]
    built = entries[0]["backend"] if len(entries) == 2 else "nothing"
    sc.uncached(cached)
    return collections.Counter(_counts), built


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", nargs="+", default=["compile", "eager"], choices=["compile", "eager"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    instrument()
    failed = []
    print(f"{'backend':<10} {'entries into _C':>16}  by member")
    for backend in args.backend:
        counts, built = one_miss(backend)
        if built != backend:
            failed.append(f"{backend} built {built}")
        detail = ", ".join(f"{name} x{n}" for name, n in counts.most_common())
        print(f"{backend:<10} {sum(counts.values()):>16}  {detail}")
    if failed:
        print("no entry built: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
