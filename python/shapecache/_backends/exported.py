"""A bucket built as one graph: ``torch.export`` captures the call at its shapes, inductor
compiles the graph, and evicting the entry gives its memory back.

Why not ``torch.compile`` (Dynamo): every compiled frame of Dynamo stays reachable from the
process after its entry is dropped (Dynamo installs the graph in the frame's globals, guards
watch guarded objects with finalizers), so an evicted bucket's memory is never returned; with
inductor's freezing that is a copy of the weights per bucket. shapecache's key already is the
guard: an entry serves exactly one bucket's shapes, dtypes, devices and constant arguments, so
Dynamo's guards and recompiles add nothing. ``torch.export(strict=False)`` traces the call
once at the bucket's shapes (every shape static), ``compile_fx`` compiles it, and the entry's
runner is the only holder of the compiled graph, except for one cache of inductor's:
``PyCodeCache.modules`` keeps every generated module it loads, with the compiled graph's
constants (frozen weights) as module attributes, for the life of the process. The modules a
build loads are recorded and removed from that cache (and from ``sys.modules``) when the
compiled graph is freed.

A call that torch.export cannot capture whole (data-dependent control flow, unsupported
operators) is built by Dynamo instead (compile.py), which handles graph breaks.

The trace never touches the live model. Non-strict export swaps fake tensors into the
modules it traces, so it traces a detached copy of each module tree among the arguments:
new module objects whose dicts are copies, sharing the live tensors and plain objects. Any
thread may call the model, its submodules or the cache meanwhile. A cached submodule's copy
runs its own forward, so the trace is one graph and builds nothing for the submodule.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import shutil
import sys
import threading
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch._guards import tracing
from torch.utils._pytree import tree_flatten, tree_unflatten

from shapecache._backends import called_code, compile_process, guards, shared_packages, tracing_threads
from shapecache._extension import _C
from shapecache._holder import holder_on
from shapecache._host_memory import memory_of, memory_ranges

# Builds of this route change inductor's configuration for their duration (config.patch is
# process-wide) and attribute the modules inductor loads meanwhile to one entry: one at a time.
_build_lock = threading.RLock()


def _new_build_lock() -> None:
    # A child forked while another thread built holds a copy of a lock nobody will release.
    global _build_lock
    _build_lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_build_lock)

tracing_threads.install()  # a trace here must not capture other threads' module calls


def quiet_warnings_here() -> bool:
    """Whether this thread may silence warnings around a trace: warnings.catch_warnings swaps
    the process's filters, so on a background build's worker, which runs beside the threads
    that serve, it would silence their warnings too, or leave "ignore" behind when their own
    catch_warnings blocks interleave with it."""
    from shapecache import _build_workers

    return not _build_workers.on_a_worker()

# torch.compile arguments this route understands; any other (a backend other than inductor,
# a mode that captures CUDA graphs) goes to Dynamo.
_MODES = (None, "default", "max-autotune-no-cudagraphs")


def handles(compile_options: dict) -> bool:
    """Whether this route builds with `compile_options` (keyword arguments of torch.compile)."""
    if set(compile_options) - {"options", "mode", "fullgraph"}:
        return False
    return compile_options.get("mode") in _MODES


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks")


def hooks_a_graph_drops(function: Callable, args: tuple, kwargs: dict, has_owner: bool, parameter_names) -> list[str]:
    """The forward hooks and pre-hooks that are not torch's own (an activation collector, a
    probe) on the modules among the call's arguments and those the function's globals and
    closures hold, and the global ones, named: a trace would run them once, on fake tensors,
    and a graph never again. Those of the module whose forward is cached are not among them:
    its own ``__call__`` runs them around the cache, on every call."""
    from torch.nn.modules import module as module_globals

    found = [f"a global forward hook ({_name_of(hook)})" for name in _GLOBAL_HOOK_DICTS
             for hook in getattr(module_globals, name, {}).values() if not _torchs_own(hook)]
    owner = args[0] if has_owner and args else None
    roots = guards.call_roots(args, kwargs, has_owner, parameter_names)
    guards.Guarded(python_only=True).function(function, "function", roots)  # adds the modules found there
    looked_at: set[int] = set()
    for path, root in roots.items():
        for name, module in root.named_modules(remove_duplicate=True):
            if module is owner or id(module) in looked_at:
                continue
            looked_at.add(id(module))
            for hooks in _HOOK_DICTS:
                found += [f"{path}.{name}".rstrip(".") + f" ({_name_of(hook)})"
                          for hook in getattr(module, hooks, {}).values() if not _torchs_own(hook)]
    return found


def _torchs_own(hook) -> bool:
    """Whether `hook` is torch's (or shapecache's own, the tuning records' flush)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    function = getattr(hook, "__func__", hook)  # a bound method
    defined_in = str(getattr(function, "__module__", None) or type(function).__module__)
    return defined_in.split(".")[0] in ("torch", "shapecache")


