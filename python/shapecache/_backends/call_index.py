"""The call index: a call served from a package another process published, without a trace.

A package is found by its key (package_store.py), which hashes the traced program: a process
must trace a call before it can look its package up. So a process that traced a call whose
graph is a shared package also writes, beside the packages, a record of that call
(``<call id>.call``): the package's key, the output's structure, what the trace's guard was
made of, by name (guards.record's inputs: the modules whose forward ran, by path in the
call's module trees; the weights the graph reads, by name; the globals the code that ran
reads, by module and name), and the fingerprint of the model's state (below).

The call id names the call with nothing a trace learns: what every package key holds besides
the program (package_store.setting: torch's version and build, the settings it compiles
under, the host, inductor's options and configuration), Python's version, which functions
torch's namespaces hold (a kernel patched over one of torch's), the function (its code), the
call's structure, its arguments other than tensors, and its tensors' shapes, strides, dtypes,
devices and which of them share a storage.

A process that misses a call reads its record before tracing (``find``) and serves the call
from the record's package where its own model has the record's fingerprint. The fingerprint
is made over a guard (guards.record) of every module of the call's trees, not only those
that ran, with the weights and globals the record names; it compares across processes what
that guard compares within one, with values in place of identities, and fails closed:

- every dict (in its order), list, cell, set (in the order it iterates), class and tensor the
  guard holds, by path;
- a module, and an object the guard walks, by the path the guard first met it at (which
  object an attribute holds, not only its class); any other object by its class and its
  attributes, where it keeps them in a ``__dict__``;
- a function by its name, code, defaults, attributes and closure (a decorator's wrapper holds
  what it wraps there), whatever module it says it is from; a class by its attributes (its
  methods' code, its properties', its values);
- a tensor by its dtype, shape, strides, offset and bytes, hashed at every fingerprint (a
  write through ``.data`` bumps no version): about 1.3 GB/s here, 42 ms for res-convnet.

So the state the trace would start from is the publisher's, and the trace would give the
program of the record's key. What it cannot name (an object with ``__slots__`` the guard holds
by identity, an inference tensor, a lifted constant the model holds) makes the call
``NotPortable``: it is traced, as without the index. Two assumptions remain, as in the guard
within one process: constant sets in code are tested for membership (they are compared as
sets), and what a call reads outside Python objects (environment variables, files) is the
same in every replica of a deployment.

Anything else traces, as without the index: no record, one that cannot be trusted or parsed,
another state's (a weight, a flag, a class's code changed: the trace then writes the record
anew), or a name that does not resolve. The record is input another process wrote: it is
read as packages are (package_trust.py: written by this user, or sealed under the
deployment's secret), at most 1 MiB, parsed so that no failure of it fails a build, and its
output structure only of types whose reading imports nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import logging
import math
import os
import sys
import tempfile
import types
import zipfile

import torch
from torch.utils import _pytree

from shapecache._backends import compilers, disk_cache, entry, guards, package_store
from shapecache._backends.trace import OutputLayout, Trace

logger = logging.getLogger("shapecache")

FORMAT = 1  # in every call id: records of another layout are another id
SUFFIX = ".call"  # a record's file: <call id>.call, in the packages' directory
_MEMBER = "call.json"  # the record's one member (a zip archive: sealed as packages are)
MAX_RECORD_BYTES = 1 << 20  # a record is refused past this (a few kilobytes for a UNet)
_DEPTH = 12  # how deep values nest before the fingerprint gives up (NotPortable)


class NotPortable(Exception):
    """What a call or its guard holds cannot be named or compared in another process (the
    message says what)."""


def find(store: package_store.PackageStore, function, args: tuple, kwargs: dict, tensors: tuple, roots: dict,
         compile_options: dict):
    """The call served from the package its record names, as exported.CompiledCall, where the
    store holds a record of it whose fingerprint the model here has, and the package loads;
    None otherwise (the call is traced)."""
    from shapecache._backends.exported import CompiledCall

    devices = {tensor.device for tensor in tensors} or {torch.device("cpu")}
    options = compilers.inductor_options(compile_options)
    if compilers.package_refusal(devices.pop() if len(devices) == 1 else None, options):
        return None
    options = compilers.package_options(options)
    try:
        name = call_id(function, args, kwargs, tensors, roots, options) + SUFFIX
    except NotPortable as why:
        logger.debug("shapecache: a call is traced: %s", why)
        return None
    record = _read(store, name)
    if record is None:
        return None
    try:
        built_from = guards.guard(roots, functions=[function])  # (before what is read of the model)
        weights = _Weights(_pytree.tree_leaves((args, kwargs)))
        reached, read, reads = _resolved(record, roots, weights)
        if any(tensor.is_inference() for _, tensor in read):  # not frozen: no package (compilers.choose_route)
            return None
        if fingerprint(guards.record(roots, functions=[function], tensors=read, called=reads)) != record["guard"]:
            logger.debug("shapecache: the call index's %s is of another state of the model", name)
            return None
        layout = _layout(record["output"])
        guard = guards.record(roots, functions=[function], reached=reached, tensors=read, called=reads)
    except NotPortable as why:
        logger.debug("shapecache: a call is traced: %s", why)
        return None
    except Exception as error:  # noqa: BLE001  (a record that parses but is none: the call is traced, and its record written anew)
        logger.warning("shapecache: the call index's %s is not read (%s); the call is traced", name,
                       entry.described(error))
        return None
    compiled = store.lookup(record["key"])
    if compiled is None:
        return None
    disk_cache.note_traced_nothing()
    return CompiledCall(compiled.run, None if layout.is_one_tensor() else layout.rebuild, guard, built_from,
                        compiled.constants, compiled.constant_bytes)


def prepare(traced: Trace, function, args: tuple, kwargs: dict, options: dict) -> tuple[str, dict] | None:
    """The name and record of the call `traced` (of `function` with `args` and `kwargs`, its
    graph compiled with inductor `options`: the route's), made as the trace ends, from the
    state it was traced from; None where the call cannot be named in another process (logged
    at debug: it is traced there, as before). ``write`` writes it once its key is known."""
    try:
        weights = _Weights(_pytree.tree_leaves((args, kwargs)))
        record = {"format": FORMAT, "output": _output(traced.output),
                  "reached": _module_paths(traced.reached, traced.roots),
                  # (a constant the call made is the call's, which its id and code name)
                  "read": [weights.name_of(name, tensor) for name, tensor in traced.read
                           if name not in traced.made_by_the_call],
                  "called": [_module_name(module_globals, module_reads) for module_globals, module_reads in traced.reads]}
        # The fingerprint of the guard the record's names make, as a reader makes it.
        _, read_again, reads_again = _resolved(record, traced.roots, weights)
        record["guard"] = fingerprint(guards.record(traced.roots, functions=[function], tensors=read_again,
                                                    called=reads_again))
        name = call_id(function, args, kwargs, traced.tensors, traced.roots, options) + SUFFIX
    except NotPortable as why:
        logger.debug("shapecache: a call is not indexed: %s", why)
        return None
    except Exception as error:  # noqa: BLE001  (the index is never worth a build)
        logger.warning("shapecache: a call is not indexed (%s)", entry.described(error))
        return None
    if not traced.built_from.check():  # another thread changed the model during the trace: not its state
        return None
    return name, record


def write(store: package_store.PackageStore, prepared: tuple[str, dict], key: str) -> None:
    """Writes the record `prepared` (prepare) of a call whose graph is the package of `key`;
    a directory that cannot be written costs a warning."""
    name, record = prepared
    _place(store, name, json.dumps({**record, "key": key}).encode())


def call_id(function, args: tuple, kwargs: dict, tensors: tuple, roots: dict, options: dict) -> str:
    """The call's id: what its package's key holds besides the program, and what the call is
    before any trace (the module's docstring). Raises NotPortable."""
    leaves, spec = _pytree.tree_flatten((args, kwargs))
    root_path = {id(module): path for path, module in roots.items()}
    named = _Fingerprint({})  # (nothing walked: the call's values by value)
    parts = [json.dumps({"format": FORMAT, "python": sys.version, "setting": package_store.setting(options),
                         "torch functions": _torch_functions()}, sort_keys=True, default=repr),
             named.value(function)]
    try:
        parts.append(_pytree.treespec_dumps(spec))
    except Exception as error:  # noqa: BLE001  (pytree's failures for a type it cannot name share no base class)
        raise NotPortable(f"the call's structure cannot be named ({error})") from error
    storages: dict = {}  # (a tensor's storage: the call's key sees its tensors alias one another)
    for leaf in leaves:
        if isinstance(leaf, torch.nn.Module):
            parts.append(f"module {root_path.get(id(leaf))} {_class_name(type(leaf))}")
        elif isinstance(leaf, torch.Tensor):
            if leaf.layout != torch.strided or type(leaf) not in (torch.Tensor, torch.nn.Parameter):
                raise NotPortable(f"a {leaf.layout} {type(leaf).__name__} among the call's arguments")
            storage = storages.setdefault(leaf.untyped_storage().data_ptr(), len(storages))
            parts.append(f"tensor {leaf.dtype} {tuple(leaf.shape)} {leaf.stride()} {leaf.storage_offset()} "
                         f"{leaf.device} {leaf.requires_grad} storage {storage}")
        else:
            parts.append(named.value(leaf))
    parts.append(str(len(tensors)))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _torch_functions() -> str:
    """Which functions torch's namespaces hold (``torch``, ``torch.nn.functional``,
    ``torch.Tensor``), by the names they were defined under: a function patched over one of
    torch's (an attention kernel's) is another call."""
    import torch.nn.functional as functional

    named = []
    for namespace in (torch, functional, torch.Tensor):
        for name, value in sorted(vars(namespace).items()):
            if callable(value) and not isinstance(value, type):
                named.append(f"{name}={getattr(value, '__module__', None)}.{getattr(value, '__qualname__', None)}")
    return hashlib.sha256("\0".join(named).encode()).hexdigest()


def fingerprint(record: guards.GuardRecord) -> str:
    """A digest of what `record` holds, by path, comparable between processes (the module's
    docstring). Raises NotPortable."""
    return _Fingerprint({id(obj): path for obj, path in reversed(record.types)}).of(record)


_ABSENT = object()
_SIMPLE = (type(None), bool, int, float, complex, str)
_NAMED = (torch.dtype, torch.device, torch.layout, torch.memory_format)
# A class's attributes that say nothing of what its code does.
_NOT_CODE = frozenset({"__doc__", "__annotations__", "__module__", "__qualname__", "__firstlineno__",
                       "__static_attributes__", "__dict__", "__weakref__", "__slots__", "_abc_impl"})
# Attributes of a class that are C slots (__init__ of a builtin base, a __slots__ member):
# what they do is the class's, named with it.
_DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType, types.WrapperDescriptorType,
                types.MethodDescriptorType, types.ClassMethodDescriptorType, types.BuiltinFunctionType)


class _Fingerprint:
    """Makes strings of values that another process makes of equal values, naming the objects
    the guard walks (`paths`: id -> the path the guard first met it at) by that path: which
    object an attribute holds is compared, not only its class."""

    def __init__(self, paths: dict):
        self.paths = paths
        self.tensors: dict = {}  # id -> digest: a tensor met twice is hashed once
        self.classes: set = set()  # ids of the classes described so far

    def of(self, record: guards.GuardRecord) -> str:
        digest = hashlib.sha256()

        def add(*parts: str) -> None:
            digest.update("\0".join(parts).encode() + b"\1")

        for held, path, keys in record.dicts:
            items = held.items() if keys is None else ((key, held.get(key, _ABSENT)) for key in keys)
            add("dict", path, *(f"{self.value(key)}={self.value(value)}" for key, value in items))
        for tensor, path, _ in record.tensors:
            add("tensor", path, self.tensor(tensor))
        for cell, path in record.cells:
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                add("cell", path, "empty")
            else:
                add("cell", path, self.value(contents))
        for held, path in record.lists:
            add("list", path, *(self.value(item) for item in held))
        for obj, path in record.types:
            add("type", path, _class_name(type(obj)))
        for cls, path in record.class_dicts:
            add("class", path, self.class_attributes(cls))
        for obj, path, snapshot in record.snapshots:
            add("snapshot", path, self.value(snapshot(obj)))
        return digest.hexdigest()

    def value(self, value, depth: int = _DEPTH) -> str:
        """`value` as a string. Raises NotPortable for what it cannot name (fails closed)."""
        if depth <= 0:
            raise NotPortable("a value nests too deep")
        inner = depth - 1
        if value is _ABSENT:
            return "absent"
        if type(value) in _SIMPLE:
            return f"{type(value).__name__}:{value!r}"
        if value is Ellipsis:
            return "..."
        if type(value) is bytes:
            return f"bytes:{hashlib.sha256(value).hexdigest()}"
        if type(value) is slice:
            return f"slice({self.value(value.start, inner)},{self.value(value.stop, inner)},{self.value(value.step, inner)})"
        if isinstance(value, enum.Enum):
            return f"{_class_name(type(value))}.{value.name}"
        if isinstance(value, _NAMED):
            return f"{type(value).__name__}:{value}"
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, torch.nn.Module):
            return f"module@{self.path_of(value)}"
        if isinstance(value, (tuple, list)):  # (torch.Size and named tuples too: by their class)
            return f"{_class_name(type(value))}({','.join(self.value(item, inner) for item in value)})"
        if isinstance(value, dict):  # in order: code that iterates it sees that order
            items = ",".join(f"{self.value(key, inner)}={self.value(item, inner)}" for key, item in value.items())
            return f"{_class_name(type(value))}{{{items}}}"
        if isinstance(value, (set, frozenset)):
            # In the order it iterates, which code that iterates it sees: an equal set built in
            # another order, or whose strings hash otherwise (PYTHONHASHSEED), is another state.
            return f"{_class_name(type(value))}{{{','.join(self.value(item, inner) for item in value)}}}"
        if isinstance(value, type):
            if id(value) in self.classes:  # (a method's __class__ cell: described where it was met)
                return f"class:{_class_name(value)}"
            return f"class:{_class_name(value)}:{self.class_attributes(value, inner)}"
        if isinstance(value, types.ModuleType):
            return f"module {value.__name__}"
        if isinstance(value, types.FunctionType):
            return self.function(value, inner)
        if isinstance(value, functools._lru_cache_wrapper):  # (a memoized function: by what it wraps)
            return f"lru_cache({self.value(value.__wrapped__, inner)})"
        if isinstance(value, functools.partial):
            return (f"partial({self.value(value.func, inner)},{self.value(value.args, inner)},"
                    f"{self.value(value.keywords, inner)})")
        if isinstance(value, types.MethodType):
            return f"method:{self.value(value.__func__, inner)} of {self.value(value.__self__, inner)}"
        if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            owner = value.__self__
            of = "" if owner is None or isinstance(owner, types.ModuleType) else f" of {self.value(owner, inner)}"
            return f"builtin:{getattr(value, '__module__', None)}.{value.__qualname__}{of}"
        if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return f"op:{value}"
        if isinstance(value, dataclasses.Field):  # (a dataclass's field: its default is its class's)
            return f"field:{value.name}:{self.value(value.default, inner)}:{self.value(value.default_factory, inner)}"
        if type(value).__name__ == "_DataclassParams" and type(value).__module__ == "dataclasses":
            return f"dataclass:{value!r}"
        if value is dataclasses.MISSING:
            return "missing"
        if isinstance(value, (inspect.Signature, inspect.Parameter)):  # (a decorator's record of what it wraps)
            return f"{type(value).__name__}:{value}"
        if isinstance(value, logging.Logger):  # (a module's logger: what it logs changes no graph)
            return f"logger:{value.name}"
        if type(value).__name__ == "ndarray" and type(value).__module__ == "numpy":
            return f"ndarray:{value.shape}:{value.dtype.str}:{hashlib.sha256(value.tobytes()).hexdigest()}"
        if id(value) in self.paths:  # walked by the guard: its state is an item of its own
            return f"object@{self.paths[id(value)]}"
        if type(value).__module__.partition(".")[0] == "shapecache":  # the cache itself, as installed on a module
            return f"object:{_class_name(type(value))}"
        state = getattr(value, "__dict__", None)
        if type(state) is dict and not hasattr(type(value), "__slots__"):  # a plain object: its class and attributes
            return f"object:{self.value(type(value), inner)}:{self.value(state, inner)}"
        raise NotPortable(f"a {_class_name(type(value))} the guard holds by identity")

    def path_of(self, module: torch.nn.Module) -> str:
        if id(module) not in self.paths:
            raise NotPortable(f"a {_class_name(type(module))} outside what the guard walks")
        return self.paths[id(module)]

    def function(self, function: types.FunctionType, depth: int) -> str:
        """A function by its name, code, defaults, attributes and closure (a decorator's
        wrapper holds what it wraps there), whoever says it defined it."""
        parts = [f"function:{getattr(function, '__module__', None)}.{function.__qualname__}", _code(function.__code__),
                 self.value(function.__defaults__, depth), self.value(function.__kwdefaults__, depth),
                 self.value(vars(function), depth)]
        for cell in function.__closure__ or ():
            try:
                parts.append(self.value(cell.cell_contents, depth))
            except ValueError:  # an empty cell
                parts.append("empty")
        return "|".join(parts)

    def class_attributes(self, cls: type, depth: int = _DEPTH) -> str:
        """A class's own attributes: its functions' code (a property's, a static or class
        method's), its values; a C slot by its name."""
        if cls.__module__.partition(".")[0] in _BUILTIN_MODULES:
            return "builtin"
        self.classes.add(id(cls))
        parts = []
        for name, value in vars(cls).items():
            if name in _NOT_CODE:
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = (value.fget, value.fset, value.fdel)
            elif isinstance(value, functools.cached_property):
                value = value.func
            elif isinstance(value, _DESCRIPTORS):
                parts.append(f"{name}=slot")
                continue
            parts.append(f"{name}={self.value(value, depth)}")
        return ",".join(parts)

    def tensor(self, tensor: torch.Tensor) -> str:
        """A tensor by its dtype, shape, strides, offset, requires_grad and bytes, hashed each
        time (a write through ``.data`` bumps no version). Raises NotPortable for one whose
        bytes are not a plain CPU tensor's, or that keeps no version (an inference tensor)."""
        if id(tensor) in self.tensors:
            return self.tensors[id(tensor)]
        if (type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu"
                or tensor.layout != torch.strided or tensor.is_quantized or tensor.is_conj() or tensor.is_neg()):
            raise NotPortable(f"a {type(tensor).__name__} on {tensor.device} ({tensor.layout})")
        if tensor.is_inference():
            raise NotPortable("an inference tensor, which keeps no version")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest = (f"tensor:{tensor.dtype}:{tuple(tensor.shape)}:{tensor.stride()}:{tensor.storage_offset()}:"
                  f"{tensor.requires_grad}:{hashlib.blake2b(memoryview(data), digest_size=20).hexdigest()}")
        self.tensors[id(tensor)] = digest
        return digest


