"""What a compiled entry depends on (invariant 5), recorded into a ``_C.StateGuard`` when it is built and
checked in C++ before each of its calls (``csrc/cache/state_guard.h``).

A compiled entry answers for the state it was built from. It depends on:

- the modules the call reached (their forward ran while the entry was traced), their direct
  children (a forward may read a child's attribute without calling it), their ancestors up
  to the root (so a submodule replaced by another is seen), and the modules that own a
  tensor the graph reads. For each: its ``__dict__`` (attributes such as FreeU's
  factors, ``training``, the attention processor), every dict it holds (``_parameters``,
  ``_buffers``, ``_modules``, the hook dicts), and the ``__dict__`` of the plain objects
  hanging from it (a processor's scale, a hook's settings), a few levels deep;
- every tensor among those: its object, memory and version counter, so that replacing a
  parameter, ``.data =``, ``.to()`` and in-place updates are seen;
- for a function: the globals its code reads and its closure cells (the modules and tensors
  found there are walked as above); for a ``functools.partial``, its function, arguments and
  keywords; for a callable object, its attributes;
- the globals read by the code that ran while the entry was built (a flag a helper reads;
  called_code.py), and the closure cells and globals of the functions hanging from a module
  (a hook, a forward replaced by a partial); for an entry Dynamo built, hooks by identity;
- the class of each module and plain object guarded, and the attributes of its classes (up
  to ``nn.Module``): a swapped ``__class__`` or a method patched on a class is a change;
- torch's global forward hooks.

Lists (peft's ``merged_adapters``, a processor's scales) are compared item by item on every
check, up to 256 items; a longer list only by identity. Sets (up to 256 items) and numpy arrays
(up to 4096 elements), which keep no version either, are compared by a snapshot on every
check; larger ones only by identity.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterable

import torch
from torch.nn.modules import module as _module_globals
from torch.utils._pytree import tree_flatten

from shapecache._backends import called_code
from shapecache._extension import _C

# How deep plain objects hanging from a module are walked (a processor, a hook and its state).
_OBJECT_DEPTH = 3
# Lists up to this long are guarded item by item (a list keeps no version, so its items are
# compared on every check); a longer one by identity only.
_LIST_ITEMS = 256
_ARRAY_ELEMENTS = 4096  # numpy arrays up to this many elements are compared by a snapshot
# What every module holds and no forward reads (which buffers state_dict leaves out): a set,
# which would cost a snapshot per module on every check. Replacing it is still seen (the
# module's __dict__ is guarded).
_NOT_READ_BY_FORWARD = frozenset({"_non_persistent_buffers_set"})

# Held by identity, not walked: code (a hook function), Python modules, submodules (each is
# guarded on its own), tensors, and the cache itself (its counters change as it works).
_NOT_WALKED = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial,
               types.ModuleType, torch.nn.Module, torch.Tensor, _C.ShapeDispatcher)
# A module's hook dicts: the hooks are guarded by identity, the functions' own state is not.
_HOOK_DICTS = frozenset({"_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                         "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                         "_load_state_dict_post_hooks"})
# Code, not a callable object whose attributes are its state.
_CODE = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType)


class GuardRecord:
    """What a guard will check, one list of items per kind, made into a ``_C.StateGuard`` in one
    call (csrc/cache/state_guard.h reads the lists; an object of another kind than its list's is
    a TypeError there, naming its path). Dicts and lists are held as themselves, never copied:
    the guard compares them when it is made and on each check."""

    __slots__ = ("dicts", "tensors", "cells", "lists", "types", "class_dicts", "snapshots")

    def __init__(self):
        self.dicts: list = []  # (dict, path, the keys read or None for all)
        self.tensors: list = []  # (tensor, path, the version read or None where it keeps none)
        self.cells: list = []  # (closure cell, path)
        self.lists: list = []  # (list, path)
        self.types: list = []  # (object, path): which class it is an instance of
        self.class_dicts: list = []  # (class, path): its own attributes
        self.snapshots: list = []  # (object, path, a function that snapshots it)

    def describe(self) -> list[tuple[str, str]]:
        """(kind, path) of every item, kind by kind."""
        return [(kind, item[1]) for kind in self.__slots__ for item in getattr(self, kind)]


class Guarded:
    """Collects what an entry depends on, once per object."""

    def __init__(self, python_only: bool = False, collect: list | None = None, hooks_state: bool = True):
        self.record = GuardRecord()
        self._collect = collect  # receives every dict and list guarded, when given
        self._seen: set[int] = set()
        # Python state alone: no tensors, and not the dicts that hold parameters and buffers
        # (a trace swaps fake tensors into those).
        self._python_only = python_only
        # While a function's state is walked: where the modules met in it go (their trees are
        # guarded whole); None while a module's own state is (its submodules are guarded apart).
        self._roots: dict | None = None
        # Whether what hooks keep (a hook object's settings, a hook function's closure) is
        # guarded: a graph bakes in what they read; Dynamo runs the hooks and guards it itself.
        self._hooks_state = hooks_state

    def module(self, module: torch.nn.Module, path: str) -> None:
        """The module's own state: its attribute dict, the dicts it holds, their tensors and
        the plain objects hanging from it (not its submodules: each is guarded on its own)."""
        if not self._first(module):
            return
        self._classes(module, path)
        state = module.__dict__
        self._add_dict(state, path)
        for name, value in state.items():
            if name in _NOT_READ_BY_FORWARD or (self._python_only and name in ("_parameters", "_buffers")):
                continue
            if name in _HOOK_DICTS and not self._hooks_state:
                # Which hooks, by identity; not the state a hook keeps (an activation collector's
                # list changes on every call): Dynamo's own guards cover what the hooks read.
                if isinstance(value, dict) and self._first(value):
                    self._add_dict(value, f"{path}.{name}")
                continue
            self._value(value, f"{path}.{name}", _OBJECT_DEPTH)

    def tensor(self, tensor: torch.Tensor, path: str) -> None:
        if not self._python_only and self._first(tensor):
            # The version read now: the guard may be made later (when the cache reads the
            # built entry), and an update in place meanwhile must count as a change.
            self.record.tensors.append((tensor, path, _version_of(tensor)))

    def function(self, function, path: str, roots: dict) -> None:
        """The globals `function`'s code names and its closure cells; modules found there are
        added to `roots` (name -> module) for the caller to walk."""
        if isinstance(function, torch.nn.Module):
            roots.setdefault(path, function)
            return
        if isinstance(function, functools.partial):
            for i, argument in enumerate(function.args):
                self._argument(argument, f"{path}.args[{i}]", roots)
            for name, argument in function.keywords.items():
                self._argument(argument, f"{path}.keywords[{name!r}]", roots)
            self.function(function.func, f"{path}.func", roots)
            return
        function = inspect.unwrap(function) if callable(function) else function
        if not isinstance(function, _CODE) and isinstance(getattr(function, "__dict__", None), dict):
            # A callable object: its attributes, and what its class's __call__ reads.
            if self._first(function):
                self._classes(function, path)
                self._add_dict(function.__dict__, path)
                for name, value in function.__dict__.items():
                    self._argument(value, f"{path}.{name}", roots)
            self.function(type(function).__call__, f"{path}.__call__", roots)
            return
        if inspect.ismethod(function):
            if isinstance(function.__self__, torch.nn.Module):
                roots.setdefault(f"{path}.__self__", function.__self__)
            function = function.__func__
        if not inspect.isfunction(function):
            return
        self.globals_read(function.__code__, function.__globals__, roots)
        outer, self._roots = self._roots, roots  # modules the cells hold are walked whole
        try:
            self._cells(function, function.__qualname__, _OBJECT_DEPTH)
        finally:
            self._roots = outer

    def globals_read(self, code, module_globals: dict, roots: dict) -> None:
        """The globals `code` reads (``called_code.global_reads``) that `module_globals` holds."""
        self.reads(module_globals, called_code.global_reads(code), roots)

    def reads(self, module_globals: dict, reads: dict, roots: dict) -> None:
        """The globals of `module_globals` that `reads` names (name -> the attributes loaded off
        it, None: used whole), compared whenever that dict changes. Of a global used whole, what
        it holds is guarded too where it is state (a module, a tensor, a container); of one
        whose attributes are loaded (``CFG.scale``, ``config_module.SCALE``), those attributes,
        as a module's are."""
        reads = {name: attributes for name, attributes in reads.items() if name in module_globals}
        if not reads:
            return
        module_name = module_globals.get("__name__", "?")
        self.record.dicts.append((module_globals, f"{module_name} (globals)", sorted(reads)))
        for name, attributes in reads.items():
            value, path = module_globals[name], f"{module_name}.{name}"
            if None in attributes and (isinstance(value, (torch.nn.Module, torch.Tensor, dict, list, set))
                                       or _is_numpy_array(value)):
                self._argument(value, path, roots)
            loaded = sorted(attributes - {None})
            state = getattr(value, "__dict__", None)
            if loaded and isinstance(state, dict) and not isinstance(value, (type, torch.nn.Module)) and not (
                    isinstance(value, types.ModuleType) and value.__name__.partition(".")[0] in called_code.LIBRARIES):
                self.record.dicts.append((state, path, [a for a in loaded if a in state]))
                for attribute in loaded:
                    item = state.get(attribute)
                    if isinstance(item, (torch.nn.Module, torch.Tensor, dict, list, set)) or _is_numpy_array(item):
                        self._argument(item, f"{path}.{attribute}", roots)

    def called(self, reads: Iterable, roots: dict) -> None:
        """The globals read by the code that ran: (module globals, reads) pairs (``reads``)."""
        for module_globals, module_reads in reads:
            self.reads(module_globals, module_reads, roots)

    def global_hooks(self) -> None:
        for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_with_kwargs",
                     "_global_forward_hooks_always_called"):
            hooks = getattr(_module_globals, name, None)
            if isinstance(hooks, dict):
                self.record.dicts.append((hooks, f"torch.nn.modules.module.{name}", None))

    def _argument(self, value, path: str, roots: dict) -> None:
        """A value a function holds or reads: a module is added to `roots` (its tree is
        guarded), anything else guarded as a module's attribute is."""
        if isinstance(value, torch.nn.Module):
            roots.setdefault(path, value)
            return
        outer, self._roots = self._roots, roots
        try:
            self._value(value, path, _OBJECT_DEPTH)
        finally:
            self._roots = outer

    def _value(self, value, path: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            self.tensor(value, path)
        elif isinstance(value, torch.nn.Module):
            if self._roots is not None:
                self._roots.setdefault(path, value)
        elif isinstance(value, dict):
            if self._first(value):
                self._add_dict(value, path)
                for key, item in value.items():
                    self._value(item, f"{path}[{key!r}]", depth)
        elif isinstance(value, (list, tuple)):
            if type(value) is list and len(value) <= _LIST_ITEMS and self._first(value):
                self.record.lists.append((value, path))
                if self._collect is not None:
                    self._collect.append(value)
            for i, item in enumerate(value[:_LIST_ITEMS]):
                self._value(item, f"{path}[{i}]", depth)
        elif type(value) is set:
            if len(value) <= _LIST_ITEMS and self._first(value):
                self.record.snapshots.append((value, path, frozenset))
        elif _is_numpy_array(value):
            if value.size <= _ARRAY_ELEMENTS and self._first(value):
                self.record.snapshots.append((value, path, _array_snapshot))
        elif isinstance(value, (types.FunctionType, functools.partial, types.MethodType)):
            if depth > 0 and self._first(value):
                self._code_state(value, path, depth - 1)
        elif depth > 0 and not isinstance(value, _NOT_WALKED) and isinstance(getattr(value, "__dict__", None), dict):
            if self._first(value):
                self._classes(value, path)
                self._add_dict(value.__dict__, path)
                for name, item in value.__dict__.items():
                    self._value(item, f"{path}.{name}", depth - 1)

    def _code_state(self, function, path: str, depth: int) -> None:
        """What a function hanging from a module (a hook, a forward replaced by a partial)
        reads besides its arguments: its closure cells and what they hold, the globals its
        code names, a partial's arguments, a bound method's object."""
        if _defined_in_a_library(function):
            return
        if isinstance(function, functools.partial):
            self._value(function.func, f"{path}.func", depth + 1)
            for i, argument in enumerate(function.args):
                self._value(argument, f"{path}.args[{i}]", depth)
            self._value(function.keywords, f"{path}.keywords", depth)
        elif isinstance(function, types.MethodType):
            self._value(function.__self__, f"{path}.__self__", depth)
            self._value(function.__func__, f"{path}.__func__", depth + 1)
        else:
            self.globals_read(function.__code__, function.__globals__, {})
            self._cells(function, path, depth)

    def _cells(self, function, path: str, depth: int) -> None:
        """A function's closure cells, and what each holds."""
        for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True):
            self.record.cells.append((cell, f"{path}.<{name}>"))
            try:
                self._value(cell.cell_contents, f"{path}.<{name}>", depth)
            except ValueError:  # an empty cell
                pass

    def _classes(self, obj, path: str) -> None:
        """Which class `obj` is, and the attributes of its classes up to torch's and Python's
        own (a method patched on a class is a change of every instance)."""
        self.record.types.append((obj, path))
        for cls in type(obj).__mro__:
            if cls in (torch.nn.Module, object):
                break
            if self._first(cls):
                self.record.class_dicts.append((cls, f"class {cls.__module__}.{cls.__qualname__}"))

    def _add_dict(self, d: dict, path: str) -> None:
        self.record.dicts.append((d, path, None))
        if self._collect is not None:
            self._collect.append(d)

    def _first(self, obj) -> bool:
        if id(obj) in self._seen:
            return False
        self._seen.add(id(obj))
        return True