def _name_of(hook) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


class ExportFailed(Exception):
    """torch.export could not capture the call as one graph (the cause is chained)."""


class ReadsUnguardedState(Exception):
    """The traced call reads an inference tensor that the model or its code keeps outside its
    parameters and buffers (in a list, a dict, a global): export bakes it into the graph as a
    constant, and without a version counter no guard sees it updated in place."""


class WritesState(Exception):
    """The traced call wrote Python state of the model (a step counter), which a graph would
    not write again on later calls (export puts it back after tracing, so it is checked at the
    end of the traced call itself)."""


class CompiledCall(NamedTuple):
    """A bucket's compiled graph, as the cache makes its entry from it (BuiltEntry)."""

    graph: Callable  # the call's tensors in key order -> the output's tensors
    rebuild: Callable | None  # puts the output's tensors back into its structure; None: one tensor
    # The record of what the graph was built from (guards.py): the cache makes the entry's guard
    # from it before the entry's first run, so that a run that moves a tensor the graph reads
    # (BatchNorm's running statistics in training) is seen.
    guard: list
    # The guard over the live state the trace started from, recorded before anything was
    # copied from it: if it no longer holds when the entry is made, another thread changed
    # the model during the build, and the entry starts stale.
    built_from: object
    # The tensors the compiled modules hold that the model does not (freezing's folded and
    # packed weights): what the entry holds, measured whatever other threads do meanwhile.
    constants: list
    # Bytes the graph holds besides `constants` (a package's constants, compile_process.py).
    constant_bytes: int = 0


