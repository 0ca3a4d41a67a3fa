"""The trace of a call: ``torch.export`` captures the call once at its bucket's shapes, every
shape static, and ``trace_call`` returns a ``Trace``: the exported program, the tensors it reads,
the output's layout, the guard record, the state the build started from. What the call does
that a graph cannot keep is raised as a refusal (ExportFailed, WritesState,
ReadsUnguardedState), and the user's objects are left as the plain call leaves them
(trace_copies.py). Nothing here knows where or how the graph compiles (compilers.py).

Why export and not ``torch.compile`` (Dynamo): every compiled frame of Dynamo stays reachable
from the process after its entry is dropped (Dynamo installs the graph in the frame's globals,
guards watch guarded objects with finalizers), so an evicted bucket's memory is never
returned; with inductor's freezing that is a copy of the weights per bucket. shapecache's key
already is the guard: an entry serves exactly one bucket's shapes, dtypes, devices and
constant arguments, so Dynamo's guards and recompiles add nothing. A call that export cannot
capture whole (data-dependent control flow, unsupported operators) is built by Dynamo instead
(compile.py), which handles graph breaks.

The trace never touches the live model: it traces detached copies of the module trees among
the arguments (trace_copies.DetachedTrees). A cached submodule's copy runs its own forward, so
the trace is one graph and builds nothing for the submodule.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import random
import re
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from shapecache import _background
from shapecache._backends import called_code, guards, tracing_threads
from shapecache._backends.entry import described
from shapecache._backends.trace_copies import DetachedTrees, LiveTensors, changed_items, is_leftover, put_back_shared, snapshot
from shapecache._extension import _C

tracing_threads.install()  # a trace here must not capture other threads' module calls


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


def effects(program: torch.export.ExportedProgram) -> str:
    """What running `program` does besides computing its outputs, in words; "" for nothing: it
    writes into a buffer of the model or a tensor it was given (BatchNorm's running statistics
    in training, an input updated in place), or draws random numbers (dropout in training),
    whose draws a compiled graph makes differently from the plain call. Read from the program
    functionalized (its in-place writes show only then, as in compile_process), which traces
    the graph once more."""
    with torch.no_grad():
        functional = program.run_decompositions(decomp_table={})
    signature = functional.graph_signature
    if getattr(signature, "parameters_to_mutate", None):
        return f"writes the parameter {_user_name(sorted(signature.parameters_to_mutate.values())[0])}"
    if signature.buffers_to_mutate:
        return f"writes the buffer {_user_name(sorted(signature.buffers_to_mutate.values())[0])}"
    if signature.user_inputs_to_mutate:
        return f"writes its input {sorted(signature.user_inputs_to_mutate.values())[0]}"
    for node in functional.graph.nodes:
        if _draws(node):
            return f"draws random numbers ({node.target.name()})"
    return ""


def _user_name(name: str) -> str:
    """A weight's name as the user's module names it (the traced call holds the modules it was
    given under ``owned.<position>``)."""
    return re.sub(r"^owned\.\d+\.", "", name)


def _draws(node: torch.fx.Node) -> bool:
    """Whether `node` draws random numbers: an operator torch tags as seeded, unless its draws
    are turned off by its own arguments, as attention's and dropout's are by a probability of 0,
    or dropout's and rrelu's by `train` or `training` False (scaled_dot_product_attention is
    tagged for its dropout_p, which inference leaves at 0)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for position, argument in enumerate(target._schema.arguments):
        if argument.name in node.kwargs:
            value = node.kwargs[argument.name]
        elif position < len(node.args) and not argument.kwarg_only:
            value = node.args[position]
        else:
            value = argument.default_value if argument.has_default_value() else None
        if argument.name in ("dropout_p", "p") and isinstance(value, (int, float)) and value == 0:
            return False
        if argument.name in ("train", "training") and value is False:
            return False
    return True



# How long a trace that runs alone waits for the runs of user code in progress on other
# threads to end, before it traces beside them (_apart_from_other_threads).
DRAIN_S = 10.0
# Functions whose trace wrote Python state the live model shares: their later traces run alone.
_writes_state: weakref.WeakSet = weakref.WeakSet()


