"""A request's size, read from its keyword arguments the same way by the router (to route it)
and the replica (to say what it holds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

PIPELINE_SIZE_KEYS = ("height", "width")  # what a diffusers pipeline is called with


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
    value is not an integer: such a request has no size."""
    if len(size_keys) == 1:
        value = kwargs.get(size_keys[0])
        values = value if isinstance(value, Sequence) and not isinstance(value, str) else (value,)
    else:
        values = tuple(kwargs.get(key) for key in size_keys)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    return tuple(values)