def compile_call(function: Callable, args: tuple, kwargs: dict, tensors: tuple, parameter_names: tuple,
                 has_owner: bool, compile_options: dict, in_background: bool = False, share: bool = True) -> CompiledCall:
    """The compiled graph of later calls of `function` spelled like this one, at these shapes.
    `tensors` are the call's tensors in key order (``BuildHandle.tensors``): the graph's
    inputs, as the runner is given them on every hit. `in_background`: the build runs on a
    background worker, where a frozen graph is compiled in a process of its own
    (compile_process.py). `share`: a frozen graph is read from, or published to, the shared
    directory where one is set (shared_packages.py).

    Raises ExportFailed when the call cannot be captured as one graph; inductor's own errors
    propagate.
    """
    # The live state the trace starts from, recorded before anything is copied from it: the
    # entry's guard is recorded from the live model after the trace, and if another thread
    # changed it since this point (while the copies were made, during the trace or the
    # compile), the entry starts stale (CompiledCall.built_from).
    roots = guards.call_roots(args, kwargs, has_owner, parameter_names)
    before = guards.guard(roots, functions=[function])
    leaves, spec = tree_flatten((args, kwargs))
    tensor_positions = _positions_of(tensors, leaves)
    copies = DetachedTrees()
    traced = [copies.of(leaf) if isinstance(leaf, torch.nn.Module) else leaf for leaf in leaves]
    module = _Call(function, traced, spec, tensor_positions)
    copy_roots = {path: copies.of(leaf) for path, leaf in roots.items()}
    shared: list = []  # the dicts and lists the copies share with the live model (and their own)
    module.trace.python_state = guards.guard(copy_roots, functions=[function], python_only=True, collect=shared)
    module.trace.shared = [(container, _snapshot(container)) for container in shared]
    options = inductor_options(compile_options)

    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # The trace may reach the live model after all (a hook registry's forward is bound to the
    # live module and calls `module.to()` on it): its parameters and buffers are put back.
    with _build_lock, _dropping_tracing_leftovers():
        live_tensors = _LiveTensors(roots)  # under the lock: no other trace is leaving fakes in them
        called = None
        try:
            with called_code.recording_calls() as called:  # the globals the traced code reads
                if quiet_warnings_here():
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # export's notes on how it traced are not the user's concern
                        program = torch.export.export(module, tensors, strict=False)
                else:
                    program = torch.export.export(module, tensors, strict=False)
            graph = program.module()
        except Exception as error:  # noqa: BLE001  (export's failures share no base class)
            raise ExportFailed(f"{type(error).__name__}: {first_line(error)}") from error
        finally:
            _put_back(module.trace.shared, module.trace.written)
            replaced = live_tensors.put_back()
            globals_written = called.put_back() if called is not None else []
        if globals_written:
            raise WritesState(f"{', '.join(globals_written[:3])} (read by the code it calls)")
        if replaced:
            raise WritesState(f"the parameters or buffers of the live model ({', '.join(replaced[:3])}; "
                              "module.to() in a hook)")
        if module.trace.state_written:
            raise WritesState(module.trace.state_written)
        reached = {id(copies.live(module)) for module in copies.ran.values()}
        read = _tensors_read(program)
        guard = guards.record(roots, functions=[function], reached=reached, tensors=read, called=called)
        # Inference tensors keep no version counter, so no guard sees them updated in place. A
        # module's own (its weights, attributes) are read where they are once freezing is off;
        # a lifted one (_lifted) the code holds is a constant of the graph whatever freezing
        # says, and its bucket is refused; one the call made (an int timestep's tensor) is fine.
        inference = [(name, tensor) for name, tensor in read if tensor.is_inference()]
        if any(_lifted(name) for name, _ in inference):
            held = _tensors_in([function, *leaves, *(container for container, _ in module.trace.shared),
                                *(called.values() if called else [])])
            baked = [name for name, tensor in inference if _lifted(name) and id(tensor) in held]
            if baked:
                raise ReadsUnguardedState(", ".join(baked[:3]))
        if options.get("freezing", inductor_config.freezing) and any(not _lifted(name) for name, _ in inference):
            options["freezing"] = False
            warnings.warn(f"shapecache: inductor's freezing is off for {getattr(function, '__qualname__', function)}: "
                          "its weights are inference tensors (made or loaded under torch.inference_mode()), which "
                          "keep no version counter, so an update in place (load_state_dict) would not be seen in a "
                          "frozen copy; its graphs read the weights where they are. Make and load the model outside "
                          "inference_mode to freeze them.", RuntimeWarning, stacklevel=2)
        layout = module.trace.output_layout
        rebuild = None if layout.is_one_tensor() else layout.rebuild
        package, publication = _packaged(program, options, tensors, in_background, share)
        del program
        if package is not None:
            return CompiledCall(package, rebuild, guard, before, [], package.constant_bytes)
        # AOT autograd's own cache is off for these builds: its key pickles the exported module,
        # whose closures do not pickle, so it never hits and logs a traceback on every build;
        # inductor's FX graph cache below it is what a second process reads.
        try:
            with (_loaded_modules() as loaded, inductor_config.patch(options), tracing(_static_context()),
                  functorch_config.patch(enable_autograd_cache=False)):
                compiled = compile_fx(graph, list(tensors), ignore_shape_env=True)
        except BaseException:
            if publication is not None:
                publication.drop()
            raise
        if publication is not None:  # compiled again for the directory once this compile is done
            publication.hand_over()
        # aot_autograd hangs the traced module's zero_grad, named_parameters and named_buffers
        # on the functions it returns: through them the entry keeps the module's graph, and its
        # nodes' fake values keep their fake mode, which holds a weakref to every weight (see
        # _dropping_tracing_leftovers). The values were the compiler's, and are dropped.
        for submodule in graph.modules():
            if isinstance(submodule, torch.fx.GraphModule):
                for node in submodule.graph.nodes:
                    node.meta.clear()
        # Those bound methods also keep the traced module itself, a cycle (its train and eval
        # are methods bound to it) holding the model's weights: freed only by a second
        # collection after the entry goes, when the model is let go of. Nothing calls them.
        wrapper = compiled
        while wrapper is not None:  # functools.wraps copied them onto each wrapper
            for name in ("zero_grad", "named_parameters", "named_buffers"):
                if getattr(getattr(wrapper, name, None), "__self__", None) is graph:
                    delattr(wrapper, name)
            wrapper = getattr(wrapper, "__wrapped__", None)
        del graph

    weakref.finalize(compiled, _forget_modules, loaded)  # with the last entry that runs it
    return CompiledCall(compiled, rebuild, guard, before, _constants_of(loaded, [t for _, t in read], roots.values()))


