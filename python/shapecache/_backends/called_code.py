"""The code a build ran, so that the globals it read are guarded (guards.py).

A forward reads module-level state through the functions it calls: a flag read by a helper,
a table a block looks up. Neither the module trees nor the cached function's own code show
them; the code that ran does. While a build traces or warms up a call, the building thread
records each code object that starts, with its module's globals, once. The libraries' own
code (torch, the standard library, shapecache) is left out: what it reads at module level is
its configuration, which a build does not bake in as a user's flag would; so is code
generated at run time (a namedtuple's methods, an FX graph's forward), whose globals are no
module's.

How code starting is seen, cheapest first, leaving any debugger, profiler or coverage tool
that watches the process as it was:
- Python 3.12 and later: ``sys.monitoring``'s PY_START event, under a tool id of its own
  (other tools, cProfile among them, keep theirs). A library's code is disabled for the
  event once seen, for good: a trace then pays for the user's code alone. The event is
  process-wide while a build records: other threads' calls of user code pay a dictionary
  lookup each.
- Python 3.11: a trace function on the building thread (``sys.settrace``: called when a
  frame starts, not on C calls), where none is set; else a profile function
  (``sys.setprofile``), calling on a Python one already set.
- Where neither is free (a debugger and cProfile both on the building thread, 3.11), nothing
  is recorded and one warning says so: such an entry does not see the globals its callees
  read.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import gc
import sys
import threading
import types
import warnings


def _torchs_requirements() -> frozenset:
    """The modules of the packages torch requires, and those require, as installed (networkx,
    jinja2, filelock, fsspec, sympy...): part of torch's machinery, whose module-level tables
    fill lazily as a first trace uses them. Named as their distributions are, which is their
    import name for each of torch's."""
    import importlib.metadata
    import re

    found, waiting = set(), ["torch"]
    while waiting:
        name = waiting.pop().lower().replace("-", "_")
        if name in found:
            continue
        found.add(name)
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        waiting.extend(re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in requirements if "extra ==" not in r)
    return frozenset(found)


# What runs a model, not the model: code of theirs that runs on the building thread during a
# trace (a log handler, a warnings hook, a test runner's capture) reads their own state.
_SERVING = frozenset({"ray", "pytest", "_pytest", "pluggy", "uvicorn", "starlette", "fastapi", "anyio"})
# Top-level packages whose code is not recorded.
LIBRARIES = frozenset(sys.stdlib_module_names) | frozenset(
    {"torch", "functorch", "shapecache", "sympy", "mpmath", "numpy", "triton", "optree", "typing_extensions"}
) | _torchs_requirements() | _SERVING

_MONITORING = getattr(sys, "monitoring", None)
_TOOL_IDS = (3, 4)  # sys.monitoring's ids that no tool named by Python claims

_lock = threading.Lock()
_recording: dict = {}  # thread id -> its Recorded: the threads recording now
_tool: int | None = None
_active = 0  # recordings under way, in any thread
_collecting = threading.local()  # .now: the garbage collector runs on this thread


def _collection_starts(phase: str, _info) -> None:
    if phase == "start":
        _collecting.now = True


def _collection_ends(phase: str, _info) -> None:
    if phase == "stop":
        _collecting.now = False


def _is_collecting() -> bool:
    return getattr(_collecting, "now", False)


_ABSENT = object()


@functools.lru_cache(maxsize=4096)
def global_reads(code) -> dict[str, frozenset]:
    """The globals `code` and the code nested in it (a comprehension, a lambda) load, each
    with the attributes loaded off it right away (``CFG.scale``, ``config_module.SCALE``;
    empty where the global is used whole). Not ``co_names`` whole, which holds attribute
    names too (``self.out`` would make a global ``out`` a dependency)."""
    reads: dict[str, set] = {}
    instructions = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "COPY", "NOP")]
    for i, instruction in enumerate(instructions):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            attributes = reads.setdefault(instruction.argval, set())
            following = instructions[i + 1] if i + 1 < len(instructions) else None
            if following is not None and following.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                attributes.add(following.argval)
            else:
                attributes.add(None)  # used whole
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            for name, attributes in global_reads(constant).items():
                reads.setdefault(name, set()).update(attributes)
    return {name: frozenset(attributes) for name, attributes in reads.items()}


