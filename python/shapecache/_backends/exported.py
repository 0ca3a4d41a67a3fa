"""A bucket built as one graph: ``torch.export`` captures the call at its shapes, inductor
compiles the graph, and evicting the entry gives its memory back.

Why not ``torch.compile`` (Dynamo): every compiled frame of Dynamo stays reachable from the
process after its entry is dropped (Dynamo installs the graph in the frame's globals, guards
watch guarded objects with finalizers), so an evicted bucket's memory is never returned; with
inductor's freezing that is a copy of the weights per bucket. shapecache's key already is the
guard: an entry serves exactly one bucket's shapes, dtypes, devices and constant arguments, so
Dynamo's guards and recompiles add nothing. ``torch.export(strict=False)`` traces the call
once at the bucket's shapes (every shape static), ``compile_fx`` compiles it, and the runner
is the only holder of the result, except for one cache of inductor's: ``PyCodeCache.modules``
keeps every generated module it loads, with the compiled graph's constants (frozen weights)
as module attributes, for the life of the process. The modules a build loads are recorded
and removed from that cache (and from ``sys.modules``) when the runner is freed.

A call that torch.export cannot capture whole (data-dependent control flow, unsupported
operators) is built by Dynamo instead (compile.py), which handles graph breaks.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from collections.abc import Callable

import torch
from torch._guards import tracing
from torch.utils._pytree import tree_flatten, tree_unflatten

# Builds of this route change inductor's configuration for their duration (config.patch is
# process-wide) and attribute the modules inductor loads meanwhile to one entry: one at a time.
_build_lock = threading.RLock()

# torch.compile arguments this route understands; any other (a backend other than inductor,
# a mode that captures CUDA graphs) goes to Dynamo.
_MODES = (None, "default", "max-autotune-no-cudagraphs")


def handles(compile_options: dict) -> bool:
    """Whether this route builds with `compile_options` (keyword arguments of torch.compile)."""
    if set(compile_options) - {"options", "mode", "fullgraph"}:
        return False
    return compile_options.get("mode") in _MODES


class ExportFailed(Exception):
    """torch.export could not capture the call as one graph (the cause is chained)."""


def compile_call(function: Callable, args: tuple, kwargs: dict, parameter_names: tuple, has_owner: bool,
                 compile_options: dict) -> Callable:
    """A runner for later calls of `function` spelled like this one, and at these shapes.

    Raises ExportFailed when the call cannot be captured as one graph; inductor's own errors
    propagate.
    """
    leaves, spec = tree_flatten((args, kwargs))
    tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    module = _Call(function, leaves, spec, tensor_positions)
    tensors = tuple(leaves[i] for i in tensor_positions)
    options = dict(compile_options.get("options") or {})
    mode = compile_options.get("mode")
    if mode not in (None, "default"):
        options = {**torch._inductor.list_mode_options(mode), **options}

    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    with _build_lock:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # export's notes on how it traced are not the user's concern
                graph = torch.export.export(module, tensors, strict=False).module()
        except Exception as error:  # noqa: BLE001  (export's failures share no base class)
            raise ExportFailed(f"{type(error).__name__}: {_first_line(error)}") from error
        # AOT autograd's own cache is off for these builds: its key pickles the exported module,
        # whose closures do not pickle, so it never hits and logs a traceback on every build;
        # inductor's FX graph cache below it is what a second process reads.
        with (_loaded_modules() as loaded, inductor_config.patch(options), tracing(_static_context()),
              functorch_config.patch(enable_autograd_cache=False)):
            compiled = compile_fx(graph, list(tensors), ignore_shape_env=True)
        del graph

    runner = _runner(compiled, function, args, kwargs, parameter_names, has_owner, tensor_positions)
    weakref.finalize(runner, _forget_modules, loaded)
    return runner


_warmed_up: set[str] = set()  # compile options the compiler has started up with in this process


def warm_up(compile_options: dict) -> None:
    """Builds and runs a small graph of the operators diffusion models use, once per process and
    set of compile options, and drops it: inductor's one-time start-up (the modules it imports,
    its caches, the kernel runtime) then happens outside the first entry's measurement
    (host_memory.py). A failure here is left for the real build to raise."""
    key = repr(sorted(compile_options.items(), key=repr))
    with _build_lock:
        if key in _warmed_up:
            return
        _warmed_up.add(key)
        module = _WarmUp().eval()
        sample = torch.randn(1, 4, 8, 8)
        try:
            runner = compile_call(_WarmUp.forward, (module, sample), {}, ("sample",), True, compile_options)
            runner(module, sample)
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

    def forward(self, *tensors):
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        return self.function(*args, **kwargs)


def _runner(compiled, function, args, kwargs, parameter_names, has_owner, tensor_positions) -> Callable:
    """``run(*args, **kwargs)``: the compiled graph of the call's tensors.

    Calls that share the entry have the same key, so the same arguments with the same values
    and shapes, but they may spell them differently (a parameter passed by position here, by
    keyword there); such a call is first spelled as the build's was."""
    count = len(args)
    keywords = tuple(kwargs)
    keyword_set = frozenset(keywords)
    offset = 1 if has_owner else 0
    names = parameter_names

    def respell(call_args, call_kwargs):
        if len(call_args) - offset > len(names):  # a *args tail is only ever spelled by position
            return None
        named = dict(zip(names, call_args[offset:], strict=False))  # fewer arguments than names
        if named.keys() & call_kwargs.keys():
            return None
        named.update(call_kwargs)
        positional = list(call_args[:offset])
        for name in names[:count - offset]:
            if name not in named:
                return None
            positional.append(named.pop(name))
        if set(named) != keyword_set:
            return None
        return tuple(positional), {k: named[k] for k in keywords}

    def run(*call_args, **call_kwargs):
        if len(call_args) != count or call_kwargs.keys() != keyword_set:
            respelled = respell(call_args, call_kwargs)
            if respelled is None:  # cannot happen for calls with this entry's key; never answer wrongly
                return function(*call_args, **call_kwargs)
            call_args, call_kwargs = respelled
        leaves, _ = tree_flatten((call_args, {k: call_kwargs[k] for k in keywords}))
        return compiled(*[leaves[i] for i in tensor_positions])

    return run


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


def disk_cache_counts() -> tuple[int, int, int]:
    """Inductor's FX graph cache so far in this process: (hits, misses, bypasses). A build that
    adds a hit was read from the on-disk cache ("warm"); a miss compiled and wrote it ("cold").
    Before anything compiled, torch._dynamo is not loaded, and the counts are zero."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0, 0, 0
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"], inductor["fxgraph_cache_bypass"]


def disk_cache_state(before: tuple[int, int, int]) -> str | None:
    """"warm", "cold" or "not cached" for the builds since `disk_cache_counts()` was `before`;
    None when nothing was compiled meanwhile."""
    hits, misses, bypasses = (now - then for now, then in zip(disk_cache_counts(), before, strict=True))
    if misses:
        return "cold"
    if hits:
        return "warm"
    return "not cached" if bypasses else None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
