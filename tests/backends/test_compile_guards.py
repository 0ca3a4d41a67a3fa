"""A compiled entry never answers for state it was not built from (csrc/cache/state_guard.h,
_backends/guards.py), builds never touch the live model, and every failure falls back.

The oracle throughout: after any sequence of calls and model changes, the cached answer
equals the uncached one. Each case is also run through torch.compile where it says what
torch.compile does."""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import subprocess
import sys
import threading
import types
import warnings
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten

import shapecache as sc

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

# Compiled entries round differently from eager (docs/backends.md): inductor may reorder float sums.
CLOSE = {"rtol": 1e-4, "atol": 1e-5}


class Processor:
    """A plain object a module calls, as diffusers' attention processors are."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, x):
        return x * self.scale


OUTPUT_GAIN = 1.0  # module-level state a helper reads, as a feature flag or a global scale is


def with_output_gain(y):
    return y * OUTPUT_GAIN


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.processor = Processor()
        self.factor = 1.0
        self.active = {0}  # a set, which keeps no version
        self.gains = np.ones(6, dtype=np.float32)  # a numpy array, which keeps none either

    def forward(self, x):
        y = self.processor(self.linear(x)) * self.factor * torch.from_numpy(self.gains)
        if 2 in self.active:
            y = y * 2
        y = with_output_gain(y)
        return y + 1 if self.training else y


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = Block()
        self.second = Block()
        self.offset = torch.zeros(6)  # a plain tensor attribute: no parameter, no buffer
        self.register_buffer("shift", torch.zeros(6))

    def forward(self, x):
        return self.second(self.first(x)) + self.offset - self.shift


def twins():
    """A model to cache and an equal one to call plainly."""
    set_global_read_by_a_helper(None, 1.0)
    torch.manual_seed(0)
    net = Net().eval()
    return net, copy.deepcopy(net)


def compiled(net, **options):
    return sc.cached(net, backend="compile", budget="1GiB", **options)


def check(cached, plain, x):
    with torch.no_grad():
        torch.testing.assert_close(cached(x), plain(x), **CLOSE)


# Mutations applied alike to the cached model and its twin: each returns nothing.
def set_factor(net, value):
    net.first.factor = value


def set_same_factor(net, _):
    net.first.factor = float(net.first.factor)  # a new float object, the same value


def train_submodule(net, _):
    net.second.train()


def eval_all(net, _):
    net.eval()


def swap_processor(net, value):
    net.second.processor = Processor(value)


def set_processor_scale(net, value):
    net.first.processor.scale = value


def replace_parameter(net, value):
    net.first.linear.weight = torch.nn.Parameter(torch.full((6, 6), value / 10))


def replace_data(net, value):
    net.second.linear.bias.data = torch.full((6,), value)


def update_in_place(net, value):
    with torch.no_grad():
        net.first.linear.weight.mul_(value)


def update_plain_tensor(net, value):
    net.offset.add_(value)


def update_buffer(net, value):
    net.shift.fill_(value)


def replace_plain_tensor(net, value):
    net.offset = torch.full((6,), value)


def toggle_active(net, value):
    if value > 1:
        net.first.active.add(2)
    else:
        net.first.active.discard(2)


def scale_gains_in_place(net, value):
    net.first.gains *= value


def set_global_read_by_a_helper(_, value):
    global OUTPUT_GAIN
    OUTPUT_GAIN = value


def replace_submodule(net, _):
    torch.manual_seed(1)
    net.second.linear = torch.nn.Linear(6, 6)


MUTATIONS = [set_factor, set_same_factor, train_submodule, eval_all, swap_processor, set_processor_scale,
             replace_parameter, replace_data, update_in_place, update_plain_tensor, update_buffer,
             replace_plain_tensor, replace_submodule, toggle_active, scale_gains_in_place, set_global_read_by_a_helper]


@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda m: m.__name__)
def test_each_change_between_calls_is_seen_by_the_compiled_entry(mutate):
    net, plain = twins()
    cached = compiled(net)
    x = torch.randn(3, 6)
    check(cached, plain, x)
    check(cached, plain, x)  # a hit
    for model in (net, plain):
        mutate(model, 1.5)
    check(cached, plain, x)
    stats = sc.stats(cached)
    if mutate in (set_same_factor, eval_all):  # the same values written again: no rebuild
        assert stats["invalidations"] == 0 and stats["builds"] == 1
    else:
        assert stats["invalidations"] == 1


def test_an_entry_without_freezing_reads_weights_live_so_writes_through_data_are_seen():
    # In-place writes through .data bump no version counter; a graph that reads its weights
    # where they are (no freezing) sees them without a rebuild.
    net, plain = twins()
    cached = compiled(net)
    x = torch.randn(3, 6)
    check(cached, plain, x)
    for model in (net, plain):
        model.first.linear.weight.data.mul_(3)
    check(cached, plain, x)
    assert sc.stats(cached)["invalidations"] == 0


def test_torch_compile_sees_the_same_changes():
    """What shapecache matches: torch.compile's answer after each change equals the plain call."""
    for mutate in (set_factor, swap_processor, replace_parameter, update_plain_tensor):
        torch._dynamo.reset()
        net, plain = twins()
        dynamo = torch.compile(net, dynamic=False)
        x = torch.randn(3, 6)
        check(dynamo, plain, x)
        for model in (net, plain):
            mutate(model, 1.5)
        check(dynamo, plain, x)


