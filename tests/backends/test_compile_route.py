"""Where a compiled build's graph comes from is decided in one function
(shapecache/_backends/compilers.py: choose_route), and followed by one (compile_on): the
package store first, then the compilers in order, a failure of one warned of and the next
trying. Real traces of a small model; nothing here compiles but the tests marked slow."""

import contextlib
import dataclasses
import warnings

import pytest
import torch

from shapecache import _background
from shapecache._backends import compile_process, compilers, guards, package_store
from shapecache._backends.inductor_compiler import INDUCTOR
from shapecache._backends.trace import dropping_tracing_leftovers, trace_call


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return torch.nn.functional.silu(self.conv(x))


def traced(net=None, x=None):
    net = Net().eval() if net is None else net
    x = torch.randn(1, 4, 8, 8) if x is None else x
    with dropping_tracing_leftovers():
        return trace_call(Net.forward, (net, x), {}, (x,), guards.call_roots((net, x), {}, True, ("x",)), ("x",), True)


def traced_tanh():
    """A trace of a module whose graph has other operators than Net's."""
    class TanhNet(Net):
        def forward(self, x):
            return torch.tanh(self.conv(x))

    net, x = TanhNet().eval(), torch.randn(1, 4, 8, 8)
    with dropping_tracing_leftovers():
        return trace_call(TanhNet.forward, (net, x), {}, (x,), guards.call_roots((net, x), {}, True, ("x",)), ("x",),
                          True)


FROZEN = {"options": {"freezing": True}}


@pytest.mark.parametrize(("case", "compile_options", "in_background", "compiler", "shared", "expected"), [
    ("inline", FROZEN, False, None, False, ("inductor",)),
    ("background", FROZEN, True, None, False, ("process", "inductor")),
    ("background, thread asked", FROZEN, True, "thread", False, ("inductor",)),
    ("background, not frozen", {}, True, None, False, ("inductor",)),
    ("background, options not JSON", {"options": {"freezing": True, "post_grad_custom_post_pass": object()}}, True,
     None, False, ("inductor",)),
    # shared: the package is the entry, inline or not (not compiled a second time to share it)
    ("inline, shared", FROZEN, False, None, True, ("process", "inductor", "store")),
    ("inline, shared, thread asked for background builds", FROZEN, False, "thread", True,
     ("process", "inductor", "store")),
    ("background, shared", FROZEN, True, None, True, ("process", "inductor", "store")),
    ("background, shared, thread asked", FROZEN, True, "thread", True, ("inductor", "store")),
    ("inline, not frozen, shared", {}, False, None, True, ("inductor",)),
])
def test_each_build_gets_the_route_its_options_device_and_place_say(case, compile_options, in_background, compiler,
                                                                     shared, expected, monkeypatch, tmp_path):
    if compiler is None:
        monkeypatch.delenv("SHAPECACHE_BACKGROUND_COMPILER", raising=False)
    else:
        monkeypatch.setenv("SHAPECACHE_BACKGROUND_COMPILER", compiler)
    if shared:
        monkeypatch.setenv("SHAPECACHE_SHARED_DIR", str(tmp_path))
    else:
        monkeypatch.delenv("SHAPECACHE_SHARED_DIR", raising=False)
    with torch.no_grad():
        trace = traced()
        route = compilers.choose_route(trace, compile_options, in_background, "Net.forward")
    got = tuple(c.name for c in route.compilers) + (("store",) if route.store is not None else ())
    assert got == expected, case
    assert bool(route.why) == (got != ("process", "inductor", "store")), route.why  # why, wherever a route is cut short
    if route.store is not None:
        assert route.store.directory == tmp_path / "packages"


