"""The on-disk caches of compiled graphs, as seen from this process: whether a build was read
from inductor's FX graph cache ("warm"), compiled and written to it ("cold"), not cacheable
there ("not cached"), compiled by the compiler's process ("compiled in the compiler's process",
compile_process.py), or loaded as a package from the shared directory ("shared package",
package_store.py; "shared package, not traced" where the call index named it: call_index.py)."""

from __future__ import annotations

import sys

_shared_packages_loaded = [0]  # packages this process loaded from the shared directory (under the build lock)
_untraced = [0]  # ... of those, found through the call index, without a trace
_compiled_by_the_process = [0]  # packages the compiler's process compiled for this one (under the build lock)


def note_shared_package_loaded() -> None:
    _shared_packages_loaded[0] += 1


def note_traced_nothing() -> None:
    """The package just loaded was found through the call index: nothing was traced."""
    _untraced[0] += 1


def note_compiled_by_the_compiler_process() -> None:
    _compiled_by_the_process[0] += 1


def disk_cache_counts() -> tuple[int, int, int, int, int, int]:
    """Inductor's FX graph cache so far in this process: (hits, misses, bypasses), then the
    packages loaded from the shared directory, of those the ones found without a trace, and the
    packages the compiler's process compiled (its FX graph cache is its own).
    A build that adds a hit was read from the on-disk cache ("warm"); a miss compiled and wrote
    it ("cold"). Before anything compiled, torch._dynamo is not loaded, and inductor's counts
    are zero."""
    loaded, untraced, elsewhere = _shared_packages_loaded[0], _untraced[0], _compiled_by_the_process[0]
    if "torch._dynamo.utils" not in sys.modules:  # (imported by the first compile; not imported here for a count)
        return 0, 0, 0, loaded, untraced, elsewhere
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return (inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"], inductor["fxgraph_cache_bypass"], loaded,
            untraced, elsewhere)


def disk_cache_state(before: tuple[int, int, int, int, int, int]) -> str | None:
    """"warm", "cold", "not cached", "compiled in the compiler's process", "shared package" or
    "shared package, not traced" for the builds since `disk_cache_counts()` was `before` (the
    first that applies); None when nothing was compiled or loaded meanwhile."""
    hits, misses, bypasses, loaded, untraced, elsewhere = (now - then for now, then in zip(disk_cache_counts(), before,
                                                                                              strict=True))
    if misses:
        return "cold"
    if hits:
        return "warm"
    if bypasses:
        return "not cached"
    if elsewhere:
        return "compiled in the compiler's process"
    if untraced == loaded and loaded:
        return "shared package, not traced"
    return "shared package" if loaded else None
