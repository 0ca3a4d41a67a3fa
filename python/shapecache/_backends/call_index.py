"""The call index: a call served from a package another process published, without a trace.

A package is found by its key (package_store.py), which hashes the traced program: a process
must trace a call before it can look its package up. So a process that traced a call whose
graph is a shared package also writes, beside the packages, a record of that call
(``<call id>.call``): the package's key, the output's structure, and what the trace's guard
was made of, by name (guards.record's inputs: the modules whose forward ran, by path in the
call's module trees; the weights the graph reads, by name; the globals the code that ran
reads, by module and name), with the fingerprint of that guard.

The call id names the call with nothing a trace learns: what every package key holds besides
the program (package_store.setting: torch's version and build, the settings it compiles
under, the host, inductor's options and configuration), Python's version, the function (its
code), the call's structure, its arguments other than tensors, and its tensors' shapes,
strides, dtypes and devices.

A process that misses a call reads its record before tracing (``find``), makes the guard from
the record's names over its own live objects, and serves the call from the record's package
where that guard's fingerprint is the record's. The fingerprint compares across processes
what the guard compares within one, with values in place of identities: every dict, list,
cell, class and tensor the guard holds, by path, a module by its class (its own state is
guarded apart), a function by its name, code, defaults and closure, a class by its
attributes, a tensor by its dtype, shape, strides and bytes (hashed once per version). So the
state the trace would start from is the publisher's, and the trace would give the program of
the record's key. The package is then loaded as a lookup after a trace loads it (trusted,
sealed, built for that key).

Anything else traces, as without the index: no record, one that cannot be trusted or parsed,
another state's (a weight, a flag, a class's code changed), a name that does not resolve, or
what the fingerprint cannot compare between processes (``NotPortable``: an object the guard
holds by identity, beyond its depth; a lifted constant; a tensor not on the CPU). The record
is input another process wrote: it is read as packages are (package_trust.py: written by this
user, or sealed under the deployment's secret), bounded in size, and parsed defensively.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import json
import logging
import os
import sys
import tempfile
import types
import zipfile

import torch
from torch.utils import _pytree
from torch.utils.weak import WeakIdKeyDictionary

from shapecache._backends import called_code, compilers, disk_cache, guards, package_store
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
    store holds a record of it whose guard, made here from its names, has its fingerprint, and
    the package loads; None otherwise (the call is traced)."""
    from shapecache._backends.exported import CompiledCall

    devices = {tensor.device for tensor in tensors} or {torch.device("cpu")}
    options = compilers.inductor_options(compile_options)
    if compilers.package_refusal(devices.pop() if len(devices) == 1 else None, options):
        return None
    options = compilers.package_options(options)
    name = "a record"
    try:
        name = call_id(function, args, kwargs, tensors, roots, options) + SUFFIX
        record = _read(store, name)
        if record is None:
            return None
        built_from = guards.guard(roots, functions=[function])  # (before what is read of the model)
        leaves = _pytree.tree_leaves((args, kwargs))
        reached, read, reads = _resolved(record, roots, leaves)
        if any(tensor.is_inference() for _, tensor in read):  # not frozen: no package (compilers.choose_route)
            return None
        guard = guards.record(roots, functions=[function], reached=reached, tensors=read, called=reads)
        if fingerprint(guard) != record["guard"]:
            logger.debug("shapecache: the call index's %s is of another state of the model", name)
            return None
        output = record["output"]
        try:
            spec = _pytree.treespec_loads(output["spec"])
        except Exception as error:  # noqa: BLE001  (pytree's failures for a type it does not know share no base class)
            raise NotPortable(f"the output's structure is of a type not registered here ({error})") from error
        if spec.num_leaves != len(output["constants"]):
            raise ValueError("its output's structure does not hold its leaves")
        layout = OutputLayout.of(spec, output["constants"], output["tensors"])
    except NotPortable as why:
        logger.debug("shapecache: a call is traced: %s", why)
        return None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:  # a record that parses but is not one
        logger.warning("shapecache: the call index's %s is not read (%s); the call is traced", name, error)
        return None
    compiled = store.lookup(record["key"])
    if compiled is None:
        return None
    disk_cache.note_traced_nothing()
    return CompiledCall(compiled.run, None if layout.is_one_tensor() else layout.rebuild, guard, built_from,
                        compiled.constants, compiled.constant_bytes)