actions = st.one_of(
    st.tuples(st.just("call"), st.sampled_from([2, 3])),
    st.tuples(st.sampled_from(MUTATIONS), st.sampled_from([0.5, 1.5, 2.0])),
)


def run_differentially(backend, steps):
    net, plain = twins()
    cached = sc.cached(net, backend=backend, budget="1GiB")
    xs = {n: torch.randn(n, 6) for n in (2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for action, value in [("call", 2), *steps, ("call", 3)]:
            if action == "call":
                check(cached, plain, xs[value])
            else:
                action(net, value)
                action(plain, value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(actions, max_size=8))
def test_any_sequence_of_changes_and_calls_answers_as_the_uncached_model_eager(steps):
    run_differentially("eager", steps)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(actions, min_size=2, max_size=6))
def test_any_sequence_of_changes_and_calls_answers_as_the_uncached_model_compiled(steps):
    run_differentially("compile", steps)


def cached_function_of_a_global_model(net):
    """A cached function that calls `net` through a global, as usage.md's first example does."""
    global GLOBAL_MODEL
    GLOBAL_MODEL = net

    @sc.cached(backend="compile", budget="1GiB")
    def run(x):
        return GLOBAL_MODEL(x)

    return run


def test_a_function_calling_a_global_model_sees_its_weights_replaced():
    net, plain = twins()
    run = cached_function_of_a_global_model(net)
    x = torch.randn(2, 6)
    check(run, plain, x)
    for model in (net, plain):
        replace_data(model, 3.0)
    check(run, plain, x)
    for model in (net, plain):
        replace_parameter(model, 2.0)
    check(run, plain, x)
    assert sc.stats(run)["invalidations"] == 2, str({k: v for k, v in sc.stats(run).items() if k != "entries"})


GLOBAL_MODEL = None


class Counting(torch.nn.Module):
    """Reads and writes a step counter on every call."""

    def __init__(self):
        super().__init__()
        self.steps = 0

    def forward(self, x):
        self.steps += 1
        return x * self.steps


def test_state_the_call_writes_runs_uncached_with_one_warning_naming_it():
    cached, plain = sc.cached(Counting(), backend="compile"), Counting()
    x = torch.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            torch.testing.assert_close(cached(x), plain(x))
    messages = [str(w.message) for w in caught if "shapecache" in str(w.message)]
    assert len(messages) == 1 and "steps" in messages[0], messages
    assert sc.stats(cached)["builds"] == 0 and sc.stats(cached)["uncached_calls"] == 3


def test_state_changed_before_every_call_stops_rebuilding_after_three():
    net, plain = twins()
    cached = compiled(net)
    x = torch.randn(2, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            for model in (net, plain):
                model.first.factor = float(step)
            check(cached, plain, x)
    stats = sc.stats(cached)
    assert stats["builds"] == 3 and stats["uncached_calls"] == 3  # built, rebuilt twice, then given up
    messages = [str(w.message) for w in caught if "uncached from now on" in str(w.message)]
    assert len(messages) == 1 and "first.factor changed" in messages[0], messages
    sc.clear(cached)
    check(cached, plain, x)
    assert sc.stats(cached)["builds"] == 4


def test_buffers_the_call_updates_are_updated_once_per_call():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
    plain = copy.deepcopy(net)
    cached = sc.cached(net, backend="compile")
    for _ in range(3):
        x = torch.randn(5, 4)
        torch.testing.assert_close(cached(x), plain(x), **CLOSE)
    torch.testing.assert_close(net[1].running_mean, plain[1].running_mean, **CLOSE)
    assert net[1].num_batches_tracked.item() == 3


@pytest.mark.parametrize("function,x", [
    (lambda x: x[x > 0] * 2, torch.randn(16)),  # a data-dependent output size
    (lambda x: (x * 2, "a", 1.5), torch.randn(4)),  # constants in the output
    (lambda x: {"y": x + 1, "m": "text"}, torch.randn(4)),
], ids=["data-dependent", "tuple-with-constants", "dict-with-constants"])
def test_calls_torch_compile_serves_are_served_every_time(function, x):
    cached = sc.cached(function, backend="compile")
    for _ in range(3):
        assert_same(cached(x), function(x))
    assert sc.stats(cached)["misses"] == 1  # built, or given up, once; never retried per call
    assert_same(torch.compile(function, dynamic=False)(x), function(x))  # torch.compile serves it too


def assert_same(out, expected):
    out_leaves, out_spec = tree_flatten(out)
    expected_leaves, expected_spec = tree_flatten(expected)
    assert out_spec == expected_spec
    for a, b in zip(out_leaves, expected_leaves, strict=True):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b)
        else:
            assert a == b


def test_inputs_of_other_strides_get_entries_of_their_own():
    cached = sc.cached(lambda a: a * 2 + 1, backend="compile")
    base = torch.randn(8, 8)
    first, second = base[:, :4], base.t()[:4, :]  # same sizes, both non-contiguous, other strides
    for view in (first, second, first, second):
        torch.testing.assert_close(cached(view), view * 2 + 1)
    assert sc.stats(cached)["builds"] == 2 and sc.stats(cached)["fallbacks"] == 0


def test_a_call_that_fails_by_itself_raises_its_own_error_and_builds_nothing():
    class Picky(torch.nn.Module):
        def forward(self, x):
            if x.shape[0] == 3:
                raise KeyError("three is not allowed")
            return x + 1

    cached = sc.cached(Picky(), backend="compile")
    with pytest.raises(KeyError, match="three is not allowed"):
        cached(torch.ones(3))
    assert sc.stats(cached)["builds"] == 0 and sc.stats(cached)["fallbacks"] == 0
    torch.testing.assert_close(cached(torch.ones(2)), torch.ones(2) + 1)
    assert sc.stats(cached)["builds"] == 1


def test_an_inner_cached_module_is_transparent_while_the_outer_builds():
    torch.manual_seed(0)
    inner = sc.cached(torch.nn.Linear(4, 4), backend="compile")
    cached = sc.cached(torch.nn.Sequential(inner, torch.nn.ReLU()), backend="compile")
    x = torch.randn(2, 4)
    torch.testing.assert_close(cached(x), torch.relu(torch.nn.functional.linear(x, inner.weight, inner.bias)))
    assert sc.stats(inner)["calls"] == 0  # the outer graph holds the inner's work; nothing built from fake tensors
    assert sc.stats(cached)["builds"] == 1 and sc.stats(cached)["fallbacks"] == 0
    torch.testing.assert_close(inner(x), torch.nn.functional.linear(x, inner.weight, inner.bias))  # called itself: it builds
    assert sc.stats(inner)["builds"] == 1


def test_a_dropped_cached_module_is_collected_though_its_guard_holds_its_state():
    # The guard holds the module's dict, which holds the cached forward, which holds the guard
    # through the C++ cache: the dispatcher shows the collector that cycle (tp_traverse).
    import gc
    import weakref

    net, _ = twins()
    cached = compiled(net)
    with torch.no_grad():
        cached(torch.randn(2, 6))
        cached(torch.randn(2, 6))
    assert sc.stats(cached)["hits"] == 1
    alive = weakref.ref(net)
    del net, cached
    gc.collect()
    assert alive() is None


def test_a_trace_leaves_no_fake_tensor_in_objects_it_shares_with_the_live_model():
    class LazyProcessor:
        def __init__(self):
            self.cache = None

        def __call__(self, x):
            if self.cache is None:
                self.cache = torch.ones(x.shape[-1]) * 2  # filled once, by the first call
            return x * self.cache

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.processor = LazyProcessor()

        def forward(self, x):
            return self.processor(x)

    net = Net()
    cached = sc.cached(net, backend="compile")
    x = torch.randn(2, 4)
    for _ in range(2):
        torch.testing.assert_close(cached(x), x * 2)
    assert not isinstance(net.processor.cache, torch._subclasses.fake_tensor.FakeTensor)


class Rotary:
    """A plain helper with a lazy cache and its sentinel, as DiT and LLM code writes rotary tables."""

    def __init__(self, base: float):
        self.base = base
        self.length = None
        self.table = None
        self.calls = collections.defaultdict(int)  # per length

    def __call__(self, x):
        n = x.shape[-1]
        self.calls[n] += 1
        if self.length != n:
            self.table = torch.arange(n, dtype=x.dtype) / self.base
            self.length = n
        return x + self.table


class WithRotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary = Rotary(10000.0)
        self.seen: list = []

    def forward(self, x):
        self.seen.append(x.shape[-1])  # a list the model keeps
        return self.rotary(x)


@pytest.mark.parametrize("build", ["inline", "background"])
def test_a_build_leaves_the_users_plain_objects_as_they_were(build):
    # The trace writes the helper's table and sentinel, and the model's list: all put back
    # whole (a value put back alone would leave a sentinel beside a table it does not
    # describe), and the call, which writes state it reads, runs uncached with one warning.
    net, plain = WithRotary(), WithRotary()
    cached = sc.cached(net, backend="compile", build=build)
    with pytest.warns(RuntimeWarning, match="the call writes"):
        for n in (4, 6, 4, 6):
            x = torch.randn(2, n)
            before = (net.rotary.length, net.rotary.table, list(net.seen))
            torch.testing.assert_close(cached(x), plain(x))
            assert sc.wait(cached, timeout=300)
            length, table, seen = net.rotary.length, net.rotary.table, net.seen
            assert length == n and type(table) is torch.Tensor and table.shape == (n,), (before, length, table)
            assert seen == [*before[2], n] and net.rotary.calls == plain.rotary.calls
    assert sc.stats(cached)["entries"] == []
    sc.uncached(net)


def test_threads_call_sizes_submodules_stats_and_clear_while_builds_run():
    net, plain = twins()
    cached = compiled(net)
    xs = [torch.randn(n, 6) for n in (1, 2, 3, 4)]
    with torch.no_grad():
        expected = [plain(x) for x in xs]
        expected_first = [plain.first(x) for x in xs]
    errors = []

    def caller(offset):
        try:
            for step in range(12):
                i = (step + offset) % len(xs)
                with torch.no_grad():
                    torch.testing.assert_close(cached(xs[i]), expected[i], **CLOSE)
                    torch.testing.assert_close(net.first(xs[i]), expected_first[i], **CLOSE)  # a plain submodule call
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    def bystander():
        try:
            for step in range(30):
                sc.stats(cached)
                if step % 10 == 9:
                    sc.clear(cached)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)] + [threading.Thread(target=bystander)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    stats = sc.stats(cached)
    assert stats["builds"] >= 1 and stats["hits"] >= 1, stats


CHANGED_DURING_THE_TRACE: list = []  # (module, attribute) each trace changes, as another thread would


class ChangesDuringTrace(torch.nn.Module):
    """Passes its input on; seeing the trace's fake tensors, changes what CHANGED_DURING_THE_TRACE names."""

    def forward(self, x):
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(x, FakeTensor):
            for module, attribute in CHANGED_DURING_THE_TRACE:
                setattr(module, attribute, getattr(module, attribute, 0) + 1)
        return x


class Parts(torch.nn.Module):
    """A forward that reaches `used` alone; `idle` holds a part it never calls."""

    def __init__(self):
        super().__init__()
        self.probe = ChangesDuringTrace()
        self.used = torch.nn.Linear(4, 4)
        self.idle = torch.nn.Sequential(torch.nn.Linear(4, 4))
        self.idle[0].tag = 0

    def forward(self, x):
        return self.used(self.probe(x))


@pytest.mark.parametrize("what", ["used", "idle"])
def test_a_change_during_the_build_leaves_the_entry_stale_and_it_is_built_again(what):
    # Made as the trace runs, as another thread would: to the layer the call runs, or to a
    # part it never reaches (which the entry's own guard need not hold: a module replaced
    # during the build is in no guard made after it), the entry is stale when built, not
    # kept, and the next call builds it from the changed state.
    torch.manual_seed(0)
    net = Parts().eval()
    CHANGED_DURING_THE_TRACE[:] = [(net.idle[0] if what == "idle" else net.used, "tag")]
    cached = compiled(net)
    x = torch.randn(2, 4)
    try:
        with torch.no_grad():
            cached(x)
            stats = sc.stats(cached)
            assert (len(stats["entries"]), stats["invalidations"]) == (0, 1)
            CHANGED_DURING_THE_TRACE.clear()
            torch.testing.assert_close(cached(x), torch.nn.functional.linear(x, net.used.weight, net.used.bias),
                                       **CLOSE)
            assert len(sc.stats(cached)["entries"]) == 1
    finally:
        CHANGED_DURING_THE_TRACE.clear()
        sc.uncached(net)


def test_a_build_leaves_no_weakref_on_the_weights():
    # torch.utils.swap_tensors refuses a tensor with a weakref: module.to() and
    # load_state_dict(assign=True) under swap_module_params_on_conversion must still work.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    cached = sc.cached(model, backend="compile")
    x = torch.randn(2, 8)
    with torch.no_grad():
        cached(x)
    assert sc.stats(cached)["builds"] == 1
    assert all(not weakref.getweakrefs(p) for p in model.parameters())
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    with torch.no_grad():
        torch.testing.assert_close(cached(x.double()), model(x.double()), **CLOSE)


class CastingHook:
    """As diffusers' hook registry with layerwise casting: forward bound to the LIVE module, which
    it casts up before and down after each call (module.to())."""

    def __init__(self, module):
        self.original = module.forward
        module.to(torch.float16)

    def __call__(self, module, *args):
        module.to(torch.float32)
        out = self.original(*args)
        module.to(torch.float16)
        return out


def test_a_hook_that_casts_the_live_module_leaves_it_whole():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    reference = copy.deepcopy(model)
    for layer in (model[0], model[2], reference[0], reference[2]):
        layer.forward = functools.partial(CastingHook(layer), layer)
    weights = [id(p) for p in model.parameters()]
    cached = sc.cached(model, backend="compile")
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(cached(x), reference(x), **CLOSE)
    assert [id(p) for p in model.parameters()] == weights
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float16 for p in model.parameters())


