"""Inductor in this process (compilers.py): ``compile_fx`` compiles a trace's graph, and the
entry's runner is the only holder of the compiled graph, except for one cache of inductor's:
``PyCodeCache.modules`` keeps every generated module it loads, with the compiled graph's
constants (frozen weights) as module attributes, for the life of the process. The modules a
compile loads are recorded and removed from that cache (and from ``sys.modules``) when the
compiled graph is freed, so evicting the entry gives its memory back.

The first compile of a set of options on the CPU is preceded by a small one (``warm_up``):
inductor's one-time start-up (the modules it imports, its caches, the kernel runtime) is then
no entry's (shapecache/_host_memory.py).
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch
from torch._guards import tracing

from shapecache import _background
from shapecache._backends import guards
from shapecache._backends.compilers import CompiledGraph
from shapecache._backends.trace import Trace, dropping_tracing_leftovers, trace_call
from shapecache._host_memory import memory_of, memory_ranges


class InductorCompiler:
    name = "inductor"

    def compile(self, traced: Trace, options: dict, saved=None) -> CompiledGraph:
        """`traced`'s graph compiled by inductor here. Inductor's own errors propagate."""
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        if traced.device is not None and traced.device.type == "cpu":
            warm_up(options)
        graph = traced.graph
        # AOT autograd's own cache is off for these builds: its key pickles the exported module,
        # whose closures do not pickle, so it never hits and logs a traceback on every build;
        # inductor's FX graph cache below it is what a second process reads.
        with (_loaded_modules() as loaded, inductor_config.patch(options), tracing(_static_context()),
              functorch_config.patch(enable_autograd_cache=False)):
            compiled = compile_fx(graph, list(traced.tensors), ignore_shape_env=True)
        _unhook_traced_module(compiled, graph)
        weakref.finalize(compiled, _forget_modules, loaded)  # with the last entry that runs it
        return CompiledGraph(compiled, _constants_of(loaded, [t for _, t in traced.read], traced.roots.values()))


INDUCTOR = InductorCompiler()


def _unhook_traced_module(compiled, graph: torch.fx.GraphModule) -> None:
    """Lets the compiled graph go without the traced module. aot_autograd hangs the traced
    module's zero_grad, named_parameters and named_buffers on the functions it returns: through
    them the entry keeps the module's graph, and its nodes' fake values keep their fake mode,
    which holds a weakref to every weight (see trace.dropping_tracing_leftovers). The values were
    the compiler's, and are dropped. Those bound methods also keep the traced module itself, a
    cycle (its train and eval are methods bound to it) holding the model's weights: freed only
    by a second collection after the entry goes, when the model is let go of. Nothing calls them."""
    for submodule in graph.modules():
        if isinstance(submodule, torch.fx.GraphModule):
            for node in submodule.graph.nodes:
                node.meta.clear()
    wrapper = compiled
    while wrapper is not None:  # functools.wraps copied them onto each wrapper
        for name in ("zero_grad", "named_parameters", "named_buffers"):
            if getattr(getattr(wrapper, name, None), "__self__", None) is graph:
                delattr(wrapper, name)
        wrapper = getattr(wrapper, "__wrapped__", None)


_warmed_up: set[str] = set()  # inductor options the compiler has started up with in this process


def warm_up(options: dict) -> None:
    """Compiles and runs a small graph of the operators diffusion models use, once per process
    and set of inductor `options`, and drops it. A failure here is left for the real build to
    raise."""
    key = repr(sorted(options.items(), key=repr))
    with _background.build_lock():
        if key in _warmed_up:
            return
        _warmed_up.add(key)
        with torch.inference_mode(False):  # a build under inference_mode would make its weights inference tensors
            module = _WarmUp().eval()
            sample = torch.randn(1, 4, 8, 8)
        try:
            with dropping_tracing_leftovers():
                traced = trace_call(_WarmUp.forward, (module, sample), {}, (sample,),
                                    guards.call_roots((module, sample), {}, True, ("sample",)), ("sample",), True)
                compiled = INDUCTOR.compile(traced, options)
                del traced
            compiled.run(sample)
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

