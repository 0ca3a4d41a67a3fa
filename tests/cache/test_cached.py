"""sc.cached end to end on CPU: modules, functions, methods, eviction, padding, stats."""

import functools
import gc
import threading
import weakref

import pytest
import torch

import shapecache as sc
from shapecache._backends import BuiltEntry
from shapecache._extension import _C
from shapecache.testing.models import SIZES, SmallConvNet


def inputs(size, batch=1):
    torch.manual_seed(size[0] * 100 + size[1])
    return torch.randn(batch, 3, *size)


def reference_outputs(net, sizes):
    with torch.no_grad():
        return {s: net(inputs(s)) for s in sizes}


@pytest.mark.parametrize("form", ["bare", "options"])
def test_module_outputs_equal_plain_calls_and_hits_count(conv_net, form):
    expected = reference_outputs(conv_net, SIZES)
    net = sc.cached(conv_net) if form == "bare" else sc.cached(conv_net, budget="1GiB", backend="eager")
    assert net is conv_net
    with torch.no_grad():
        for _ in range(2):
            for s in SIZES:
                assert torch.equal(net(inputs(s)), expected[s])
    st = sc.stats(net)
    assert (st["misses"], st["builds"], st["hits"], st["evictions"]) == (len(SIZES), len(SIZES), len(SIZES), 0)
    assert {e["bucket"] for e in st["entries"]} == {f"x=(1, 3, {h}, {w}) float32 cpu" for h, w in SIZES}
    assert all(e["hits"] == 1 and e["bytes"] == 0 and e["backend"] == "eager" for e in st["entries"])


def test_max_entries_evicts_least_recently_used_and_outputs_stay_equal(conv_net):
    sizes = SIZES[:5]
    expected = reference_outputs(conv_net, sizes)
    sc.cached(conv_net, max_entries=2)
    with torch.no_grad():
        for s in sizes:
            assert torch.equal(conv_net(inputs(s)), expected[s])
        assert torch.equal(conv_net(inputs(sizes[-1])), expected[sizes[-1]])  # a hit
    st = sc.stats(conv_net)
    assert st["evictions"] == 3 and st["hits"] == 1 and st["misses"] == 5
    held = [e["bucket"] for e in st["entries"]]
    assert held == [f"x=(1, 3, {h}, {w}) float32 cpu" for h, w in (sizes[4], sizes[3])]
    assert st["devices"]["cpu"]["entry_count"] == 2


def test_function_decorator_bare_and_with_options():
    @sc.cached
    def scale(x, factor):
        return x * factor

    @sc.cached(max_entries=1, backend="eager")
    def shift(x, *, by=1.0):
        return x + by

    x = torch.arange(4.0)
    assert torch.equal(scale(x, 2), x * 2) and torch.equal(scale(x, 3), x * 3)
    assert sc.stats(scale)["misses"] == 2  # the factor is keyed by value
    assert torch.equal(shift(x, by=2.0), x + 2) and torch.equal(shift(x), x + 1)
    assert sc.stats(shift)["evictions"] == 1
    assert scale.__name__ == "scale" and scale.__wrapped__(x, 2).equal(x * 2)


def test_method_in_class_body_gets_a_cache_per_instance():
    class Net(SmallConvNet):
        @sc.cached(max_entries=4)
        def forward(self, x):
            return super().forward(x)

    a, b = Net().eval(), Net().eval()
    with torch.no_grad():
        a(inputs((8, 8)))
        a(inputs((8, 8)))
        b(inputs((8, 8)))
    assert sc.stats(a)["hits"] == 1 and sc.stats(b)["hits"] == 0
    assert sc.stats(a)["max_entries"] == 4
    with pytest.raises(ValueError, match="decorated with shapecache.cached in its class body"):
        sc.uncached(a)
    assert sc.stats(a)["hits"] == 1  # refused before anything changed


def test_training_flag_and_grad_mode_key_separately(conv_net):
    sc.cached(conv_net)
    x = inputs((8, 8))
    conv_net.train()
    conv_net(x)
    conv_net.eval()
    conv_net(x)
    with torch.no_grad():
        conv_net(x)
    assert sc.stats(conv_net)["misses"] == 3