def test_a_pre_hook_reads_its_closure_and_the_entry_answers_as_the_uncached_model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU()).eval()
    state = {"gain": 1.0}
    scale = 1.0

    def pre(module, args):
        return (args[0] * scale * state["gain"],)

    net[0].register_forward_pre_hook(pre)
    plain = copy.deepcopy(net)  # the same hook function: it reads the same closure
    cached = compiled(net)
    x = torch.randn(2, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a hook a graph would drop: Dynamo builds the bucket
        check(cached, plain, x)
        scale = 4.0  # the cell
        check(cached, plain, x)
        state["gain"] = 2.0  # what the cell holds
        check(cached, plain, x)
    # Dynamo built the bucket (it runs the hook) and its own guards saw both changes.
    assert sc.stats(cached)["builds"] == 1


def denoise(model, x, options):
    return model(x) * options["guidance"]


def test_a_partial_given_to_cached_is_guarded_by_its_arguments():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 6).eval()
    options = {"guidance": 1.0}
    run = sc.cached(functools.partial(denoise, model, options=options), backend="compile", budget="1GiB")
    x = torch.randn(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), **CLOSE)
        options["guidance"] = 7.5
        torch.testing.assert_close(run(x), model(x) * 7.5, **CLOSE)
        with torch.no_grad():
            model.weight.mul_(2)
        torch.testing.assert_close(run(x), model(x) * 7.5, **CLOSE)
    assert sc.stats(run)["invalidations"] == 2, str({k: v for k, v in sc.stats(run).items() if k != "entries"})