class _Apart:
    """Whether another thread ran user code during a trace (trace_gate.h), and (``wrote``, set
    by the trace) whether it wrote Python state the live model shares."""

    def __init__(self):
        self.wrote = False
        self._before = _C.runs_elsewhere()

    def others_ran(self) -> bool:
        """Whether another thread ran user code (through shapecache) during the trace: it may
        have written what the trace wrote. (Alone, none did, unless one waited at the gate
        past its bound: trace_gate.h.)"""
        started, in_progress = _C.runs_elsewhere()
        return started != self._before[0] or in_progress > 0 or self._before[1] > 0


@contextlib.contextmanager
def _apart_from_other_threads(function):
    """Yields an _Apart for a trace of `function`.

    A trace of a function whose earlier trace wrote Python state the live model shares (a
    counter in a global, a list a helper appends to) runs alone: no other thread starts a run
    of user code through shapecache until the trace's writes are put back (it waits up to
    DRAIN_S for those in progress), so what it wrote is undone exactly.

    Any other trace runs beside the other threads, which are counted: most functions write no
    such state, and keeping their callers waiting for a trace (seconds for a UNet) would stall
    every request served meanwhile. Where such a trace wrote state while another thread ran the
    model's code, the write cannot be told from that thread's: it is left as it is, never
    undone over that thread's, and said in a warning (the bucket runs uncached)."""
    try:
        alone = function in _writes_state
    except TypeError:  # (not weakly referenceable)
        alone = False
    apart = None
    try:  # (the close inside: a KeyboardInterrupt as it returns must not leave the gate closed)
        if alone:
            _C.close_trace_gate(DRAIN_S)  # not alone after all: others_ran says so
        apart = _Apart()
        yield apart
    finally:
        if alone:
            _C.open_trace_gate()  # (nothing where this thread did not close it)
        if apart is not None and apart.wrote:
            with contextlib.suppress(TypeError):
                _writes_state.add(function)


def _changed(shared: list, written: list | None) -> bool:
    """Whether the trace wrote into any of the shared containers, less its own leftovers
    (trace_copies.is_leftover): their items as the traced call ended (`written`; where it did
    not end, now) against those before it."""
    return any(not is_leftover(key, value)
               for i, (container, before) in enumerate(shared)
               for key, value in changed_items(before, written[i] if written is not None else snapshot(container)))


@dataclass
class Trace:
    """A call traced at its bucket's shapes: what a compiler compiles and the entry is made of."""

    program: torch.export.ExportedProgram  # the call as one graph over its tensors
    graph: torch.fx.GraphModule  # program.module(): what inductor compiles
    tensors: tuple  # the call's tensors in key order: the graph's inputs, as the runner is given them
    device: torch.device | None  # the one device of `tensors`; None where they are on several
    roots: dict  # the call's module trees by path (guards.call_roots)
    read: list  # (name, tensor) of the parameters, buffers and constants the graph reads
    # The record of what the graph was built from (guards.py): the cache makes the entry's guard
    # from it before the entry's first run, so that a run that moves a tensor the graph reads
    # (BatchNorm's running statistics in training) is seen.
    guard: object  # a guards.GuardRecord
    # The guard over the live state the trace started from, recorded before anything was copied
    # from it: if it no longer holds when the entry is made, another thread changed the model
    # during the build, and the entry starts stale.
    built_from: object
    rebuild: Callable | None  # puts the output's tensors back into its structure; None: one tensor
    output: OutputLayout  # the output's structure and its leaves other than tensors
    # The graph reads weights of the model (its own tensors, not constants of the call) that are
    # inference tensors: they keep no version counter (compilers.choose_route then reads them
    # where they are, not as frozen copies).
    reads_inference_weights: bool
    # What random numbers the trace drew outside torch (_random_drawn_outside_torch), which
    # the graph holds as constants; "" for none.
    draws_outside_torch: str
    # What `guard` was made of besides `read` (guards.record's `reached` and `called`): the ids
    # of the modules whose forward ran, the (module globals, reads) of the code that ran.
    # Another process makes the same guard from them, by name (call_index.py).
    reached: set
    reads: list
    # The names of the constants the traced call made (an int timestep's tensor): lifted into
    # the graph (_lifted), held by nothing of the model's; the call's arguments and code make
    # them again.
    made_by_the_call: frozenset