def inductor_options(compile_options: dict) -> dict:
    """Inductor's options for torch.compile's `compile_options` (its mode's, then its own)."""
    options = dict(compile_options.get("options") or {})
    mode = compile_options.get("mode")
    if mode not in (None, "default"):
        options = {**torch._inductor.list_mode_options(mode), **options}
    return options


def may_be_packaged(options: dict, device: torch.device, in_background: bool) -> bool:
    """Whether a build with inductor `options` on `device` may end as a package (_packaged):
    compiled in a process of its own, or read from the shared directory."""
    return compile_process.usable(options, device, in_background) or shares_packages(options, device)


def shares_packages(options: dict, device: torch.device) -> bool:
    """Whether a build's package is read from, or published to, the shared directory."""
    return shared_packages.directory() is not None and compile_process.packable(options, device)


def _packaged(program, options: dict, tensors: tuple, in_background: bool, share: bool):
    """(package, publication): `program` as a loaded package (a compile_process.Package), where
    the build may be one: read from the shared directory where it holds the program's package
    (shared_packages.py), else compiled in a process of its own where the build is in the
    background (compile_process.usable). The package is None where the graph is to be compiled
    here: neither applies, or the route failed (with a warning); the publication, where the
    shared directory lacks the package, is the saved program to hand to its publisher once
    this process compiled it (shared_packages.Publication)."""
    devices = {tensor.device for tensor in tensors} or {torch.device("cpu")}
    if len(devices) != 1:
        return None, None
    device = devices.pop()
    elsewhere = compile_process.usable(options, device, in_background)
    shared = share and shares_packages(options, device)
    if not (elsewhere or shared):
        return None, None
    saved = None
    try:
        saved = compile_process.save(program)
        key = _shared_key(saved, options) if shared else None
        if key is not None and (package := shared_packages.load(key)) is not None:
            return package, None
        if not elsewhere:
            publication = None if key is None else shared_packages.Publication(saved, key, options)
            if publication is not None:
                saved = None  # the publication removes it
            return None, publication
        path = compile_process.compile_saved(saved, options)
        package = compile_process.load(path)
        if key is not None:
            shared_packages.publish(key, path)
        return package, None
    except compile_process.Unsuitable:
        return None, None
    except compile_process.Failed as failure:
        if not elsewhere:  # the program could not be saved: compiled here, and not shared
            shared_packages.logger.warning("shapecache: a graph is not shared (%s)", failure)
            return None, None
        where = ("this and later builds of the process compile in the serving process, where they slow"
                 if compile_process.given_up() else "it compiles in the serving process, where it slows")
        warnings.warn(f"shapecache: compiling a background build in a process of its own failed ({failure}); {where} "
                      "the calls served meanwhile", RuntimeWarning, stacklevel=2)
        return None, None
    finally:
        if saved is not None:
            shutil.rmtree(saved, ignore_errors=True)