_BUILTIN_MODULES = frozenset({"builtins", "abc", "collections", "typing", "enum", "_collections_abc"})


@functools.lru_cache(maxsize=4096)
def _code(code: types.CodeType) -> str:
    """A digest of what `code` does, without where it was read from (its file and lines). Its
    constant sets are sorted: code tests membership of them."""
    digest = hashlib.sha256()
    for part in (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                 code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags):
        digest.update(repr(part).encode() + b"\0")
    for constant in code.co_consts:
        digest.update(_constant(constant).encode() + b"\0")
    return digest.hexdigest()


def _constant(constant) -> str:
    if isinstance(constant, types.CodeType):
        return _code(constant)
    if isinstance(constant, tuple):
        return f"({','.join(_constant(item) for item in constant)})"
    if isinstance(constant, frozenset):
        return f"frozenset{{{','.join(sorted(_constant(item) for item in constant))}}}"
    return _Fingerprint({}).value(constant)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _output(layout: OutputLayout) -> dict:
    """The output's layout as the record holds it."""
    constants = list(layout.constants)
    if not all(type(c) in (type(None), bool, int, str) or (type(c) is float and math.isfinite(c)) for c in constants):
        raise NotPortable("the output holds a constant JSON cannot hold")
    try:
        spec = _pytree.treespec_dumps(layout.spec)
    except Exception as error:  # noqa: BLE001  (pytree's failures for a type it cannot name share no base class)
        raise NotPortable(f"the output's structure cannot be named ({error})") from error
    if not _plain_spec(json.loads(spec)):
        raise NotPortable("the output's structure holds a type whose reading imports a module")
    return {"spec": spec, "constants": constants, "tensors": list(layout.tensor_positions)}