def trace_call(function: Callable, args: tuple, kwargs: dict, tensors: tuple, roots: dict, parameter_names: tuple,
               has_owner: bool) -> Trace:
    """The trace of `function` called with `args` and `kwargs`. `tensors` are the call's tensors
    in key order (``BuildHandle.tensors``); `roots` its module trees (guards.call_roots). Run
    under ``_background.build_lock()``, inside ``dropping_tracing_leftovers()``.

    Raises ExportFailed where the call cannot be captured as one graph, WritesState where it
    writes Python state a graph would not write again, ReadsUnguardedState where it reads
    inference tensors the graph would bake in as constants."""
    before = guards.guard(roots, functions=[function])
    leaves, spec = tree_flatten((args, kwargs))
    tensor_positions = _positions_of(tensors, leaves)
    copies = DetachedTrees()
    traced = [copies.of(leaf) if isinstance(leaf, torch.nn.Module) else leaf for leaf in leaves]
    module = _Call(function, traced, spec, tensor_positions)
    copy_roots = {path: copies.of(leaf) for path, leaf in roots.items()}
    shared: list = []  # the dicts and lists the copies share with the live model (and their own)
    module.trace.python_state = guards.guard(copy_roots, functions=[function], python_only=True, collect=shared)
    module.trace.shared = [(container, snapshot(container)) for container in shared]

    # The trace may reach the live model after all (a hook registry's forward is bound to the
    # live module and calls `module.to()` on it): its parameters and buffers are put back.
    live_tensors = LiveTensors(roots)  # under the build lock: no other trace is leaving fakes in them
    random_before = _random_states_outside_torch()
    called = None
    interrupted = False
    with _apart_from_other_threads(function) as apart:
        try:
            with called_code.recording_calls() as called, _quiet_export():  # the globals the traced code reads
                program = torch.export.export(module, tensors, strict=False)
            graph = program.module()
        except Exception as error:  # noqa: BLE001  (export's failures share no base class)
            raise ExportFailed(described(error)) from error
        except BaseException:  # KeyboardInterrupt: it reaches the caller as the call's own
            interrupted = True
            raise
        finally:
            # What the trace wrote is put back, unless that could undo another thread's write,
            # or the trace was the call (interrupted, its exception is the caller's): then it
            # stays, but for a container or object holding a leftover of the trace (a fake
            # tensor), which is put back whole.
            keep = interrupted or apart.others_ran()
            apart.wrote = _changed(module.trace.shared, module.trace.written)
            put_back_shared(module.trace.shared, module.trace.written, keep_writes=keep)
            replaced = live_tensors.put_back()
            globals_written = called.put_back(keep_writes=keep) if called is not None else []
            apart.wrote = bool(apart.wrote or globals_written or replaced or module.trace.state_written)
            kept = keep and not interrupted and apart.wrote
    if kept:
        raise WritesState(f"{module.trace.state_written or ', '.join(globals_written[:3]) or 'Python state'}, and "
                          "another thread ran the model's code during the trace, so what the trace wrote is left as "
                          "it is (undoing it could undo that thread's write)")
    if globals_written:
        raise WritesState(f"{', '.join(globals_written[:3])} (read by the code it calls)")
    if replaced:
        raise WritesState(f"the parameters or buffers of the live model ({', '.join(replaced[:3])}; "
                          "module.to() in a hook)")
    if module.trace.state_written:
        raise WritesState(module.trace.state_written)
    reached = {id(copies.live(module)) for module in copies.ran.values()}
    read = _tensors_read(program)
    reads = called.reads() if called is not None else []
    guard = guards.record(roots, functions=[function], reached=reached, tensors=read, called=reads)
    # Inference tensors keep no version counter, so no guard sees them updated in place. A
    # module's own (its weights, attributes) are read where they are once freezing is off;
    # a lifted one (_lifted) the code holds is a constant of the graph whatever freezing
    # says, and its bucket is refused; one the call made (an int timestep's tensor) is fine.
    lifted = [(name, tensor) for name, tensor in read if _lifted(name)]
    held = _tensors_in([function, *leaves, *(container for container, _ in module.trace.shared),
                        *(called.values() if called else [])]) if lifted else set()
    baked = [name for name, tensor in lifted if tensor.is_inference() and id(tensor) in held]
    if baked:
        raise ReadsUnguardedState(", ".join(baked[:3]))
    inference = [(name, tensor) for name, tensor in read if tensor.is_inference()]
    layout = module.trace.output_layout
    draws_outside_torch = _random_drawn_outside_torch(random_before)
    devices = {tensor.device for tensor in tensors} or {torch.device("cpu")}
    return Trace(program=program, graph=graph, tensors=tuple(tensors), device=devices.pop() if len(devices) == 1 else None,
                 roots=roots, read=read, guard=guard, built_from=before,
                 rebuild=None if layout.is_one_tensor() else layout.rebuild, output=layout,
                 reads_inference_weights=any(not _lifted(name) for name, _ in inference),
                 draws_outside_torch=draws_outside_torch, reached=reached, reads=reads,
                 made_by_the_call=frozenset(name for name, tensor in lifted if id(tensor) not in held))