def _shared_key(saved: str, options: dict) -> str | None:
    """The key of the saved program's package in the shared directory; None, with a warning in
    the log, where it cannot be made: the build goes on as without the directory."""
    try:
        return shared_packages.key(saved, options)
    except Exception as error:  # noqa: BLE001  (a shared directory is never worth a build)
        shared_packages.logger.warning("shapecache: a graph is not shared (%s)", first_line(error))
        return None


class _LiveTensors:
    """The parameters and buffers of the live module trees, to put back the fake tensors a
    trace left in them. The copies have dicts of their own: only code that refers back to a
    live module writes these, as diffusers' hook registry does (its forward is bound to the
    live module, and layerwise casting's hook calls `module.to()` on it). A real tensor
    written meanwhile is another thread's, and is kept."""

    def __init__(self, roots):
        self._dicts = [(f"{path}.{name}".rstrip("."), d, dict(d)) for path, root in roots.items()
                       for name, module in root.named_modules(remove_duplicate=True)
                       for d in (module._parameters, module._buffers)]

    def put_back(self) -> list[str]:
        """Puts back each item the trace replaced with a fake tensor; names them."""
        from torch._subclasses.fake_tensor import is_fake

        changed = []
        for path, d, before in self._dicts:
            for key in [k for k, v in d.items() if v is not before.get(k) and isinstance(v, torch.Tensor) and is_fake(v)]:
                changed.append(f"{path}.{key}")
                old = before.get(key, _ABSENT)
                if old is _ABSENT:
                    d.pop(key, None)
                elif not (isinstance(old, torch.Tensor) and is_fake(old)):  # never a fake one back
                    d[key] = old
        return changed


@contextlib.contextmanager
def _dropping_tracing_leftovers():
    """Drops what torch keeps of the last trace until the next one: export's map of fake
    tensors to graph nodes, and aot_autograd's RNG-state tracker. Both hold fake tensors whose
    fake mode memoizes each real tensor it faked by a weak reference: left alone, every weight
    of the model keeps a weakref, and torch.utils.swap_tensors refuses to swap a tensor that has
    one (module.to() and load_state_dict(assign=True) with
    torch.__future__.set_swap_module_params_on_conversion(True)). The weakrefs go when the
    fake modes are collected (a cycle: the garbage collector runs here, once per build, for
    them and for the rest the trace left: its copies of the model, the exported program)."""
    try:
        yield
    finally:
        from torch._decomp.decompositions_for_rng import PhiloxStateTracker
        from torch.fx.experimental import proxy_tensor

        getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", {}).clear()
        PhiloxStateTracker.reset()
        gc.collect()


def _constants_of(modules: list, read: list, roots) -> list[torch.Tensor]:
    """The tensors `modules` (inductor's, of one compile) hold as attributes, but for those the
    model holds itself (its parameters and buffers, the tensors the graph read)."""
    own = memory_ranges(read)
    for root in roots:
        own.update(memory_ranges((*root.parameters(), *root.buffers())))
    found = {}
    for module in modules:
        for value in vars(module).values():
            memory = memory_of(value) if isinstance(value, torch.Tensor) else None
            if memory is not None and memory[0] not in own:
                found[memory[0]] = value
    return list(found.values())


_ABSENT = object()


def _snapshot(container):
    """The items of a dict or list, as a plain dict or list (a defaultdict's factory is not needed)."""
    return dict(container) if isinstance(container, dict) else list(container)