class Denoiser:
    """A callable object given to sc.cached, holding its model and its options."""

    def __init__(self, model):
        self.model, self.guidance = model, 1.0

    def __call__(self, x):
        return self.model(x) * self.guidance


def test_a_callable_object_given_to_cached_is_guarded_by_its_attributes():
    torch.manual_seed(0)
    denoiser = Denoiser(torch.nn.Linear(6, 6).eval())
    run = sc.cached(denoiser, backend="compile", budget="1GiB")
    x = torch.randn(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(run(x), denoiser.model(x), **CLOSE)
        denoiser.guidance = 3.0
        torch.testing.assert_close(run(x), denoiser.model(x) * 3.0, **CLOSE)
    assert sc.stats(run)["invalidations"] == 1


def test_inference_tensors_updated_in_place_are_read_where_they_are_instead_of_frozen():
    with torch.inference_mode():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6)).eval()
        other = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6)).eval()
    cached = sc.cached(model, backend="compile", budget="1GiB", compile_options={"options": {"freezing": True}})
    x = torch.randn(2, 6)
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match="freezing is off .* inference tensors"):
            torch.testing.assert_close(cached(x), model(x), **CLOSE)
        model.load_state_dict(other.state_dict())  # copy_ into inference tensors: no version moves
        torch.testing.assert_close(cached(x), other(x), **CLOSE)