def test_uncached_restores_and_releases(conv_net):
    sc.cached(conv_net)
    conv_net(inputs((8, 8)))
    wrapper = conv_net.forward
    assert sc.uncached(conv_net) is conv_net
    assert "forward" not in conv_net.__dict__ and not isinstance(conv_net.forward, sc.CachedFunction)
    assert len(wrapper.stats()["entries"]) == 0
    with pytest.raises(TypeError, match="expected a function or module wrapped by shapecache.cached"):
        sc.stats(conv_net)

    def f(x):
        return x

    assert sc.uncached(sc.cached(f)) is f


def test_instance_level_forward_is_wrapped_and_restored(conv_net):
    calls = []
    original = conv_net.forward

    def logged_forward(x):
        calls.append(tuple(x.shape))
        return original(x)

    conv_net.forward = logged_forward
    sc.cached(conv_net)
    conv_net(inputs((8, 8)))
    conv_net(inputs((8, 8)))
    assert calls == [(1, 3, 8, 8)] * 2
    sc.uncached(conv_net)
    assert conv_net.forward is logged_forward


def test_clear_drops_entries(conv_net):
    sc.cached(conv_net)
    for s in SIZES[:3]:
        conv_net(inputs(s))
    sc.clear(conv_net)
    assert sc.stats(conv_net)["entries"] == []
    conv_net(inputs(SIZES[0]))
    assert sc.stats(conv_net)["builds"] == 4


def test_cached_module_is_garbage_collected():
    net = sc.cached(SmallConvNet())
    net(inputs((8, 8)))
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("padded", [False, True])
def test_a_module_whose_own_forward_holds_it_is_garbage_collected(padded):
    # A hook library's instance-level forward, a partial over the module: the cached function
    # (its __dict__, entries, crop plans and callbacks) closes a cycle through the module,
    # which the collector must see through, each reference counted once.
    def forward(module, x):
        return torch.nn.Linear.forward(module, x)

    net = torch.nn.Linear(3, 3)
    net.forward = functools.partial(forward, net)
    net = sc.cached(net, buckets={"x": {0: sc.multiple_of(4)}} if padded else None)
    net(torch.randn(2, 3))
    net(torch.randn(2, 3))
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None


def test_the_collector_sees_a_cached_functions_dict_exactly_once():
    # Once on every Python: CPython 3.11 visits a subclass's managed dict itself, 3.12 and
    # 3.13 leave it to the base type's traverse; twice or never, a cycle through it leaks.
    @sc.cached
    def f(x):
        return x

    assert sum(r is f.__dict__ for r in gc.get_referents(f)) == 1


def test_unkeyable_argument_runs_uncached_with_one_warning():
    @sc.cached
    def f(x, extra):
        return x + len(extra.items)

    class Extra:
        items = [1, 2]

    with pytest.warns(RuntimeWarning, match="argument 'extra' is an object of type Extra that cannot be keyed") as w:
        assert torch.equal(f(torch.zeros(2), Extra()), torch.full((2,), 2.0))
        f(torch.zeros(2), Extra())
    assert len([x for x in w if "cannot be keyed" in str(x.message)]) == 1
    st = sc.stats(f)
    assert st["uncached_calls"] == 2 and st["entries"] == []


def test_batch_padding_matches_plain_calls_and_shares_entries(conv_net):
    expected = {b: conv_net(inputs((8, 8), batch=b)).detach() for b in (1, 3, 4, 5)}
    sc.cached(conv_net, buckets={"x": {0: sc.power_of_two()}})
    with torch.no_grad():
        for b in (1, 3, 4, 5):
            out = conv_net(inputs((8, 8), batch=b))
            assert out.shape == expected[b].shape
            torch.testing.assert_close(out, expected[b], rtol=1e-5, atol=1e-6)
    assert [e["bucket"] for e in sc.stats(conv_net)["entries"]] == [
        "x=(8, 3, 8, 8) float32 cpu",
        "x=(4, 3, 8, 8) float32 cpu",
        "x=(1, 3, 8, 8) float32 cpu",
    ]