def _put_back(shared: list, written: list | None) -> None:
    """Puts back what the trace wrote into the dicts and lists the copies share with the live
    model (a helper's lazy cache and its "last length", a list the model appends to): every
    key the trace changed, together, so that none is left out of step with its neighbours.
    `shared`: (container, its items before the trace); `written`: their items as the traced
    call ended (None where it did not end: then what changed by now counts as the trace's).
    A value changed again since the traced call ended is another thread's, and is kept; a
    write another thread made during the trace itself cannot be told from the trace's, and is
    undone with it. The trace's writes are reported by the guard over the Python state, and
    the bucket then runs uncached. No container is emptied on the way: another thread may read
    it meanwhile."""
    for i, (container, before) in enumerate(shared):
        after = written[i] if written is not None else _snapshot(container)
        if isinstance(container, dict):
            for key in [*before, *(k for k in after if k not in before)]:
                old, traced = before.get(key, _ABSENT), after.get(key, _ABSENT)
                if old is traced or container.get(key, _ABSENT) is not traced:
                    continue  # not the trace's change, or changed again since
                if old is _ABSENT:
                    container.pop(key, None)
                else:
                    container[key] = old
        elif (len(after) != len(before) or any(a is not b for a, b in zip(after, before, strict=True))) and (
                len(container) == len(after) and all(a is b for a, b in zip(container, after, strict=True))):
            container[:] = before


