"""A request's size, read from its keyword arguments the same way by the router (to route it)
and the replica (to say what it holds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

PIPELINE_SIZE_KEYS = ("height", "width")  # what a diffusers pipeline is called with
MAX_SIDE = 1 << 16  # the largest side of a size a request can have
MAX_DIMENSIONS = 8  # the most numbers a size has


def check_size_keys(size_keys) -> tuple[str, ...]:
    """`size_keys` as a tuple of keyword names, or a clear error."""
    keys = (size_keys,) if isinstance(size_keys, str) else size_keys
    if (not isinstance(keys, Sequence) or not keys or len(keys) > 4
            or not all(isinstance(k, str) and k.isidentifier() for k in keys)):
        raise ValueError(f"size_keys={size_keys!r}: expected a keyword name or a tuple of 1 to 4 names, "
                         f"e.g. {PIPELINE_SIZE_KEYS!r} for a pipeline's height and width")
    return tuple(keys)


def request_size(kwargs: Mapping, size_keys: tuple[str, ...]) -> tuple[int, ...] | None:
    """The size of a call: the integers under `size_keys`, in order. With one key, its value
    may also be a sequence of integers (``size=(768, 512)``). None when a key is missing or a
    value is not an integer from 1 to MAX_SIDE (or there are more than MAX_DIMENSIONS): such a
    request has no size."""
    if len(size_keys) == 1:
        value = kwargs.get(size_keys[0])
        values = value if isinstance(value, Sequence) and not isinstance(value, str) else (value,)
    else:
        values = tuple(kwargs.get(key) for key in size_keys)
    if not 0 < len(values) <= MAX_DIMENSIONS or not all(
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SIDE for v in values):
        return None
    return tuple(values)


def check_size(size, keys: int) -> tuple[int, ...]:
    """`size` as given to ``CachedReplica.serving``: a tuple of integers from 1 to MAX_SIDE (one
    per size key where there are several), or a TypeError that says so."""
    values = size if isinstance(size, Sequence) and not isinstance(size, str) else None
    try:
        ok = values is not None and 0 < len(values) <= MAX_DIMENSIONS and all(
            int(v) == v and not isinstance(v, bool) and 1 <= v <= MAX_SIDE for v in values)
    except (TypeError, ValueError, OverflowError):  # (int(inf) overflows)
        ok = False
    if not ok or (keys > 1 and len(values) != keys):
        expected = f"{keys} integers, one per size key" if keys > 1 else "a sequence of integers"
        raise TypeError(f"size={size!r}: expected {expected}, each from 1 to {MAX_SIDE}, e.g. (768, 512)")
    return tuple(int(v) for v in values)