class Recorded:
    """The user code that started on the building thread: `globals` maps each code object to
    its module's globals. What each read (a global, an attribute loaded off one) held when
    the code first started is kept, so that a call that writes state it reads (a helper's
    ``STATS.calls += 1``, which a graph would not write again) is found and undone
    (`put_back`)."""

    def __init__(self):
        self.globals: dict = {}
        self._seen: set = set()
        self._before: list = []  # (path, dict, key, the value it held)
        # The dicts and lists those reads held (a helper's table, a list it appends to), with
        # their items then: the call may write into them without replacing any read.
        self._containers: dict[int, tuple] = {}  # id -> (path, container, its items)

    def reads(self) -> list[tuple[dict, dict]]:
        """(module globals, the globals the code read there: name -> the attributes loaded off
        it, None: used whole), one pair per module, its code's reads merged."""
        merged: dict[int, tuple[dict, dict]] = {}
        for code, module_globals in self.globals.items():
            reads = merged.setdefault(id(module_globals), (module_globals, {}))[1]
            for name, attributes in global_reads(code).items():
                reads[name] = reads.get(name, frozenset()) | attributes
        return list(merged.values())

    def saw(self, code, module_globals: dict) -> None:
        self._seen.add(code)
        if not _is_users_module(module_globals):
            return
        self.globals[code] = module_globals
        module_name = module_globals.get("__name__")
        if _initializing(module_name):
            # Code of a module being imported (torch imports what its first trace needs lazily,
            # a generated module of its own among them) writes the module's globals as it runs:
            # the import's writes, not the call's. Its reads are guarded, not put back; code of
            # the module that starts once its import is done is recorded as any.
            return
        for name, attributes in global_reads(code).items():
            value = module_globals.get(name, _ABSENT)
            self._before.append((f"{module_name}.{name}", module_globals, name, value))
            self._container(f"{module_name}.{name}", value)
            state = getattr(value, "__dict__", None)
            if isinstance(state, dict) and not isinstance(value, type):
                for attribute in attributes - {None}:
                    self._before.append((f"{module_name}.{name}.{attribute}", state, attribute,
                                         state.get(attribute, _ABSENT)))
                    self._container(f"{module_name}.{name}.{attribute}", state.get(attribute))

    def _container(self, path: str, value) -> None:
        """Keeps `value`'s items where it is a dict or list of at most _CONTAINER_ITEMS items."""
        if not isinstance(value, (dict, list)) or id(value) in self._containers:
            return
        if (dict.__len__(value) if isinstance(value, dict) else list.__len__(value)) <= _CONTAINER_ITEMS:
            from shapecache._backends.trace_copies import snapshot

            self._containers[id(value)] = (path, value, snapshot(value))

    def seen(self, code) -> bool:
        return code in self._seen

    def values(self) -> list:
        """What the reads held when the code first started (globals, attributes of globals)."""
        return [value for _, _, _, value in self._before if value is not _ABSENT]

    def put_back(self, keep_writes: bool = False) -> list[str]:
        """Puts back each read whose value the call replaced, and what it wrote into the dicts
        and lists the reads held (a trace leaves nothing of the user's changed); names them,
        less the trace's own leftovers (trace_copies.is_leftover: a library's memo of the fake
        tensor type it saw), which are put back unnamed. A write another thread made meanwhile
        cannot be told from the call's, and is undone with it (trace._apart_from_other_threads
        keeps them apart, or says it could not: then `keep_writes`, and what the call wrote
        stays, but for an object or container that holds a leftover, put back whole)."""
        from shapecache._backends.trace_copies import changed_items, is_leftover, put_back_shared, snapshot

        written, replaced = [], {}
        for path, state, key, value in self._before:
            now = state.get(key, _ABSENT)
            if now is not value:
                replaced.setdefault(id(state), []).append((path, state, key, value, now))
        for changes in replaced.values():
            leftover = any(is_leftover(key, now) for _, _, key, _, now in changes)
            written.extend(path for path, _, key, _, now in changes if not is_leftover(key, now))
            if keep_writes and not leftover:
                continue
            for _, state, key, value, _ in changes:
                if value is _ABSENT:
                    state.pop(key, None)
                else:
                    state[key] = value
        containers = []
        for path, container, before in self._containers.values():
            changes = changed_items(before, snapshot(container))
            if changes:
                containers.append((container, before))
                if not all(is_leftover(key, value) for key, value in changes):
                    written.append(path)
        put_back_shared(containers, None, keep_writes=keep_writes)
        return written


_CONTAINER_ITEMS = 4096  # a dict or list a read holds is kept (Recorded._container) up to this many items


@contextlib.contextmanager
def recording_calls():
    """Yields a Recorded, filled until the block ends with the user code that started on
    this thread."""
    recorded = Recorded()
    with _collections_not_recorded():
        if _MONITORING is not None:
            recorder = _monitoring
        elif sys.gettrace() is None:
            recorder = _tracing
        elif sys.getprofile() is None or callable(sys.getprofile()):
            recorder = _profiling
        else:
            recorder = _not_recording
        with recorder(recorded):
            yield recorded