def _tensors_read(program) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the parameters, buffers and lifted constants the graph uses (export
    lifts every parameter of the traced modules, used or not)."""
    used = {node.name for node in program.graph.nodes if node.op == "placeholder" and node.users}
    signature = program.graph_signature
    state = {**program.state_dict, **program.constants}
    names = (*signature.inputs_to_parameters.items(), *signature.inputs_to_buffers.items(),
             *signature.inputs_to_lifted_tensor_constants.items())
    return [(name, state[name]) for placeholder, name in names
            if placeholder in used and isinstance(state.get(name), torch.Tensor)]


def _lifted(name: str) -> bool:
    """Whether export named the constant `name` as one no module holds as an attribute:
    ``lifted_tensor_<n>`` (torch/_export/passes/lift_constants_pass.py), a tensor the traced call
    made or one kept in a list, a dict, a global or a closure (_tensors_in tells which)."""
    return name.rpartition(".")[2].startswith("lifted_tensor_")


def _tensors_in(values: list) -> set[int]:
    """The ids of the tensors among `values` and inside the lists, tuples, sets and dicts among
    them, and the closures, defaults and bound objects of the functions, partials and methods
    among them, at any depth (not inside other objects' attributes: the modules' own are
    export's module attributes, and the guard's shared containers hold the rest)."""
    found, seen, stack = set(), set(), list(values)
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.add(id(value))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif isinstance(value, types.FunctionType):
            stack.extend(cell.cell_contents for cell in value.__closure__ or () if _filled(cell))
            stack.extend((value.__defaults__ or (), value.__kwdefaults__ or {}))
        elif isinstance(value, functools.partial):
            stack.extend((value.func, value.args, value.keywords))
        elif isinstance(value, types.MethodType):
            stack.extend((value.__func__, value.__self__))
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def _positions_of(tensors: tuple, leaves: list) -> list[int]:
    """Where each of `tensors` (the call's, in key order) is among the call's flattened leaves."""
    free = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    positions = []
    for tensor in tensors:
        position = next(i for i in free if leaves[i] is tensor)
        free.remove(position)
        positions.append(position)
    if free:  # a tensor the key does not hold cannot be an input of the bucket's graph
        raise ExportFailed(f"{len(free)} tensors of the call are inside objects the key does not read")
    return positions


class DetachedTrees:
    """Copies of module trees for tracing: new module objects whose dicts (attributes,
    parameters, buffers, submodules, hooks) are copies, holding the same tensors and plain
    objects. A module shared in a tree is copied once; a cached module's copy has its own
    forward back. Each copy notes in `ran` when its forward runs (a hook in the copy's own
    hook dict: nothing process-wide, nothing the live model holds)."""

    def __init__(self):
        self._copies: dict[int, torch.nn.Module] = {}  # id(live module) -> its copy
        self._live: dict[int, torch.nn.Module] = {}  # id(copy) -> the live module
        self.ran: dict[int, torch.nn.Module] = {}  # the copies whose forward ran: id -> copy

    def live(self, module: torch.nn.Module) -> torch.nn.Module:
        """The live module of a copy; a module that is no copy (reached through a global) itself."""
        return self._live.get(id(module), module)

    def of(self, module: torch.nn.Module) -> torch.nn.Module:
        copy = self._copies.get(id(module))
        if copy is not None:
            return copy
        copy = object.__new__(type(module))
        self._copies[id(module)] = copy
        self._live[id(copy)] = module
        state = {name: (type(value)(value) if type(value) in (dict, OrderedDict) else value)
                 for name, value in module.__dict__.items()}
        holder = holder_on(module)
        if holder is not None:
            state.pop("_shapecache", None)
            if getattr(holder, "wrapper", None) is state.get("forward"):
                previous = getattr(holder, "previous_forward", None)
                if previous is None:
                    del state["forward"]
                else:
                    state["forward"] = previous
        if isinstance(state.get("forward"), _C.ShapeDispatcher):  # decorated in its class body, bound here
            del state["forward"]
        declared = getattr(type(module), "forward", None)
        if isinstance(declared, _C.ShapeDispatcher):  # the copy runs the decorated function itself
            state["forward"] = types.MethodType(declared.function, copy)
        state["_modules"] = type(state["_modules"])(
            (name, None if child is None else self.of(child)) for name, child in state["_modules"].items())
        object.__setattr__(copy, "__dict__", state)
        copy.register_forward_pre_hook(self._note)
        return copy

    def _note(self, module, _args):
        self.ran[id(module)] = module


_warmed_up: set[str] = set()  # compile options the compiler has started up with in this process


def warm_up(compile_options: dict) -> None:
    """Builds and runs a small graph of the operators diffusion models use, once per process and
    set of compile options, and drops it: inductor's one-time start-up (the modules it imports,
    its caches, the kernel runtime) then happens outside the first entry's measurement
    (shapecache/_host_memory.py). A failure here is left for the real build to raise."""
    key = repr(sorted(compile_options.items(), key=repr))
    with _build_lock:
        if key in _warmed_up:
            return
        _warmed_up.add(key)
        with torch.inference_mode(False):  # a build under inference_mode would make its weights inference tensors
            module = _WarmUp().eval()
            sample = torch.randn(1, 4, 8, 8)
        try:
            compiled = compile_call(_WarmUp.forward, (module, sample), {}, (sample,), ("sample",), True, compile_options,
                                    share=False)
            compiled.graph(sample)
        except Exception:  # noqa: BLE001,S110  (the entry's own build reports what fails)
            pass


class _WarmUp(torch.nn.Module):
    """Convolution, group and layer norm, SiLU and GELU, Linear, and attention."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.group_norm = torch.nn.GroupNorm(2, 8)
        self.layer_norm = torch.nn.LayerNorm(8)
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, sample):
        hidden = torch.nn.functional.silu(self.group_norm(self.conv(sample)))
        tokens = self.linear(self.layer_norm(hidden.flatten(2).transpose(1, 2)))
        attended = torch.nn.functional.scaled_dot_product_attention(tokens, tokens, tokens)
        return torch.nn.functional.gelu(attended)


def _static_context():
    """The tracing context inductor's FX graph cache needs to read and write a build.

    The cache keeps only graphs traced under a shape environment (it stores the guards on
    symbolic sizes with the graph; `_check_shape_env` in torch/_inductor/codecache.py bypasses
    the cache without one), and compile_fx called outside Dynamo makes a fake mode without one.
    This context holds a fake mode with an empty ShapeEnv; `ignore_shape_env=True` keeps every
    input's sizes static (aot_autograd would otherwise make each size a symbol of that
    environment), so the cached graph's guards are empty and the bucket's key is its guard."""
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return TracingContext(FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True))