class _Timestepped(torch.nn.Module):
    """A denoiser's call shape: an int timestep the forward makes a tensor of."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x, timestep: int):
        return self.linear(x) * torch.tensor([float(timestep)])


def test_a_model_called_under_inference_mode_is_frozen_though_its_call_makes_inference_tensors():
    # The tensor made of the timestep is an inference tensor, lifted into the graph as a
    # constant: it is no weight of the model's, and freezing stays on (the model's own weights
    # are ordinary tensors). The compiler's warm-up module is made outside inference_mode too.
    torch.manual_seed(0)
    model = _Timestepped().eval()
    torch.manual_seed(0)
    plain = _Timestepped().eval()
    cached = sc.cached(model, backend="compile", budget="1GiB", compile_options={"options": {"freezing": True}})
    x = torch.randn(2, 6)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(cached(x, 3), plain(x, 3), **CLOSE)
        torch.testing.assert_close(cached(x, 3), plain(x, 3), **CLOSE)  # the hit
        torch.testing.assert_close(cached(x, 5), plain(x, 5), **CLOSE)
    assert not [str(w.message) for w in caught if "freezing is off" in str(w.message)]
    assert sc.stats(cached)["bytes"] > 0  # a frozen entry holds its copy of the weights; a plain one nothing


class _Tabled(torch.nn.Module):
    """A model that keeps a tensor in a list, which export lifts as it lifts a tensor the call makes."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        with torch.inference_mode():
            self.table = [torch.ones(6)]

    def forward(self, x):
        return self.linear(x) * self.table[0]


