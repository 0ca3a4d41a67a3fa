"""The builders' interface: what a builder is, gets besides the call and returns, and the
registry of builders by backend name. The leaf of the backends, imported by each of them (and
by nothing they import)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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


class Builder:
    """How one backend builds a bucket's entry: a subclass per backend, registered under its
    name (``@register``). The cache calls ``build`` on each miss of that backend's buckets.

    `handle` (``_C.BuildHandle``) is the build's only way into the cache: its device, whether
    to run the call, the call's tensors in key order, and the shared bytes it may charge.
    Inline (``handle.run_call``) the builder runs the call and returns its output in the
    entry; in the background the call has run already, uncached, and it only builds, running
    nothing that would repeat the call's effects. `asked` is the backend the user asked for
    ("auto" keeps a graph only where it is faster)."""

    name: ClassVar[str]

    def build(self, function, args: tuple, kwargs: dict, handle, context: BuildContext, asked: str) -> BuiltEntry:
        raise NotImplementedError


def not_built(function, args, kwargs, reason: str, *, run_call: bool = True) -> BuiltEntry:
    """No entry, and why (the bucket then runs uncached); inline, the plain call's result."""
    output = function(*args, **kwargs) if run_call else None
    return BuiltEntry(runner=None, bytes=0, output=output, backend="uncached", failure=reason, ran_call=run_call)


BUILDERS: dict[str, Builder] = {}  # backend name -> its builder


def register(cls: type[Builder]) -> type[Builder]:
    """Class decorator: `cls` builds the entries of backend ``cls.name``."""
    if cls.name in BUILDERS:
        raise ValueError(f"a builder for backend {cls.name!r} is registered already: {type(BUILDERS[cls.name]).__name__}")
    BUILDERS[cls.name] = cls()
    return cls
