"""The code a build ran, so that the globals it read are guarded (guards.py).

A forward reads module-level state through the functions it calls: a flag read by a helper,
a table a block looks up. Neither the module trees nor the cached function's own code show
them; the code that ran does. While a build traces or warms up a call, a profile function on
the building thread records each code object that starts, with its module's globals, once.
The libraries' own code (torch, the standard library, shapecache) is left out: what it reads
at module level is its configuration, which a build does not bake in as a user's flag would;
so is code generated at run time (a namedtuple's methods, an FX graph's forward), whose
globals are no module's.

The profile function is per thread (``sys.setprofile``): other threads, serving calls
meanwhile, are not slowed. A Python profile function already set on the thread is called on
from it, so it sees the build as before. A profiler set from C (cProfile) cannot be called
from Python nor set back from it: under one, nothing is recorded (profiling a build is not
serving).
"""

from __future__ import annotations

import contextlib
import sys

# Top-level packages whose code is not recorded.
LIBRARIES = frozenset(sys.stdlib_module_names) | frozenset(
    {"torch", "functorch", "shapecache", "sympy", "numpy", "triton", "optree", "typing_extensions", "_pytest",
     "pluggy", "hypothesis"})


@contextlib.contextmanager
def recording_calls():
    """Yields a dict, filled until the block ends: code object -> the globals of the module
    it belongs to, for each code object of user code that started on this thread."""
    calls: dict = {}
    seen: set = set()
    previous = sys.getprofile()
    if previous is not None and not callable(previous):
        yield calls
        return

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code not in seen:
                seen.add(code)
                module_globals = frame.f_globals
                if _is_users_module(module_globals):
                    calls[code] = module_globals
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


def _is_users_module(module_globals: dict) -> bool:
    """Whether these globals are an imported module's (not code generated at run time, such as
    a namedtuple's methods or an FX graph's forward) and not a library's."""
    name = module_globals.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    return getattr(module, "__dict__", None) is module_globals and name.partition(".")[0] not in LIBRARIES
