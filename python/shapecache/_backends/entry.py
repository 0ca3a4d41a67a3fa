"""The builders' interface: what a builder is, gets besides the call and returns, and the
registry of builders by backend name. The leaf of the backends, imported by each of them (and
by nothing they import)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shapecache._extension import _C


@dataclass(frozen=True)
class BuiltEntry:
    """What a builder returns for a new bucket: a plain object, read by the cache once the
    builder has returned, which makes the entry's runner and guard from it
    (csrc/cache/built_entry.h)."""

    # Serves the bucket's later calls, called as the plain function is (owner first). None:
    # the entry is a `graph` or an `entry_runner`, or nothing was built (`failure`).
    runner: Callable | None
    bytes: int  # device memory the entry holds beyond what the uncached call leaves behind
    output: Any = None  # the call's result, when the builder ran the call (`ran_call`)
    backend: str = "eager"  # what built it: "eager", "compile", "cuda_graph", ...
    # What the entry depends on: a guards.GuardRecord (guards.record), made into its guard when
    # the cache reads this; None: nothing that can change.
    guard: Any = None
    failure: str = ""  # with no runner, graph or entry_runner: why, for the warning
    # False: the builder did not run the call (an eager entry, a compiled graph, any build in
    # the background); inline, the cache runs the new entry for the result.
    ran_call: bool = True
    # Instead of `runner`: a graph over the call's tensors in key order (BuildHandle.tensors),
    # which returns the output's tensors; `rebuild(tensors)` puts them back into the output's
    # structure (None: the output is the graph's one tensor).
    graph: Callable | None = None
    rebuild: Callable | None = None
    # A _C.StateGuard over the live state the build started from: if it no longer holds when
    # the cache reads this, the entry starts stale and is rebuilt on its next call.
    built_from: Any = None
    # Instead of `runner`: a runner made in C++ already (a _C.CudaGraphRunner), which holds its
    # own guard (`guard` and `built_from` are None then).
    entry_runner: Any = None
    # Once the entry is in, the device's worker builds the bucket's upgrade, which replaces it
    # where it is faster (upgrade.py; csrc/cache/miss_policy.h, the Upgrade rule).
    upgrade: bool = False

@dataclass(frozen=True)
class BuildContext:
    """How the cached function's calls are spelled, and the options of its builds."""

    has_owner: bool  # the call's first argument is the module a method belongs to
    parameter_names: tuple  # positional parameter names (without the owner), as keys use them
    compile_options: dict
    upgrade: bool = False  # backend "auto": each bucket's entry is upgraded where it pays (upgrade.py)
    # The compilers that failed a kind of its graphs for good, (name, kind) -> why (compilers.
    # Route.failures): the only state of its builds kept between them, so that a compile that
    # fails for a graph is not tried again at each of its sizes.
    failed_compilers: dict = field(default_factory=dict, compare=False)


class Builder:
    """How one backend builds a bucket's entry: a subclass per backend, registered under its
    name (``@register``). The cache calls ``build`` on each miss of that backend's buckets.

    `handle` (``_C.BuildHandle``) is the build's only way into the cache: its device, whether
    to run the call, the call's tensors in key order, and the shared bytes it may charge.
    Inline (``handle.run_call``) the builder runs the call and returns its output in the
    entry; in the background the call has run already, uncached, and it only builds, running
    nothing that would repeat the call's effects. `asked` is the backend the user asked for
    ("auto" keeps a graph only where it is faster). An upgrade's build (``handle.upgrading``
    set) is upgrade.py's, not a backend's."""

    name: ClassVar[str]

    def build(self, function, args: tuple, kwargs: dict, handle, context: BuildContext, asked: str) -> BuiltEntry:
        raise NotImplementedError


def not_built(function, args, kwargs, reason: str, *, run_call: bool = True) -> BuiltEntry:
    """No entry, and why (the bucket then runs uncached); inline, the plain call's result."""
    output = _C.run_user_code(function, tuple(args), dict(kwargs)) if run_call else None
    return BuiltEntry(runner=None, bytes=0, output=output, backend="uncached", failure=reason, ran_call=run_call)


def described(error: BaseException) -> str:
    """An error in a line: its type's name and its message's first line, as warnings name it."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


BUILDERS: dict[str, Builder] = {}  # backend name -> its builder


def register(cls: type[Builder]) -> type[Builder]:
    """Class decorator: `cls` builds the entries of backend ``cls.name``."""
    if cls.name in BUILDERS:
        raise ValueError(f"a builder for backend {cls.name!r} is registered already: {type(BUILDERS[cls.name]).__name__}")
    BUILDERS[cls.name] = cls()
    return cls