@pytest.mark.parametrize("freezing", [True, False])
def test_an_inference_tensor_kept_in_a_list_leaves_its_bucket_uncached_and_its_updates_seen(freezing):
    # Export lifts it as a constant of the graph, frozen or not, and an inference tensor keeps no
    # version counter: no guard would see it updated in place. The bucket runs uncached.
    torch.manual_seed(0)
    model = _Tabled().eval()
    cached = sc.cached(model, backend="compile", budget="1GiB", compile_options={"options": {"freezing": freezing}})
    x = torch.randn(2, 6)
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match=r"inference tensors kept in a list, a dict, a global or a closure"):
            torch.testing.assert_close(cached(x), model.linear(x), **CLOSE)
        model.table[0].add_(1.0)  # in place, in an inference tensor: no version moves
        torch.testing.assert_close(cached(x), model.linear(x) * 2.0, **CLOSE)
    assert sc.stats(cached)["entries"] == []


def test_an_inference_tensor_in_a_closure_leaves_its_bucket_uncached_and_its_updates_seen():
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 6).eval()
    with torch.inference_mode():
        gain = torch.full((6,), 2.0)

    def scaled(x):
        return linear(x) * gain

    cached = sc.cached(scaled, backend="compile", budget="1GiB", compile_options={"options": {"freezing": True}})
    x = torch.randn(2, 6)
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match=r"inference tensors kept in a list, a dict, a global or a closure"):
            torch.testing.assert_close(cached(x), linear(x) * 2.0, **CLOSE)
        gain.fill_(3.0)
        torch.testing.assert_close(cached(x), linear(x) * 3.0, **CLOSE)


class _Offset(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        with torch.inference_mode():
            self.register_buffer("offset", torch.ones(6), persistent=False)

    def forward(self, x):
        return self.linear(x) + self.offset


def test_a_non_persistent_inference_buffer_turns_freezing_off_and_its_bucket_stays_cached():
    # A module's own tensors (a non-persistent buffer, as CLIP's position ids) are no list's:
    # made under inference_mode, they turn freezing off as inference weights do.
    torch.manual_seed(0)
    model = _Offset().eval()
    cached = sc.cached(model, backend="compile", budget="1GiB", compile_options={"options": {"freezing": True}})
    x = torch.randn(2, 6)
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match="freezing is off .* inference tensors"):
            out = cached(x)
        torch.testing.assert_close(out, model.linear(x) + 1.0, **CLOSE)
        cached(x)
    assert len(sc.stats(cached)["entries"]) == 1 and sc.stats(cached)["hits"] == 1


def test_a_hook_on_a_model_a_function_reaches_through_a_global_runs_on_every_call():
    net, plain = twins()
    collected = []
    net.first.register_forward_hook(lambda module, args, output: collected.append(output))
    run = cached_function_of_a_global_model(net)
    x = torch.randn(2, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            check(run, plain, x)
    assert any("forward hooks" in str(w.message) for w in caught)  # built by Dynamo, which runs them
    assert len(collected) == 3 and all(type(t) is torch.Tensor for t in collected)


def test_a_hook_that_keeps_state_does_not_make_its_bucket_rebuild_on_every_call():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU()).eval()
    outputs = []
    calls = 0

    def collect(module, args, output):
        nonlocal calls
        calls += 1
        outputs.append(output)

    net[0].register_forward_hook(collect)
    cached = compiled(net)
    x = torch.randn(2, 6)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # built by Dynamo, which runs the hook
        for _ in range(6):
            cached(x)
    assert calls == 6 and len(outputs) == 6
    stats = sc.stats(cached)
    assert stats["builds"] == 1 and stats["invalidations"] == 0


out = None  # a global that shares its name with an attribute the model reads (self.out)


class ReadsAnAttributeNamedLikeAGlobal(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(6, 6)

    def forward(self, x):
        return self.out(x)


def test_an_attribute_named_like_a_global_does_not_make_the_global_a_dependency():
    global out
    torch.manual_seed(0)
    cached = compiled(ReadsAnAttributeNamedLikeAGlobal().eval())
    x = torch.randn(2, 6)
    with torch.no_grad():
        for _ in range(4):
            out = cached(x)  # rebinds the global on every call
    stats = sc.stats(cached)
    assert stats["builds"] == 1 and stats["hits"] == 3


SETTINGS = types.SimpleNamespace(gain=1.0)


def with_settings(y):
    return y * SETTINGS.gain


def test_a_setting_of_a_global_configuration_object_read_by_a_helper_is_seen():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 6).eval()

    @sc.cached(backend="compile", budget="1GiB")
    def run(x):
        return with_settings(model(x))

    x = torch.randn(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), **CLOSE)
        SETTINGS.gain = 5.0
        try:
            torch.testing.assert_close(run(x), model(x) * 5.0, **CLOSE)
        finally:
            SETTINGS.gain = 1.0
    assert sc.stats(run)["invalidations"] == 1