def write(store: package_store.PackageStore, key: str, traced: Trace, function, args: tuple, kwargs: dict,
          options: dict) -> None:
    """Writes the record of the call `traced` (of `function` with `args` and `kwargs`) whose
    graph is the package of `key`, compiled with inductor `options` (the route's), unless the
    call cannot be named in another process (logged at debug) or the directory cannot be
    written (a warning): a call without a record is traced, as before."""
    try:
        leaves = _pytree.tree_leaves((args, kwargs))
        reached_ids, read, reads = traced.guard_inputs
        record = {"format": FORMAT, "key": key, "output": _output(traced.output),
                  "reached": _module_paths(reached_ids, traced.roots),
                  # (a constant the call made is the call's, which its id and code name)
                  "read": [_weight_name(name, tensor, leaves) for name, tensor in read
                           if name not in traced.made_by_the_call],
                  "called": [_module_name(module_globals, module_reads) for module_globals, module_reads in reads]}
        # The guard the record's names make here, as a reader makes it: its fingerprint is
        # what a reader compares (the trace's own guard was made from ids, before the copies).
        reached, read_again, reads_again = _resolved(record, traced.roots, leaves)
        guard = guards.record(traced.roots, functions=[function], reached=reached, tensors=read_again,
                              called=reads_again)
        record["guard"] = fingerprint(guard)
        name = call_id(function, args, kwargs, traced.tensors, traced.roots, options) + SUFFIX
    except NotPortable as why:
        logger.debug("shapecache: a call is not indexed: %s", why)
        return
    if not traced.built_from.check():  # another thread changed the model since the trace: not its program's state
        return
    _place(store, name, json.dumps(record).encode())


def call_id(function, args: tuple, kwargs: dict, tensors: tuple, roots: dict, options: dict) -> str:
    """The call's id: what its package's key holds besides the program, and what the call is
    before any trace (the module's docstring). Raises NotPortable."""
    leaves, spec = _pytree.tree_flatten((args, kwargs))
    root_path = {id(module): path for path, module in roots.items()}
    digest = hashlib.sha256()
    digest.update(json.dumps({"format": FORMAT, "python": sys.version, "setting": package_store.setting(options)},
                             sort_keys=True, default=repr).encode())
    digest.update(_value(function).encode())
    try:
        digest.update(_pytree.treespec_dumps(spec).encode())
    except Exception as error:  # noqa: BLE001  (pytree's failures for a type it cannot name share no base class)
        raise NotPortable(f"the call's structure cannot be named ({error})") from error
    for leaf in leaves:
        if isinstance(leaf, torch.nn.Module):
            digest.update(f"module {root_path.get(id(leaf))} {_class_name(type(leaf))}\0".encode())
        elif isinstance(leaf, torch.Tensor):
            if leaf.layout != torch.strided:
                raise NotPortable(f"a {leaf.layout} tensor among the call's arguments")
            digest.update(f"tensor {leaf.dtype} {tuple(leaf.shape)} {leaf.stride()} {leaf.device} "
                          f"{leaf.requires_grad}\0".encode())
        else:
            digest.update(f"{_value(leaf)}\0".encode())
    digest.update(str(len(tensors)).encode())
    return digest.hexdigest()


def fingerprint(record: guards.GuardRecord) -> str:
    """A digest of what `record` holds, by path, comparable between processes (the module's
    docstring). Raises NotPortable."""
    walked = {id(obj) for obj, _ in record.types}
    digest = hashlib.sha256()

    def add(*parts: str) -> None:
        digest.update("\0".join(parts).encode() + b"\1")

    for held, path, keys in record.dicts:
        items = held.items() if keys is None else ((key, held.get(key, _ABSENT)) for key in keys)
        add("dict", path, *sorted(f"{key!r}={_value(value, walked)}" for key, value in items))
    for tensor, path, _ in record.tensors:
        add("tensor", path, _tensor(tensor))
    for cell, path in record.cells:
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            add("cell", path, "empty")
        else:
            add("cell", path, _value(contents, walked))
    for held, path in record.lists:
        add("list", path, *(_value(item, walked) for item in held))
    for obj, path in record.types:
        add("type", path, _class_name(type(obj)))
    for cls, path in record.class_dicts:
        add("class", path, *sorted(f"{name}={_attribute(value)}" for name, value in vars(cls).items()))
    for obj, path, snapshot in record.snapshots:
        add("snapshot", path, _value(snapshot(obj)))
    return digest.hexdigest()