def _defined_in_a_library(function) -> bool:
    """Whether `function` (a partial's or a bound method's, followed) is torch's, the standard
    library's or shapecache's own (a torch hook, the trace's own recorder): what those read is
    not the user's state."""
    while isinstance(function, (functools.partial, types.MethodType)):
        function = function.func if isinstance(function, functools.partial) else function.__func__
    return str(getattr(function, "__module__", None) or "").partition(".")[0] in called_code.LIBRARIES


def _version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter now; None for a tensor that keeps none (an inference
    tensor, guarded by identity)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _is_numpy_array(value) -> bool:
    return type(value).__name__ == "ndarray" and type(value).__module__ == "numpy"  # numpy is not imported here


def _array_snapshot(array) -> tuple:
    return array.shape, array.dtype.str, array.tobytes()


def call_roots(args: tuple, kwargs: dict, has_owner: bool, parameter_names) -> dict:
    """The modules among a call's arguments, at any depth: path -> module. A module passed as
    an argument is named by its parameter or keyword ("self": the owner), one inside a
    container by its type and position among the call's leaves."""
    names = ["self", *parameter_names] if has_owner else list(parameter_names)
    named = {id(arg): (names[i] if i < len(names) else f"argument {i}") for i, arg in enumerate(args)}
    named.update({id(value): keyword for keyword, value in kwargs.items()})
    leaves, _ = tree_flatten((args, kwargs))
    return {named.get(id(leaf), f"{type(leaf).__name__} {i}"): leaf for i, leaf in enumerate(leaves)
            if isinstance(leaf, torch.nn.Module)}