def test_batch_padding_of_linear_layers_matches_to_rounding():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).eval()
    x = torch.randn(3, 10, 64)
    with torch.no_grad():
        expected = mlp(x)
        sc.cached(mlp, buckets={"input": {0: sc.power_of_two()}})
        torch.testing.assert_close(mlp(x), expected, rtol=1e-6, atol=1e-6)  # as docs/buckets.md says: rounding only
    assert sc.stats(mlp)["entries"][0]["bucket"].startswith("input=(4, 10, 64)")


def test_size_above_the_largest_bucket_is_a_clear_error_and_changes_nothing(conv_net):
    sc.cached(conv_net, buckets={"x": {-1: sc.one_of([8, 16])}})
    conv_net(inputs((8, 8)))
    before = sc.stats(conv_net)
    with pytest.raises(ValueError, match="argument 'x', dimension -1: size 24 is above the largest bucket"):
        conv_net(inputs((8, 24)))
    after = sc.stats(conv_net)
    assert after["entries"] == before["entries"] and after["builds"] == before["builds"]


def test_bucketed_argument_must_be_a_tensor():
    @sc.cached(buckets={"n": {0: sc.multiple_of(4)}})
    def f(n):
        return n

    with pytest.raises(TypeError, match="argument 'n' has a bucket policy, so it must be a tensor; got int"):
        f(3)


class BytesBuilder:
    """A builder that runs the function eagerly and declares that each entry holds `nbytes`."""

    def __init__(self, function, nbytes):
        self.function, self.nbytes = function, nbytes

    def __call__(self, args, kwargs, device):
        return BuiltEntry(self.function, self.nbytes, self.function(*args, **kwargs), "eager")


def make_cached(function, nbytes, budget):
    cache = _C.ShapeCache(lambda device: budget, None)
    return _C.ShapeDispatcher(function, BytesBuilder(function, nbytes), cache, [], ["x"], None, False)


def test_byte_budget_evicts_through_the_call_path():
    f = make_cached(lambda x: x * 2, nbytes=40, budget=100)
    for n in range(1, 6):
        assert torch.equal(f(torch.ones(n)), torch.full((n,), 2.0))
    st = f.stats()
    assert st["entry_bytes"] == 80 and st["evictions"] == 3 and st["peak_bytes"] == 80
    assert [e["bucket"] for e in st["entries"]] == ["x=(5,) float32 cpu", "x=(4,) float32 cpu"]


def test_entry_larger_than_budget_falls_back_with_one_warning():
    f = make_cached(lambda x: x + 1, nbytes=500, budget=100)
    with pytest.warns(RuntimeWarning, match="holds 500 bytes, more than the budget of 100 bytes"):
        assert torch.equal(f(torch.zeros(3)), torch.ones(3))
    assert torch.equal(f(torch.zeros(3)), torch.ones(3))  # uncached: not built a second time
    st = f.stats()
    assert st["fallbacks"] == 1 and st["entries"] == [] and st["rejections"] == 1 and st["uncached_calls"] == 1


def test_shared_bytes_count_against_the_budget():
    f = make_cached(lambda x: x, nbytes=30, budget=100)
    for n in range(1, 4):
        f(torch.ones(n))
    _C._testing.build_handle(f.cache, torch.device("cpu")).set_shared_bytes(pool=20, workspace=30)
    st = f.stats()
    assert len(st["entries"]) == 1 and st["bytes"] == 80 and (st["pool_bytes"], st["workspace_bytes"]) == (20, 30)