def test_with_grad_or_autocast_on_a_frozen_graph_is_no_package():
    trace = traced()
    with torch.enable_grad():
        assert [c.name for c in compilers.choose_route(trace, FROZEN, True, "f").compilers] == ["inductor"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        route = compilers.choose_route(trace, FROZEN, True, "f")
    assert [c.name for c in route.compilers] == ["inductor"] and "autocast" in route.why


def test_inference_tensor_weights_turn_freezing_off_with_a_warning_and_no_package():
    with torch.inference_mode():
        net, x = Net().eval(), torch.randn(1, 4, 8, 8)
        trace = traced(net, x)
        assert trace.reads_inference_weights
        with pytest.warns(RuntimeWarning, match="freezing is off for Net.forward"):
            route = compilers.choose_route(trace, FROZEN, True, "Net.forward")
    assert route.options["freezing"] is False
    assert [c.name for c in route.compilers] == ["inductor"]


def test_a_custom_graph_pass_keeps_the_graph_in_this_process_and_out_of_the_store(monkeypatch, tmp_path):
    # The pass is code of this process's: the compiler's process would compile without it, and
    # a package key would not name it.
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("SHAPECACHE_SHARED_DIR", str(tmp_path))
    with torch.no_grad(), inductor_config.patch(post_grad_custom_post_pass=lambda graph: None):
        route = compilers.choose_route(traced(), FROZEN, True, "f")
    assert [c.name for c in route.compilers] == ["inductor"] and route.store is None
    assert "torch._inductor.config.post_grad_custom_post_pass" in route.why


def test_inductors_configuration_as_set_here_goes_with_the_options_and_code_in_it_keeps_the_graph_here():
    # The compiler's process and a package compiled later compile under what this context set
    # (in code, or by TORCHINDUCTOR_* variables): it goes with the options they are given.
    from torch._inductor import config as inductor_config

    with torch.no_grad():
        trace = traced()
        plain = compilers.choose_route(trace, FROZEN, True, "f").options
        assert "cpp.simdlen" not in plain and plain["freezing"] is True
        with inductor_config.patch({"cpp.simdlen": 256, "max_autotune_gemm": True}):
            route = compilers.choose_route(trace, FROZEN, True, "f")
        assert route.options == {**plain, "cpp.simdlen": 256, "max_autotune_gemm": True}
        # Set to the value a new process has (as torch's own compiles leave some): not sent.
        with inductor_config.patch(comprehensive_padding=inductor_config.comprehensive_padding):
            assert compilers.choose_route(trace, FROZEN, True, "f").options == plain
        assert [c.name for c in route.compilers] == ["process", "inductor"]
        with inductor_config.patch(inductor_choices_class=lambda: None):
            route = compilers.choose_route(trace, FROZEN, True, "f")
        assert [c.name for c in route.compilers] == ["inductor"]
        assert route.why == "inductor's configuration holds code of this process's " \
                            "(torch._inductor.config.inductor_choices_class)"


def test_a_route_whose_compiler_gave_up_in_this_process_compiles_here(monkeypatch):
    monkeypatch.setattr(compile_process.PROCESS, "failed", "the compiler's process ended by signal 11")
    with torch.no_grad():
        route = compilers.choose_route(traced(), FROZEN, True, "f")
    assert [c.name for c in route.compilers] == ["inductor"] and "signal 11" in route.why


class Failing:
    """A compiler that fails every graph, as the process compiler does when its process dies."""

    name = "failing"

    def __init__(self, error):
        self.error, self.calls = error, 0

    def compile(self, traced, options, saved):
        self.calls += 1
        raise self.error


@pytest.mark.slow
@pytest.mark.parametrize("error", [compilers.CompilerFailed("the compiler's process was killed by signal 9"),
                                   compilers.NotForThisGraph()])
def test_a_compiler_that_fails_hands_the_graph_to_the_next_and_says_so_only_for_a_failure(error, tmp_path):
    # Nor is the graph published: a package of it would be refused, or fail, again.
    net, x = Net().eval(), torch.randn(1, 4, 8, 8)
    failing = Failing(error)
    with torch.no_grad():
        trace = traced(net, x)
        route = compilers.Route({}, (failing, INDUCTOR), package_store.PackageStore(tmp_path / "packages"), "")
        saved = compile_process.SavedProgram(trace.program)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = compilers.compile_on(route, trace, saved, owner=Net.forward)
        saved.remove()
        torch.testing.assert_close(compiled.run(x)[0], net(x))
    assert failing.calls == 1
    assert not _background._publishing and not (tmp_path / "packages").exists()
    said = [str(w.message) for w in caught if "signal 9" in str(w.message)]
    assert len(said) == (1 if isinstance(error, compilers.CompilerFailed) else 0)


def test_the_last_compilers_failure_reaches_the_build():
    failing = Failing(compilers.CompilerFailed("no compiler at all"))
    with torch.no_grad(), contextlib.ExitStack() as stack:
        trace = traced()
        saved = compile_process.SavedProgram(trace.program)
        stack.callback(saved.remove)
        with pytest.raises(compilers.CompilerFailed, match="no compiler at all"):
            compilers.compile_on(compilers.Route({}, (failing,), None, ""), trace, saved, owner=Net.forward)


@pytest.mark.parametrize(("failure", "lasting"), [
    (compile_process.Failed("error: no member named 'x'"), True),  # the graph's compile failed
    (compile_process.failure_of(RuntimeError("cannot pickle a custom op")), True),  # saving the graph failed
    (compile_process.Transient("the compiler's process ended (signal 9) without compiling"), False),
    (compile_process.failure_of(OSError(28, "No space left on device")), False),  # the machine, not the graph
    (compile_process.failure_of(RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")),
     False),  # torch's writer on a full disk
    (compile_process.failure_of(NotADirectoryError(20, "Not a directory")), True),
    (compile_process.failure_of(MemoryError()), False),
    (ValueError("SHAPECACHE_COMPILER_IDLE_S='x': expected a positive number"), False),  # a setting
])
def test_the_process_compiler_says_which_failures_are_the_graphs_own(failure, lasting, monkeypatch):
    def failing(directory, options, settings=None):
        raise failure

    monkeypatch.setattr(compile_process, "compile_saved", failing)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        trace = traced()
        saved = compile_process.SavedProgram(trace.program)
        stack.callback(saved.remove)
        with pytest.raises(compilers.CompilerFailed) as raised:
            compile_process.PROCESS.compile(trace, {"freezing": True}, saved)
    assert raised.value.lasting is lasting
    assert ("this graph's later builds, at any size, compile in the serving process" in str(raised.value)) is lasting


@pytest.mark.slow
@pytest.mark.parametrize("error", [compilers.CompilerFailed("its compile failed (error: x)", lasting=True),
                                   compilers.NotForThisGraph(),
                                   compilers.CompilerFailed("the process ended (signal 9)", lasting=False)])
def test_a_lasting_failure_makes_the_same_graphs_later_routes_pass_the_compiler_over(error, monkeypatch, tmp_path):
    # A compile that fails for a graph (a compile error, a graph that writes what it reads) is
    # not tried again at each of its sizes, nor are their packages stored (they would fail as
    # that one did); a process that ended says nothing of the graph, and a graph of other
    # operators is another graph.
    monkeypatch.setenv("SHAPECACHE_SHARED_DIR", str(tmp_path))
    monkeypatch.setattr(Failing, "name", compile_process.PROCESS.name)
    failing, failures = Failing(error), {}
    with torch.no_grad(), contextlib.ExitStack() as stack:
        net, x = Net().eval(), torch.randn(1, 4, 8, 8)
        trace = traced(net, x)
        saved = compile_process.SavedProgram(trace.program)
        stack.callback(saved.remove)
        route = compilers.choose_route(trace, FROZEN, False, "Net.forward", failures)
        assert [c.name for c in route.compilers] == ["process", "inductor"] and route.to_share
        route = dataclasses.replace(route, compilers=(failing, INDUCTOR))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = compilers.compile_on(route, trace, saved, owner=Net.forward)
        torch.testing.assert_close(compiled.run(x)[0], net(x))
        later = compilers.choose_route(traced(net, torch.randn(1, 4, 12, 12)), FROZEN, False, "Net.forward", failures)
        other = compilers.choose_route(traced_tanh(), FROZEN, False, "Net.forward", failures)
    lasting = not isinstance(error, compilers.CompilerFailed) or error.lasting
    assert ([name for name, _ in failures] == ["process"]) is lasting, failures
    if lasting:
        assert [c.name for c in later.compilers] == ["inductor"] and later.store is None
        assert later.why.startswith("the compiler's process failed this graph of Net.forward at another size")
    else:
        assert [c.name for c in later.compilers] == ["process", "inductor"] and later.store is not None
    assert [c.name for c in other.compilers] == ["process", "inductor"] and other.store is not None