_ABSENT = object()
_SIMPLE = (type(None), bool, int, float, complex, str)
_NAMED = (torch.dtype, torch.device, torch.layout, torch.memory_format)


def _value(value, walked: set | None = None, depth: int = _DEPTH) -> str:
    """`value` as a string that another process makes of an equal value. Objects the guard
    walked (`walked`: their ids) are named by their class: their state is guarded apart.
    Raises NotPortable."""
    if depth <= 0:
        raise NotPortable("a value nests too deep")
    if value is _ABSENT:
        return "absent"
    if isinstance(value, _SIMPLE) and type(value) in _SIMPLE:
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, bytes):
        return f"bytes:{hashlib.sha256(value).hexdigest()}"
    if isinstance(value, enum.Enum):
        return f"{_class_name(type(value))}.{value.name}"
    if isinstance(value, _NAMED):
        return f"{type(value).__name__}:{value}"
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, torch.nn.Module):
        return f"module:{_class_name(type(value))}"
    if isinstance(value, (tuple, list)):  # (torch.Size and named tuples too: by their class)
        return f"{_class_name(type(value))}({','.join(_value(item, walked, depth - 1) for item in value)})"
    if isinstance(value, dict):
        items = sorted(f"{_value(key, walked, depth - 1)}={_value(item, walked, depth - 1)}"
                       for key, item in value.items())
        return f"{_class_name(type(value))}{{{','.join(items)}}}"
    if isinstance(value, (set, frozenset)):
        return f"{_class_name(type(value))}{{{','.join(sorted(_value(item, walked, depth - 1) for item in value))}}}"
    if isinstance(value, type):
        return f"class:{_class_name(value)}"
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, types.FunctionType):
        return _function(value, walked, depth)
    if isinstance(value, functools._lru_cache_wrapper):  # (a memoized function: by what it wraps)
        return f"lru_cache({_value(value.__wrapped__, walked, depth - 1)})"
    if isinstance(value, functools.partial):
        return (f"partial({_value(value.func, walked, depth - 1)},{_value(value.args, walked, depth - 1)},"
                f"{_value(value.keywords, walked, depth - 1)})")
    if isinstance(value, types.MethodType):
        owner = value.__self__
        if not (isinstance(owner, (torch.nn.Module, type)) or (walked is not None and id(owner) in walked)):
            raise NotPortable(f"a method bound to a {_class_name(type(owner))} the guard holds by identity")
        return f"method:{_value(value.__func__, walked, depth - 1)} of {_class_name(type(owner))}"
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType, torch._ops.OpOverload,
                          torch._ops.OpOverloadPacket)):
        return f"builtin:{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', value)}"
    if isinstance(value, logging.Logger):  # (a module's logger: what it logs changes no graph)
        return f"logger:{value.name}"
    if type(value).__name__ == "ndarray" and type(value).__module__ == "numpy":
        return f"ndarray:{value.shape}:{value.dtype.str}:{hashlib.sha256(value.tobytes()).hexdigest()}"
    if (walked is not None and id(value) in walked) or type(value).__module__.partition(".")[0] == "shapecache":
        return f"object:{_class_name(type(value))}"  # (shapecache's own: the cache, as installed on a module)
    raise NotPortable(f"a {_class_name(type(value))} the guard holds by identity")


def _function(function: types.FunctionType, walked: set | None, depth: int) -> str:
    """A function by its name, code, defaults and closure (a decorator's wrapper holds what it
    wraps there); a library's by its name and closure."""
    module = str(getattr(function, "__module__", None) or "")
    parts = [f"function:{module}.{function.__qualname__}"]
    if module.partition(".")[0] not in called_code.LIBRARIES:
        parts.append(_code(function.__code__))
        parts.append(_value(function.__defaults__, walked, depth - 1))
        parts.append(_value(function.__kwdefaults__, walked, depth - 1))
    for cell in function.__closure__ or ():
        try:
            parts.append(_value(cell.cell_contents, walked, depth - 1))
        except ValueError:  # an empty cell
            parts.append("empty")
    return "|".join(parts)


@functools.lru_cache(maxsize=4096)
def _code(code: types.CodeType) -> str:
    """A digest of what `code` does, without where it was read from (its file and lines)."""
    digest = hashlib.sha256()
    for part in (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                 code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags):
        digest.update(repr(part).encode() + b"\0")
    for constant in code.co_consts:
        digest.update((_code(constant) if isinstance(constant, types.CodeType) else _value(constant)).encode() + b"\0")
    return digest.hexdigest()