def _layout(output: dict) -> OutputLayout:
    """The output's layout from the record. Raises ValueError where it is none."""
    if not _plain_spec(json.loads(output["spec"])):
        raise ValueError("its output's structure holds a type whose reading imports a module")
    spec = _pytree.treespec_loads(output["spec"])
    positions, constants = output["tensors"], output["constants"]
    if spec.num_leaves != len(constants) or len(set(positions)) != len(positions) or any(
            constants[i] is not None for i in positions):
        raise ValueError("its output's structure does not hold its leaves")
    return OutputLayout.of(spec, constants, positions)


def _plain_spec(spec) -> bool:
    """Whether the serialized tree spec `spec` (pytree's JSON) holds only types whose reading
    imports nothing: its containers, and the types registered here by name (a defaultdict's
    factory and an enum are imported by the module they name)."""
    allowed = set(_pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE) - {"collections.defaultdict"}
    stack = [spec[1] if isinstance(spec, list) and len(spec) == 2 else None]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            return False
        kind = node.get("type")
        if kind is not None and kind not in allowed:
            return False
        if "enum" in str(node.get("context", "")).lower():
            return False
        children = node.get("children_spec")
        if not isinstance(children, list):
            return False
        stack.extend(children)
    return True


def _module_paths(reached: set, roots: dict) -> list[list[str]]:
    """The (root path, path in that root) of each module of `reached` (ids)."""
    paths, left = [], set(reached)
    for root_path, root in roots.items():
        for path, module in root.named_modules(remove_duplicate=False):
            if id(module) in left:
                left.discard(id(module))
                paths.append([root_path, path])
    if left:
        raise NotPortable("a module whose forward ran is outside the call's module trees")
    return paths


