"""``CacheHolder``: what shapecache did to an object, kept on it as ``obj._shapecache``
(a cached module's, a wrapped pipeline's) or returned as a handle (``tune_convs``'s), with
how to read its stats, drop its entries and undo it. ``sc.stats``, ``sc.clear`` and
``sc.uncached`` read nothing else."""

from __future__ import annotations

HOLDER = "_shapecache"  # the attribute of a cached module or wrapped pipeline that holds it


class CacheHolder:
    def stats(self) -> dict:
        raise TypeError(f"stats: a {type(self).__name__} keeps no cache entries")

    def clear(self) -> None:
        raise TypeError(f"clear: a {type(self).__name__} keeps no cache entries")

    def dispatchers(self) -> list:
        """The cached functions (``_C.ShapeDispatcher``) whose background builds ``sc.wait`` waits for."""
        raise TypeError(f"wait: a {type(self).__name__} builds nothing")

    def uncache(self):
        """Undoes what was done; returns the object as it was before."""
        raise NotImplementedError


def holder_on(obj) -> CacheHolder | None:
    """The holder kept on `obj`, if any."""
    holder = getattr(obj, "__dict__", {}).get(HOLDER)
    return holder if isinstance(holder, CacheHolder) else None