def guard(roots: dict, functions: Iterable[Callable] = (), **options) -> _C.StateGuard:
    """The guard made now from ``record(roots, functions, **options)``."""
    return _C.StateGuard(record(roots, functions, **options))


def read_where_they_are(record: GuardRecord, tensors: Iterable[torch.Tensor]) -> GuardRecord:
    """`record` with `tensors` guarded by their object and memory, not their version (-1: the
    guard does not check it): for a graph that is given them on every call and so reads what an
    update in place wrote, as the plain call does (a graph compiled without freezing, given the
    model's parameters and buffers). Replacing one (a new Parameter, ``.data =``, ``.to()``)
    still makes the entry stale."""
    live = {id(tensor) for tensor in tensors}
    record.tensors = [(tensor, path, -1 if id(tensor) in live else version) for tensor, path, version in record.tensors]
    return record


def record(roots: dict, functions: Iterable[Callable] = (), reached=None, tensors: Iterable = (),
           python_only: bool = False, collect: list | None = None, called=None,
           hooks_state: bool = True) -> GuardRecord:
    """What a guard over the module trees of `roots` (path -> module) and of the modules the
    globals and closures of `functions` hold checks: a record, made into a ``_C.StateGuard``
    in one call (by ``guard``, or by the cache from a builder's ``BuiltEntry.guard``).

    `reached`: the ids of the modules of `roots`' trees whose forward ran while the entry was
    traced; only they, their ancestors and the roots are guarded (None: every module of the
    trees). `tensors`:
    (path, tensor) pairs the graph reads besides those (constants it lifted); their owning
    modules are guarded too. `python_only`: no tensors, and not the parameter and buffer dicts.
    `collect`: receives the dicts of modules and objects guarded, and the lists. `called`: the
    code that ran while the entry was built (a called_code.Recorded), whose globals read are
    guarded (or its ``reads()``: (module globals, reads) pairs). `hooks_state`: whether the
    state hooks keep is guarded, or only which hooks
    (for an entry Dynamo built, whose guards cover what the hooks read)."""
    guarded = Guarded(python_only, collect, hooks_state)
    guarded.global_hooks()
    # Modules reached through globals and closures were traced live, without a record of
    # which of them ran: their whole trees are guarded.
    found: dict = {}
    for i, function in enumerate(functions):
        guarded.function(function, f"function {i}", found)
    if called is not None:
        guarded.called(called.reads() if isinstance(called, called_code.Recorded) else called, found)
    tensors = list(tensors)
    owned_by = _owners(roots.values()) if reached is not None else {}
    needed = set(reached or ())
    for module in _reached_modules(roots.values(), needed):  # a forward may read a child's attribute
        needed.update(id(child) for child in module._modules.values() if child is not None)
    for _, tensor in tensors:
        needed.update(owned_by.get(id(tensor), ()))
    for root_path, root in roots.items():
        for path, module in _needed_modules(root, root_path, None if reached is None else needed):
            guarded.module(module, path)
    for root_path, root in found.items():
        for path, module in _needed_modules(root, root_path, None):
            guarded.module(module, path)
    for path, tensor in tensors:
        guarded.tensor(tensor, path)
    return guarded.record