def _attribute(value) -> str:
    """A class's attribute: a function, a property or a static or class method by its
    functions; a plain value as a value; any other object (a descriptor, a class-wide
    registry) by its class, which is what the guard sees change of it within a process."""
    if isinstance(value, (staticmethod, classmethod)):
        return f"{type(value).__name__}({_attribute(value.__func__)})"
    if isinstance(value, property):
        return f"property({','.join(_attribute(f) for f in (value.fget, value.fset, value.fdel))})"
    if isinstance(value, functools.cached_property):
        return f"cached_property({_attribute(value.func)})"
    try:
        return _value(value)
    except NotPortable:
        return f"object:{_class_name(type(value))}"


_tensor_digests = WeakIdKeyDictionary()  # tensor -> (what it was hashed at, its digest)


def _tensor(tensor: torch.Tensor) -> str:
    """A tensor by its dtype, shape, strides, offset and bytes: hashed once per version, data
    and layout (a weight is hashed once for every bucket). Raises NotPortable for a tensor
    whose bytes are not on the CPU, or which keeps no version (an inference tensor)."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise NotPortable(f"a {tensor.device.type} {tensor.layout} tensor")
    try:
        at = (tensor._version, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride(),
              tensor.storage_offset(), tensor.requires_grad)
    except RuntimeError as error:  # an inference tensor keeps no version
        raise NotPortable("an inference tensor, which keeps no version") from error
    known = _tensor_digests.get(tensor)
    if known is not None and known[0] == at:
        return known[1]
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    digest = f"tensor:{at[2:]}:{hashlib.blake2b(memoryview(data), digest_size=20).hexdigest()}"
    _tensor_digests[tensor] = (at, digest)
    return digest


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _output(layout: OutputLayout) -> dict:
    """The output's layout as the record holds it."""
    constants = list(layout.constants)
    if not all(type(c) in (type(None), bool, int, float, str) for c in constants):
        raise NotPortable("the output holds a constant JSON cannot hold")
    try:
        spec = _pytree.treespec_dumps(layout.spec)
    except Exception as error:  # noqa: BLE001  (pytree's failures for a type it cannot name share no base class)
        raise NotPortable(f"the output's structure cannot be named ({error})") from error
    return {"spec": spec, "constants": constants, "tensors": list(layout.tensor_positions)}


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


def _weight_name(name: str, tensor: torch.Tensor, leaves: list) -> str:
    """`name` (the traced program's, ``owned.<i>.<path>``) where it names `tensor` among the
    call's modules (`leaves`)."""
    if _weight(name, leaves) is not tensor:
        raise NotPortable(f"the graph reads {name}, which is no weight of the call's modules")
    return name


def _weight(name: str, leaves: list) -> torch.Tensor | None:
    """The parameter or buffer the traced program names `name` (``owned.<i>.<path>``: the i-th
    module among the call's arguments), or None."""
    owned, _, rest = name.partition(".")
    position, _, path = rest.partition(".")
    modules = [leaf for leaf in leaves if isinstance(leaf, torch.nn.Module)]
    if owned != "owned" or not position.isdigit() or int(position) >= len(modules):
        return None
    module = modules[int(position)]
    found = dict(module.named_parameters(remove_duplicate=False))
    found.update(module.named_buffers(remove_duplicate=False))
    return found.get(path)


def _module_name(module_globals: dict, reads: dict) -> list:
    """[the name of the module whose globals `module_globals` are, its `reads`]."""
    name = module_globals.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    if module is None or vars(module) is not module_globals:
        raise NotPortable(f"code ran with globals of no imported module ({name!r})")
    return [name, {global_name: sorted(attributes, key=lambda a: (a is not None, a or ""))
                   for global_name, attributes in reads.items()}]


def _resolved(record: dict, roots: dict, leaves: list) -> tuple:
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
        if (tensor := _weight(name, leaves)) is None:
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
        copy = store.sealed_copy(name, "call index record")
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
    except (OSError, ValueError, KeyError, RecursionError, zipfile.BadZipFile) as error:
        logger.warning("shapecache: the call index's %s is not read (%s); the call is traced", name, error)
        return None
    finally:
        with contextlib.suppress(OSError):
            os.remove(copy)


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
        with contextlib.suppress(OSError):
            os.remove(source)