def _random_states_outside_torch() -> tuple:
    """The states of Python's and (where it is imported) numpy's global random numbers."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def _random_drawn_outside_torch(before: tuple) -> str:
    """What random numbers the trace drew outside torch since `before` (a layer skipped at
    random, a scale from numpy): the graph would hold the trace's draws as constants. "" for
    none. (Another thread's draws meanwhile count too.)"""
    after = _random_states_outside_torch()
    if after[0] != before[0]:
        return "draws Python's random numbers (the random module), which a graph holds as constants"
    if before[1] is not None and after[1] is not None:
        import numpy

        # (the legacy state: the generator's name, its key array, position and cached normal)
        if not all(numpy.array_equal(x, y) for x, y in zip(before[1], after[1], strict=True)):
            return "draws numpy's random numbers, which a graph holds as constants"
    return ""


@contextlib.contextmanager
def _quiet_export():
    """Silences export's notes on how it traced (not the user's concern), where this thread may:
    warnings.catch_warnings swaps the process's filters, so on a background build's worker,
    which runs beside the threads that serve, it would silence their warnings too, or leave
    "ignore" behind when their own catch_warnings blocks interleave with it."""
    if _background.on_a_worker():
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def dropping_tracing_leftovers():
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



_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks")


def hooks_a_graph_drops(function: Callable, args: tuple, roots: dict, has_owner: bool) -> list[str]:
    """The forward hooks and pre-hooks that are not torch's own (an activation collector, a
    probe) on the modules of the call's trees (`roots`, guards.call_roots) and those the
    function's globals and closures hold, and the global ones, named: a trace would run them
    once, on fake tensors, and a graph never again. Those of the module whose forward is cached
    are not among them: its own ``__call__`` runs them around the cache, on every call."""
    from torch.nn.modules import module as module_globals

    found = [f"a global forward hook ({_name_of(hook)})" for name in _GLOBAL_HOOK_DICTS
             for hook in getattr(module_globals, name, {}).values() if not _torchs_own(hook)]
    owner = args[0] if has_owner and args else None
    roots = dict(roots)  # with the modules the function reaches, for this look only
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
        self.trace.written = [snapshot(container) for container, _ in self.trace.shared]
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
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    @classmethod
    def of(cls, spec, constants: list, tensor_positions: list[int]) -> OutputLayout:
        """The layout of an output with structure `spec`, leaves `constants` (None where a
        tensor goes) and its tensors at `tensor_positions` among them."""
        layout = cls.__new__(cls)
        layout.spec, layout.constants, layout.tensor_positions, layout.tensors = spec, constants, tensor_positions, None
        return layout

    def is_one_tensor(self) -> bool:
        return self.spec.is_leaf() and len(self.tensor_positions) == 1

    def rebuild(self, tensors):
        leaves = list(self.constants)
        for position, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        return tree_unflatten(leaves, self.spec)