class _Call(torch.nn.Module):
    """The call as a module of its tensors alone: the other leaves of its arguments (the module
    a method belongs to, ints, strings) are constants of the bucket, as its key holds them.
    Modules among the arguments are registered as submodules, so their weights are the
    graph's parameters (which freezing folds)."""

    def __init__(self, function, leaves, spec, tensor_positions):
        super().__init__()
        self.function = function
        self.leaves = leaves
        self.spec = spec
        self.tensor_positions = tensor_positions
        owned = [leaf for leaf in leaves if isinstance(leaf, torch.nn.Module)]
        self.owned = torch.nn.ModuleList(owned)
        # What the trace learns, on an object of its own: export puts a traced module's
        # attributes back as they were before tracing.
        self.trace = types.SimpleNamespace(
            python_state=None,  # a guard over the Python state the call could read, set before tracing
            state_written=None,  # what the traced call wrote of it
            shared=[],  # (dict or list the copies share with the live model, its items before the trace)
            written=None,  # the items of each of `shared` as the traced call ended
            output_layout=None,  # the output's structure and constants
        )

    def forward(self, *tensors):
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        # The graph returns the output's tensors; its other leaves (a string, a float) are the
        # bucket's constants, kept here and put back around the graph's tensors by the runner.
        output = OutputLayout(self.function(*args, **kwargs))
        self.trace.output_layout = output
        if not self.trace.python_state.check():
            self.trace.state_written = self.trace.python_state.changed
        self.trace.written = [_snapshot(container) for container, _ in self.trace.shared]
        tensors, output.tensors = tuple(output.tensors), None  # the trace's tensors are not kept
        return tensors


_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class OutputLayout:
    """An output split into its tensors and the rest (its structure, its other leaves)."""

    def __init__(self, output):
        leaves, self.spec = tree_flatten(output)
        self.tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self.constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        unknown = [leaf for leaf in self.constants if not isinstance(leaf, _CONSTANT_TYPES)]
        if unknown:  # a number read from tensor data, or an object pytree cannot open (it may hold tensors)
            raise ValueError(f"the output holds {type(unknown[0]).__name__}, which is not a constant of the bucket")
        self._tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def is_one_tensor(self) -> bool:
        return self.spec.is_leaf() and len(self._tensor_positions) == 1

    def rebuild(self, tensors):
        leaves = list(self.constants)
        for position, tensor in zip(self._tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        return tree_unflatten(leaves, self.spec)


@contextlib.contextmanager
def _loaded_modules():
    """Collects the modules inductor's PyCodeCache loads inside the block."""
    from torch._inductor.codecache import PyCodeCache

    before = {id(m) for m in PyCodeCache.modules}
    loaded = []
    try:
        yield loaded
    finally:
        loaded.extend(m for m in PyCodeCache.modules if id(m) not in before)


def _forget_modules(modules: list) -> None:
    """Removes `modules` from inductor's module caches, its line maps and sys.modules, so that
    they and the constants attached to them are freed with the last runner that uses them."""
    from torch._inductor.codecache import PyCodeCache

    gone = {id(m) for m in modules}
    PyCodeCache.modules[:] = [m for m in PyCodeCache.modules if id(m) not in gone]
    for path, module in list(PyCodeCache.modules_no_attr.items()):
        if id(module) in gone:
            PyCodeCache.modules_no_attr.pop(path, None)
    for module in modules:
        if sys.modules.get(module.__name__) is module:
            del sys.modules[module.__name__]
        PyCodeCache.linemaps.pop(getattr(module, "__file__", None), None)  # its source lines and graph nodes
    modules.clear()


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