class _Weights:
    """The parameters and buffers of the call's modules by the traced program's names
    (``owned.<i>.<path>``: the i-th module among the call's arguments), made once."""

    def __init__(self, leaves: list):
        self.by_name: dict[str, torch.Tensor] = {}
        modules = [leaf for leaf in leaves if isinstance(leaf, torch.nn.Module)]
        for position, module in enumerate(modules):
            for path, tensor in (*module.named_parameters(remove_duplicate=False),
                                 *module.named_buffers(remove_duplicate=False)):
                self.by_name.setdefault(f"owned.{position}.{path}", tensor)

    def name_of(self, name: str, tensor: torch.Tensor) -> str:
        """`name`, where it names `tensor` here."""
        if self.by_name.get(name) is not tensor:
            raise NotPortable(f"the graph reads {name}, which is no weight of the call's modules")
        return name


def _module_name(module_globals: dict, reads: dict) -> list:
    """[the name of the module whose globals `module_globals` are, its `reads`]."""
    name = module_globals.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    if module is None or vars(module) is not module_globals:
        raise NotPortable(f"code ran with globals of no imported module ({name!r})")
    return [name, {global_name: sorted(attributes, key=lambda a: (a is not None, a or ""))
                   for global_name, attributes in reads.items()}]


def _resolved(record: dict, roots: dict, weights: _Weights) -> tuple:
    """guards.record's `reached`, `tensors` and `called` from the record's names, over the
    live objects. Raises NotPortable where a name does not resolve here."""
    reached = set()
    for root_path, path in record["reached"]:
        root = roots.get(root_path)
        try:
            module = root.get_submodule(path) if root is not None else None
        except AttributeError:
            module = None
        if module is None:
            raise NotPortable(f"the module {root_path}.{path} is not here")
        reached.add(id(module))
    read = []
    for name in record["read"]:
        if (tensor := weights.by_name.get(name)) is None:
            raise NotPortable(f"the weight {name} is not here")
        read.append((name, tensor))
    reads = []
    for name, module_reads in record["called"]:
        module = sys.modules.get(name)
        if module is None:
            raise NotPortable(f"the module {name} is not imported here")
        reads.append((vars(module), {global_name: frozenset(attributes)
                                     for global_name, attributes in module_reads.items()}))
    return reached, read, reads