def test_entry_running_is_pinned_against_eviction():
    seen = {}

    def f(x):
        if x.shape[0] == 1:  # while the (1,) entry runs, a nested call needs room
            seen["inner"] = g(torch.ones(2))
            seen["entries"] = [e["bucket"] for e in g.stats()["entries"]]
        return x

    g = make_cached(f, nbytes=60, budget=100)
    g(torch.ones(1))  # build: nested (2,) entry is built first, then (1,) evicts it
    with pytest.warns(RuntimeWarning, match="the entry for x=\\(2,\\) float32 cpu was not kept: it holds 60 bytes"):
        g(torch.ones(1))  # hit: pinned while it runs; the nested (2,) entry cannot fit and falls back
    assert seen["entries"] == ["x=(1,) float32 cpu"]
    assert g.stats()["fallbacks"] == 1


def test_a_cached_module_cannot_be_copied_and_the_error_says_why_and_what_to_do(conv_net):
    import copy
    import pickle

    sc.cached(conv_net)
    for attempt in (lambda: copy.deepcopy(conv_net), lambda: pickle.dumps(conv_net)):
        with pytest.raises(TypeError, match="cannot be copied or pickled: its compiled entries belong to this process. "
                                            "To copy or save a cached module, call shapecache.uncached"):
            attempt()
    sc.uncached(conv_net)
    assert isinstance(copy.deepcopy(conv_net), SmallConvNet)


def test_a_cached_method_on_a_slots_class_without_weakref_says_what_to_add():
    class Slotted:
        __slots__ = ("scale",)

        def __init__(self):
            self.scale = 2.0

        @sc.cached
        def run(self, x):
            return x * self.scale

    with pytest.raises(TypeError, match="defines __slots__ without '__weakref__'; add '__weakref__' to its __slots__"):
        Slotted().run(torch.ones(2))

    class WithWeakref(Slotted):
        __slots__ = ("__weakref__",)

    assert torch.equal(WithWeakref().run(torch.ones(2)), torch.full((2,), 2.0))


def test_a_cached_modules_forward_has_the_signature_of_a_bound_forward(conv_net):
    import inspect

    expected = inspect.signature(conv_net.forward)
    sc.cached(conv_net)
    assert inspect.signature(conv_net.forward) == expected
    assert list(inspect.signature(conv_net.forward).parameters) == ["x", "scale"]
    bound = inspect.signature(conv_net.forward).bind(torch.ones(1, 3, 8, 8), 2.0)  # positional binding works
    assert bound.arguments["scale"] == 2.0


def test_nested_tensors_run_uncached_with_one_warning():
    f = sc.cached(lambda x: x * 2)
    with pytest.warns(UserWarning):  # torch's own: strided nested tensors are a prototype
        strided = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)])
    jagged = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)
    with pytest.warns(RuntimeWarning, match="argument 'x' is a nested tensor .* that cannot be keyed; such calls run uncached"):
        out = f(strided)
    assert all(torch.equal(a, b * 2) for a, b in zip(out.unbind(), strided.unbind()))
    f(jagged)
    assert sc.stats(f)["uncached_calls"] == 2 and sc.stats(f)["entries"] == []


def test_meta_tensors_with_the_default_budget_are_cached():
    f = sc.cached(lambda x: x * 2)
    out = f(torch.ones(3, device="meta"))
    assert out.device.type == "meta" and out.shape == (3,)
    assert sc.stats(f)["devices"]["meta"]["budget"] is None  # no memory to bound


def test_the_entries_served_on_a_thread_are_noted_without_a_scan_and_only_there():
    from shapecache.cache import entries_served

    f = sc.cached(lambda x: x * 2, backend="eager")
    f(torch.ones(1))  # built before the record: used, not built, inside it
    with entries_served() as outer:
        f(torch.ones(1))
        with entries_served() as inner:
            f(torch.ones(2))  # built inline inside both
            f(torch.ones(2))
        other = threading.Thread(target=f, args=(torch.ones(3),))  # another thread's call is not this one's
        other.start()
        other.join()
    ids = {e["bucket"]: e["id"] for e in sc.stats(f)["entries"]}
    one, two = ids["x=(1,) float32 cpu"], ids["x=(2,) float32 cpu"]
    assert (inner.used, inner.built) == ([two], [two])
    assert (sorted(outer.used), outer.built) == (sorted([one, two]), [two])
    f(torch.ones(1))
    assert len(outer.used) == 2  # nothing noted once closed