@contextlib.contextmanager
def _collections_not_recorded():
    """What runs while the garbage collector does (gc.callbacks, weakref callbacks,
    finalizers: a test framework's timing, a library's cache clean-up) is no part of the
    call, and is not recorded: callbacks first and last among gc.callbacks say when a
    collection starts and ends."""
    global _active
    with _lock:
        _active += 1
        if _active == 1:
            gc.callbacks.insert(0, _collection_starts)
            gc.callbacks.append(_collection_ends)
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                gc.callbacks.remove(_collection_starts)
                gc.callbacks.remove(_collection_ends)


@contextlib.contextmanager
def _monitoring(recorded: Recorded):
    global _tool
    thread = threading.get_ident()
    with _lock:
        if _tool is None:
            _tool = next((i for i in _TOOL_IDS if _MONITORING.get_tool(i) is None), None)
            if _tool is None:
                _warn_not_recording("sys.monitoring has no tool id free")
            else:
                _MONITORING.use_tool_id(_tool, "shapecache")
                for event in (_MONITORING.events.PY_START, _MONITORING.events.PY_RESUME):
                    _MONITORING.register_callback(_tool, event, _on_start)
        if _tool is not None:
            _recording[thread] = recorded
            # PY_RESUME too: a generator started before the build and resumed in it
            _MONITORING.set_events(_tool, _MONITORING.events.PY_START | _MONITORING.events.PY_RESUME)
    try:
        yield
    finally:
        with _lock:
            _recording.pop(thread, None)
            if _tool is not None and not _recording:
                _MONITORING.set_events(_tool, 0)


def _on_start(code, _offset):
    if _is_collecting():
        return None
    module_globals = sys._getframe(1).f_globals  # the frame that starts (or resumes)
    if _is_library(module_globals):
        return _MONITORING.DISABLE  # a library's code is never recorded: not seen again, by any thread
    recorded = _recording.get(threading.get_ident())
    if recorded is not None and not recorded.seen(code):
        recorded.saw(code, module_globals)
    return None


@contextlib.contextmanager
def _tracing(recorded: Recorded):
    def trace(frame, event, _arg):
        if not recorded.seen(frame.f_code) and not _is_collecting():
            recorded.saw(frame.f_code, frame.f_globals)
        # None: no tracing of the frame's lines

    sys.settrace(trace)
    try:
        yield
    finally:
        if sys.gettrace() is trace:  # not a debugger's, set during the build (breakpoint())
            sys.settrace(None)


@contextlib.contextmanager
def _profiling(recorded: Recorded):
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event == "call" and not recorded.seen(frame.f_code) and not _is_collecting():
            recorded.saw(frame.f_code, frame.f_globals)
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(profile)
    try:
        yield
    finally:
        if sys.getprofile() is profile:
            sys.setprofile(previous)


@contextlib.contextmanager
def _not_recording(recorded: Recorded):
    _warn_not_recording("a trace function and a profiler set from C are both on the building thread")
    yield


def _warn_not_recording(why: str) -> None:
    warnings.warn(f"shapecache: a build could not record the code it ran ({why}); its entry does not see the "
                  "globals the functions it calls read (call sc.clear after changing them)", RuntimeWarning,
                  stacklevel=4)


def _initializing(module_name: str) -> bool:
    """Whether the module `module_name` is being imported now (importlib marks its spec so
    while its body runs)."""
    return bool(getattr(getattr(sys.modules.get(module_name), "__spec__", None), "_initializing", False))


def _is_library(module_globals: dict) -> bool:
    name = module_globals.get("__name__")
    return isinstance(name, str) and name.partition(".")[0] in LIBRARIES


def _is_users_module(module_globals: dict) -> bool:
    """Whether these globals are an imported module's (not code generated at run time, such as
    a namedtuple's methods or an FX graph's forward) and not a library's: neither named in one
    nor made by one's own loader (torch makes its remote-module template a top-level module,
    ``_remote_module_non_scriptable``, from a string, when torch.distributed is first used)."""
    name = module_globals.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    if getattr(module, "__dict__", None) is not module_globals or name.partition(".")[0] in LIBRARIES:
        return False
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    return type(loader).__module__.partition(".")[0] not in _LOADING_LIBRARIES


# Libraries whose loaders load their own modules (importlib's load the user's files; so does
# pytest's assertion rewriter, and Ray's loads what a runtime_env ships).
_LOADING_LIBRARIES = LIBRARIES - frozenset(sys.stdlib_module_names) - _SERVING