def test_a_module_given_through_a_partial_or_a_callable_objects_dict_is_guarded_whole():
    net, plain = twins()
    partial = sc.cached(functools.partial(net), backend="compile", budget="1GiB")
    holder = Denoiser(None)
    holder.parts = {"net": net}
    holder.__class__ = type("Parts", (Denoiser,), {"__call__": lambda self, x: self.parts["net"](x)})
    held = sc.cached(holder, backend="compile", budget="1GiB")
    x = torch.randn(2, 6)
    for run in (partial, held):
        check(run, plain, x)
    for model in (net, plain):
        set_factor(model, 4.0)  # a submodule's attribute
    for run in (partial, held):
        check(run, plain, x)
        assert sc.stats(run)["invalidations"] == 1


def test_globals_a_helper_reads_are_seen_for_a_build_made_under_cprofile():
    import cProfile

    torch.manual_seed(0)
    net = WithGlobalGain().eval()
    cached = compiled(net)
    x = torch.randn(2, 6)
    profiler = cProfile.Profile()
    with torch.no_grad():
        profiler.enable()
        try:
            check(cached, net.linear, x)
        finally:
            profiler.disable()
        set_global_read_by_a_helper(None, 3.0)
        try:
            torch.testing.assert_close(cached(x), net.linear(x) * 3.0, **CLOSE)
        finally:
            set_global_read_by_a_helper(None, 1.0)
    assert sc.stats(cached)["invalidations"] == 1


class WithGlobalGain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x):
        return with_output_gain(self.linear(x))


def test_inference_tensors_are_not_frozen_when_freezing_is_set_in_inductors_config():
    from torch._inductor import config as inductor_config

    with torch.inference_mode():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU()).eval()
        other = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU()).eval()
    cached = sc.cached(model, backend="compile", budget="1GiB")
    x = torch.randn(2, 6)
    with torch.inference_mode(), inductor_config.patch(freezing=True):
        with pytest.warns(RuntimeWarning, match="freezing is off"):
            torch.testing.assert_close(cached(x), model(x), **CLOSE)
        model.load_state_dict(other.state_dict())
        torch.testing.assert_close(cached(x), other(x), **CLOSE)


def a_user_module(name: str, source: str) -> types.ModuleType:
    """A module of the user's, imported: its code's globals are its own dict."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(source, module.__dict__)  # noqa: S102  (the test's own source)
    return module


HELPERS = """
import types
SCALE = 1.0
GAIN = 1.0
STATS = types.SimpleNamespace(calls=0)
class Trainer:
    def __init__(self):
        self.scale, self.step = 1.0, 0
TRAINER = Trainer()
def scaled(y):
    return y * SCALE
def counted(y):
    STATS.calls += 1
    return y * 2
def trainer_scaled(y):
    return y * TRAINER.scale
"""


def test_what_a_helper_reads_off_a_module_or_an_object_is_seen_and_nothing_else():
    helpers = a_user_module("shapecache_test_helpers", HELPERS)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 6).eval()
    service = a_user_module("shapecache_test_service", "import shapecache_test_helpers as helpers\n"
                                                        "MODEL = None\n"
                                                        "def run(x):\n"
                                                        "    return helpers.trainer_scaled(helpers.scaled(MODEL(x))) * helpers.GAIN\n")
    service.MODEL = model
    run = sc.cached(service.run, backend="compile", budget="1GiB")
    x = torch.randn(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), **CLOSE)
        for _ in range(3):
            helpers.TRAINER.step += 1  # an attribute no code of the call reads
            torch.testing.assert_close(run(x), model(x), **CLOSE)
        assert sc.stats(run)["invalidations"] == 0 and sc.stats(run)["hits"] == 3
        helpers.SCALE = 5.0  # read by scaled() as a global of its module; the service reads helpers.scaled
        torch.testing.assert_close(run(x), model(x) * 5.0, **CLOSE)
        helpers.TRAINER.scale = 2.0  # read off an object of the user's class
        torch.testing.assert_close(run(x), model(x) * 10.0, **CLOSE)
        helpers.GAIN = 3.0  # read off the module by the service's own code
        torch.testing.assert_close(run(x), model(x) * 30.0, **CLOSE)
    assert sc.stats(run)["invalidations"] == 3, str({k: v for k, v in sc.stats(run).items() if k != "entries"})


def test_a_helper_that_counts_in_a_global_makes_the_call_run_uncached_and_counts_every_call():
    helpers = a_user_module("shapecache_test_counting", HELPERS)
    model = torch.nn.Linear(6, 6).eval()
    run = sc.cached(lambda x: helpers.counted(model(x)), backend="compile", budget="1GiB")
    x = torch.randn(2, 6)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"writes shapecache_test_counting\.STATS\.calls"):
        for _ in range(4):
            torch.testing.assert_close(run(x), model(x) * 2, **CLOSE)
    assert helpers.STATS.calls == 4  # the trace's own write was put back
    assert sc.stats(run)["builds"] == 0


MEMO = """
BACKENDS = {}
def backend_of(tensor):
    # As einops does: a table of the tensor types seen, filled on first use.
    return BACKENDS.setdefault(type(tensor), "torch")