def _read(store: package_store.PackageStore, name: str) -> dict | None:
    """The record `name` in the store, parsed; None where there is none, or it is refused or
    unreadable (logged)."""
    try:
        copy = store.sealed_copy(name, "call index record", max_bytes=MAX_RECORD_BYTES)
    except package_store.Refused as refused:
        logger.warning("shapecache: the call index's %s is not read: %s; the call is traced", name, refused)
        return None
    if copy is None:
        return None
    try:
        with zipfile.ZipFile(copy) as archive:
            info = archive.getinfo(_MEMBER)
            if info.file_size > MAX_RECORD_BYTES:
                raise ValueError(f"it holds {info.file_size} bytes; at most {MAX_RECORD_BYTES} are read")
            text = archive.read(info)
        record = json.loads(text, parse_constant=_no_constant)
        _check(record)
        return record
    except Exception as error:  # noqa: BLE001  (zipfile's, zlib's and json's failures share no base class)
        logger.warning("shapecache: the call index's %s is not read (%s); the call is traced", name,
                       entry.described(error))
        return None
    finally:
        package_store.removed(copy)


def _no_constant(name: str):
    raise ValueError(f"it holds {name}, which no record holds")


def _check(record) -> None:
    """Raises ValueError where `record` is not as ``write`` writes them."""
    def strings(value, length=None) -> bool:
        return isinstance(value, list) and all(isinstance(v, str) for v in value) and (
            length is None or len(value) == length)

    output = record.get("output") if isinstance(record, dict) else None
    if not (isinstance(record, dict) and record.get("format") == FORMAT and _digest(record.get("key"))
            and _digest(record.get("guard")) and isinstance(output, dict)
            and isinstance(output.get("spec"), str) and isinstance(output.get("constants"), list)
            and all(type(c) in (type(None), bool, int, float, str) for c in output["constants"])
            and isinstance(output.get("tensors"), list)
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(output["constants"])
                    for i in output["tensors"])
            and isinstance(record.get("reached"), list) and all(strings(p, 2) for p in record["reached"])
            and strings(record.get("read"))
            and isinstance(record.get("called"), list)
            and all(isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], dict)
                    and all(isinstance(a, list) and all(x is None or isinstance(x, str) for x in a)
                            for a in c[1].values())
                    for c in record["called"])):
        raise ValueError("it is not a record of this format")


def _digest(value) -> bool:
    """Whether `value` is a SHA-256 digest in hexadecimal (a key names a file: nothing else may)."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _place(store: package_store.PackageStore, name: str, payload: bytes) -> None:
    """Writes `payload` as the record `name` (package_store.place: sealed, renamed into place),
    where the directory may be written; a failure is logged."""
    if not package_store.writable(store.directory, store.secret):
        return
    descriptor, source = tempfile.mkstemp(prefix="shapecache-call-", suffix=".zip")
    try:
        with os.fdopen(descriptor, "wb") as archive_file, zipfile.ZipFile(archive_file, "w") as archive:
            archive.writestr(_MEMBER, payload)
        package_store.place(name, source, store.directory, store.secret)
    except (OSError, ValueError) as error:
        logger.warning("shapecache: the call index could not be written to %s (%s)", store.directory, error)
    finally:
        package_store.removed(source)
