"""Bucket policies: which sizes of an argument's dimension share one compiled entry.

``buckets`` maps an argument (by name, or by position as an int) to a dict from dimension
(negative counts from the end) to a policy::

    @sc.cached(buckets={"x": {0: sc.power_of_two()}})          # batch 3 runs as batch 4
    @sc.cached(buckets={"sample": {-2: sc.multiple_of(8), -1: sc.multiple_of(8)}})

Dimensions without a policy are exact. A padded argument is zero-padded at the end of each
bucketed dimension, and every output tensor is cropped to the size the plain call would give
it: ``call_on_fake_tensors`` finds those sizes by running the function on fake tensors, once per
distinct sizes of the padded dimensions (``csrc/cache/call_key.h``). A function that cannot
run on fake tensors (sizes that depend on values, operators without a fake kernel) is never
guessed at: its calls that need padding run uncached, with one warning.
Padding the batch dimension keeps each sample's values for models whose samples do not
interact (any inference model without batch statistics), up to rounding: the larger batch may
run other kernels (docs/buckets.md gives the tolerance). Padding spatial dimensions changes outputs
near the border for convolutions and attention: use it only where that is acceptable.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping

from shapecache import _checks
from shapecache._extension import _C

__all__ = ["exact", "multiple_of", "one_of", "power_of_two"]

BucketPolicy = _C.BucketPolicy


def call_on_fake_tensors(function: Callable, args: tuple, kwargs: dict):
    """What `function(*args, **kwargs)` returns when run on fake tensors of the arguments'
    sizes: outputs with the plain call's sizes, nothing computed (the cache reads their sizes
    as it walks outputs). Raises what the fake run raises."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map_only

    # Autocast caches the casts of real weights it makes; made here, they would be fake, and
    # every later call in the caller's autocast region would get them back.
    cache_casts = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # weights stay real, read as fakes
            # FakeTensorMode's operator cache is one dict for the process (a class attribute),
            # never emptied: a run per new padded size would grow it without bound.
            mode.cache_enabled = False
            fake_args, fake_kwargs = tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            return function(*fake_args, **fake_kwargs)
    finally:
        torch.set_autocast_cache_enabled(cache_casts)


def exact() -> BucketPolicy:
    """Every size is its own bucket (the default)."""
    return BucketPolicy.exact()


def multiple_of(n: int) -> BucketPolicy:
    """Sizes round up to the next multiple of `n`."""
    _checks.positive_int("multiple_of(n)", n)
    return BucketPolicy.multiple_of(n)


def power_of_two(minimum: int = 1) -> BucketPolicy:
    """Sizes round up to the next power of two, at least `minimum`."""
    _checks.positive_int("power_of_two(minimum)", minimum)
    return BucketPolicy.power_of_two(minimum)


def one_of(bucket_sizes) -> BucketPolicy:
    """Sizes round up to the next of `bucket_sizes`; a size above the largest is an error."""
    if isinstance(bucket_sizes, (str, bytes)) or not isinstance(bucket_sizes, Iterable):
        raise TypeError(f"one_of(bucket_sizes={bucket_sizes!r}): expected a list of positive ints such as "
                        "[512, 768, 1024]")
    values = list(bucket_sizes)
    for index, v in enumerate(values):
        _checks.positive_int(f"one_of(...)[{index}]", v)
    return BucketPolicy.one_of(values)


def positional_parameter_names(function: Callable, *, skip_first: bool = False) -> list[str]:
    """Names of `function`'s positional parameters, for messages (empty if unknown)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return []
    if skip_first:
        parameters = parameters[1:]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def check_buckets(buckets) -> None:
    """A TypeError unless `buckets` is None or a mapping (its items are checked per function)."""
    if buckets is not None and not isinstance(buckets, Mapping):
        raise TypeError(
            f"buckets={buckets!r}: expected a dict mapping an argument name or position to "
            "{dimension: policy}, e.g. {'x': {0: shapecache.power_of_two()}}"
        )


def resolve_buckets(function: Callable, buckets, *, skip_first: bool = False) -> list:
    """`buckets` as the core's per-argument policies, each addressed by position and name."""
    if buckets is None:
        return []
    check_buckets(buckets)
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        parameters = None
    if parameters is not None and skip_first:
        parameters = parameters[1:]

    resolved = []
    for argument, dims in buckets.items():
        position, name = _address(argument, parameters)
        if not isinstance(dims, Mapping) or not dims:
            raise TypeError(
                f"buckets[{argument!r}]={dims!r}: expected a non-empty dict mapping a dimension (int) "
                "to a policy (shapecache.multiple_of(n), power_of_two(), one_of([...]), exact())"
            )
        pairs = []
        for dim, policy in dims.items():
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise TypeError(f"buckets[{argument!r}]: dimension {dim!r} is not an int")
            if not isinstance(policy, BucketPolicy):
                raise TypeError(
                    f"buckets[{argument!r}][{dim}]={policy!r}: expected a policy from shapecache.multiple_of(n), "
                    "power_of_two(), one_of([...]) or exact()"
                )
            pairs.append((dim, policy))
        resolved.append(_C.ArgumentBuckets(position, name, pairs))
    return resolved


def _address(argument, parameters) -> tuple[int, str]:
    """(position or -1, keyword name or '') of a bucketed argument."""
    if isinstance(argument, bool) or not isinstance(argument, (int, str)):
        raise TypeError(f"buckets: key {argument!r} must be an argument name (str) or position (int)")
    if parameters is None:
        return (argument, "") if isinstance(argument, int) else (-1, argument)
    P = inspect.Parameter
    positional = [p for p in parameters if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    if isinstance(argument, int):
        if not 0 <= argument < len(positional):
            if any(p.kind == P.VAR_POSITIONAL for p in parameters) and argument >= 0:
                return argument, ""
            raise ValueError(
                f"buckets: position {argument} is out of range; the function takes "
                f"{len(positional)} positional argument(s): {[p.name for p in positional]}"
            )
        p = positional[argument]
        return argument, "" if p.kind == P.POSITIONAL_ONLY else p.name
    for index, p in enumerate(parameters):
        if p.name == argument and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY):
            return (index if p.kind == P.POSITIONAL_OR_KEYWORD else -1), argument
    if any(p.kind == P.VAR_KEYWORD for p in parameters):
        return -1, argument
    names = [p.name for p in parameters if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    raise ValueError(f"buckets: the function has no argument {argument!r}; its arguments are {names}")
