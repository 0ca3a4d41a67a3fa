"""What a builder gets besides the call and returns: the leaf of the backends, imported by
each of them (and by nothing they import)."""

from __future__ import annotations

from dataclasses import dataclass

from shapecache._extension import _C

# Returned by every builder: runner, bytes, output, backend, guard, failure, ran_call
# (csrc/cache/built_entry.h).
BuiltEntry = _C.BuiltEntry


@dataclass(frozen=True)
class BuildContext:
    """How the cached function's calls are spelled, and the options of its builds."""

    has_owner: bool  # the call's first argument is the module a method belongs to
    parameter_names: tuple  # positional parameter names (without the owner), as keys use them
    compile_options: dict