def _reached_modules(roots, reached: set) -> list:
    return [module for root in roots for module in root.modules() if id(module) in reached]


def _owners(roots) -> dict[int, list[int]]:
    """id(tensor) -> ids of the modules that hold it as a parameter or buffer."""
    out: dict[int, list[int]] = {}
    for root in roots:
        for module in root.modules():
            for tensor in (*module._parameters.values(), *module._buffers.values()):
                if tensor is not None:
                    out.setdefault(id(tensor), []).append(id(module))
    return out


def _needed_modules(root: torch.nn.Module, root_path: str, needed: set | None):
    """(path, module) of the modules of `root`'s tree to guard: all when `needed` is None,
    else the root and every module in `needed` with its ancestors."""
    if needed is None:
        for name, module in root.named_modules(remove_duplicate=True):
            yield (f"{root_path}.{name}" if name else root_path), module
        return
    kept: set[int] = set()
    visited: set[int] = set()

    def walk(module, path, ancestors):
        if id(module) in visited:
            return
        visited.add(id(module))
        if id(module) in needed:
            for ancestor_path, ancestor in ancestors:
                if id(ancestor) not in kept:
                    kept.add(id(ancestor))
                    yield ancestor_path, ancestor
            if id(module) not in kept:
                kept.add(id(module))
                yield path, module
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{path}.{name}", [*ancestors, (path, module)])

    kept.add(id(root))
    yield root_path, root
    yield from walk(root, root_path, [])