def doubled(y):
    backend_of(y)
    return y * 2
"""


def test_a_librarys_memo_of_the_fake_tensor_type_is_put_back_and_the_call_is_still_compiled():
    helpers = a_user_module("shapecache_test_memo", MEMO)
    model = torch.nn.Linear(6, 6).eval()
    run = sc.cached(lambda x: helpers.doubled(model(x)), backend="compile")
    x = torch.randn(2, 6)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "writes state": the graph is kept
        torch.testing.assert_close(run(x), model(x) * 2, **CLOSE)
        torch.testing.assert_close(run(x), model(x) * 2, **CLOSE)
    assert sc.stats(run)["builds"] == 1 and sc.stats(run)["hits"] == 1
    assert list(helpers.BACKENDS) == []  # the trace's FakeTensor key went; the graph's calls write nothing


TALLY = """
import types
STATS = types.SimpleNamespace(calls=0)
COUNTS = {"calls": 0}
SEEN = []
def tallied(kind, y):
    if kind == "attribute":
        STATS.calls += 1
    elif kind == "dict item":
        COUNTS["calls"] += 1
    else:
        SEEN.append(1)
    return y * 2
def tally(kind):
    return {"attribute": STATS.calls, "dict item": COUNTS["calls"], "list": len(SEEN)}[kind]
"""
_tallies = itertools.count()


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(threads=st.integers(2, 4), sizes=st.integers(1, 4), build=st.sampled_from(["inline", "background"]),
       kind=st.sampled_from(["attribute", "dict item", "list"]))
def test_what_the_code_of_a_cached_call_writes_counts_every_call_under_threads_as_the_plain_calls_do(
        threads, sizes, build, kind):
    # Differential: threads call a cached model whose helper counts its calls in a global, a
    # dict or a list, while its buckets are traced (inline or in the background); the count
    # is the calls made, as the plain calls leave it. No write is ever lost: the first trace
    # runs beside the other threads, and where one ran the model's code meanwhile, its own
    # write is left as it is (one more), with a warning saying so; every later trace of the
    # function runs alone (trace.py: _apart_from_other_threads), and is put back exactly.
    helpers = a_user_module(f"shapecache_test_tally_{next(_tallies)}", TALLY)
    model = torch.nn.Linear(6, 6).eval()
    run = sc.cached(lambda x: helpers.tallied(kind, model(x)), backend="compile", build=build)
    made = [0] * threads
    errors: list = []

    def call(i):
        try:
            with torch.no_grad():
                for n in range(24):
                    run(torch.randn(1 + (n + i) % sizes, 6))
                    made[i] += 1
        except BaseException as error:  # noqa: BLE001  (reported by the test)
            errors.append(error)

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", RuntimeWarning)  # the call writes state: it runs uncached, said so
        workers = [threading.Thread(target=call, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=300)
        assert sc.wait(run, timeout=300)
    assert not errors, errors
    left = [w for w in warned if "another thread ran the model's code during the trace" in str(w.message)]
    assert sum(made) == 24 * threads
    assert helpers.tally(kind) == sum(made) + min(len(left), 1), [str(w.message) for w in left]
    assert len(left) <= 1  # the first trace only
    assert sc.stats(run)["builds"] == 0


DROPPED_AT_MODULE_LEVEL = """
import gc, weakref, torch, shapecache as sc
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
sc.cached(m, backend="compile")
with torch.no_grad():
    m(torch.randn(2, 8))
    m(torch.randn(2, 8))
weight = weakref.ref(m[0].weight)
del m
gc.collect()
print("weight alive after one collection:", weight() is not None)
"""


def test_a_model_dropped_at_module_level_lets_its_weights_go_in_one_collection():
    # The compiled function kept the traced module through aot_autograd's convenience
    # methods: a cycle the collector saw only once the entry had gone, a pass later.
    result = subprocess.run([sys.executable, "-c", DROPPED_AT_MODULE_LEVEL], capture_output=True, text=True,
                            timeout=300)
    assert "weight alive after one collection: False" in result.stdout, result.stdout + result.stderr[-2000:]
