"""backend="auto", upgrade=True: a bucket is served at once by what "auto" builds; its first hit
asks the worker to compile it with inductor and measure both forms, and the compiled form
replaces the entry where it pays (python/shapecache/_backends/upgrade.py; csrc/cache/
miss_policy.h, the Upgrade rule).

On the CPU "auto" builds the eager entry, so each test compares the upgraded bucket with the
plain call. The functions here that are meant to be upgraded are chains of pointwise
operations, which inductor fuses into one loop where eager makes a pass over memory per
operation: their compiled form is several times faster, far past the threshold, whatever else
the machine runs.
"""

import threading

import pytest
import torch

import shapecache as sc
from shapecache import _background
from shapecache._backends import upgrade

pytestmark = pytest.mark.slow

WAIT = 240  # seconds: a bound on an inductor compile of a small graph on a loaded 2-core machine


def chain(x):
    for _ in range(12):
        x = torch.sin(x) * 1.01 + 0.1
    return x


class ChainModel(torch.nn.Module):
    """A linear layer, then a pointwise chain: weights the compiled form must read where they are."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        return chain(self.linear(x))


BUCKET = "x=({0}, {0}) float32 cpu"  # how stats name a bucket of `chain`


def counts(cached_thing) -> dict:
    stats = sc.stats(cached_thing)
    return {key: stats[key] for key in ("upgrades", "upgrades_not_kept", "pending_builds")}


def backends(cached_thing) -> list:
    return [entry["backend"] for entry in sc.stats(cached_thing)["entries"]]


def hit_until_upgraded(model, x, plain, upgrades: int, tries: int = 4) -> None:
    """Hits the bucket and waits until `upgrades` upgrades were kept. An upgrade asked for at a
    hit may wait for a later one: where the build queue (shared by the process's other cached
    functions) has no room for it, or where the model seemed changed while it was built (the
    Upgrade rule, csrc/cache/miss_policy.h); each such hit asks again."""
    for _ in range(tries):
        torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-5)
        assert sc.wait(model, timeout=WAIT)
        if sc.stats(model)["upgrades"] >= upgrades:
            return
    stats = sc.stats(model)
    raise AssertionError(f"not upgraded {upgrades} times after {tries} hits: "
                         f"{ {k: stats[k] for k in ('upgrades', 'upgrades_not_kept', 'invalidations', 'builds')} }")


def test_the_threshold_is_a_gain_of_three_percent():
    assert upgrade.MIN_SPEEDUP == 1.03
    assert upgrade.pays(1.0, 1 / 1.03)
    assert not upgrade.pays(1.0, 0.98)
    assert not upgrade.pays(1.0, 1.5)


@pytest.mark.parametrize("entry, compiled, captured, chosen", [
    (1.0, 0.9, None, "compiled"),
    (1.0, 0.99, None, "entry"),  # under the threshold: the entry stays
    (1.0, 0.9, 0.8, "captured"),  # pays against the compiled form
    (1.0, 0.9, 0.89, "compiled"),  # faster, but not by the threshold: its pool blocks are not worth it
    (1.0, 0.99, 0.96, "captured"),  # the compiled form does not pay; its capture does, against the entry
    (1.0, 0.99, 0.98, "entry"),
    (1.0, 1.2, 0.5, "captured"),  # the capture of a graph slower uncaptured (launch-bound)
])
def test_each_form_replaces_the_one_that_would_serve_only_where_it_pays(entry, compiled, captured, chosen):
    assert upgrade.chosen_form(entry, compiled, captured) == chosen


def test_a_graph_is_captured_only_where_inductor_would_capture_it():
    # inductor's own checks before a capture (compile_fx.py, cudagraphs on), on graphs traced as
    # an upgrade traces them; the device the capture would run on is given.
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x).relu()

    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return torch.nonzero(x)  # its size is known only when it runs

    x = torch.randn(2, 4)
    plain = torch.export.export(Plain(), (x,)).module()
    assert upgrade.graph_refusal(plain, torch.device("cpu")) == ""
    assert "is on cpu" in upgrade.graph_refusal(plain, torch.device("cuda", 0))  # its work would run once, at capture
    data_dependent = torch.export.export(DataDependent(), (x,)).module()
    assert "nonzero" in upgrade.graph_refusal(data_dependent, torch.device("cpu"))


def test_a_capture_on_the_worker_waits_for_a_torch_whose_captures_leave_other_threads_draws_alone():
    from shapecache._backends import graph_pool

    assert not graph_pool.captures_leave_other_threads_draws_alone("2.11.0+cu130")  # what GPU users run
    assert not graph_pool.captures_leave_other_threads_draws_alone("2.12.1")
    assert not graph_pool.captures_leave_other_threads_draws_alone("2.13.0a0+git1234")
    assert graph_pool.captures_leave_other_threads_draws_alone("2.13.0+cu130")
    assert graph_pool.captures_leave_other_threads_draws_alone("2.14.0.dev20261101")


def test_a_bucket_is_served_at_once_then_by_its_compiled_graph_once_it_is_called_again():
    cached = sc.cached(chain, upgrade=True)
    x = torch.randn(256, 256)
    expected = chain(x)
    assert torch.equal(cached(x), expected)  # the first call is the eager entry's: the plain call
    assert sc.wait(cached, timeout=WAIT)
    assert counts(cached) == {"upgrades": 0, "upgrades_not_kept": 0, "pending_builds": 0}  # called once: not compiled
    assert torch.equal(cached(x), expected)  # its first hit asks for the upgrade
    assert sc.wait(cached, timeout=WAIT)
    assert counts(cached) == {"upgrades": 1, "upgrades_not_kept": 0, "pending_builds": 0}
    [entry] = sc.stats(cached)["entries"]
    assert entry["backend"] == "compile"
    assert entry["bytes"] == 0  # a function of its input alone: the graph holds nothing
    for _ in range(3):
        torch.testing.assert_close(cached(x), expected, rtol=1e-5, atol=1e-5)
    stats = sc.stats(cached)
    assert (stats["misses"], stats["hits"], stats["builds"]) == (1, 4, 1)
    assert stats["background_builds"] == 0  # the bucket's build was inline; its upgrade is counted apart


def test_an_upgraded_module_reads_its_weights_where_they_are():
    torch.manual_seed(0)
    model = ChainModel().eval()
    plain = ChainModel().eval()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(32, 64)
    with torch.no_grad():
        sc.cached(model, upgrade=True)
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)  # the eager entry: the plain call
        hit_until_upgraded(model, x, plain, upgrades=1)
        assert counts(model)["upgrades"] == 1 and backends(model) == ["compile"]
        # Freezing off: no copy of the linear layer's weights is charged to (or held by) the entry.
        assert sc.stats(model)["entries"][0]["bytes"] == 0
        torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-5)
        # New weights, loaded in place: the answer is the new weights', as the plain call's.
        state = {k: v * 2 for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        plain.load_state_dict(state)
        for _ in range(4):  # read as it is: nothing is rebuilt, the bucket is never given up
            torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-5)
            model.load_state_dict(state := {k: v + 0.01 for k, v in model.state_dict().items()})
            plain.load_state_dict(state)
        # A weight replaced (a new Parameter) is a change: the entry is rebuilt (eager, then upgraded again).
        model.linear.weight = torch.nn.Parameter(model.linear.weight * 0.5)
        plain.linear.weight = torch.nn.Parameter(plain.linear.weight * 0.5)
        torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-5)  # rebuilt eager
        hit_until_upgraded(model, x, plain, upgrades=2)
        torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-5)
    stats = sc.stats(model)
    assert (stats["invalidations"], stats["upgrades"], stats["uncached_calls"]) == (1, 2, 0), stats
    assert backends(model) == ["compile"]


class Normalised(torch.nn.Module):
    """BatchNorm: in training its calls update the running statistics."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.norm = torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16)

    def forward(self, x):
        return chain(self.norm(self.linear(x)))


class Dropped(torch.nn.Module):
    def forward(self, x):
        return chain(torch.nn.functional.dropout(x, 0.5, training=True))


def accumulate(total, x):
    total.add_(x)
    return chain(total)


@pytest.mark.parametrize("case", ["a buffer written", "random numbers", "an input written"])
def test_a_bucket_whose_calls_do_more_than_compute_is_not_upgraded_and_nothing_is_done_twice(case):
    # Measuring would run the call again: the module's state, the caller's tensors and the
    # random stream must be as the plain calls leave them, and the answers the plain ones.
    x = torch.randn(64, 16)
    if case == "a buffer written":
        cached, plain, reason = sc.cached(Normalised().train(), upgrade=True), Normalised().train(), "writes the buffer"
    elif case == "random numbers":
        cached, plain, reason = sc.cached(Dropped(), upgrade=True), Dropped(), "draws random numbers"
    else:
        cached, plain, reason = sc.cached(accumulate, upgrade=True), accumulate, "writes its input"
    total, plain_total = torch.zeros(64, 16), torch.zeros(64, 16)
    with pytest.warns(RuntimeWarning, match=f"a bucket is not upgraded: its graph {reason}"):
        for seed in range(4):
            args, plain_args = ((total, x), (plain_total, x)) if case == "an input written" else ((x,), (x,))
            torch.manual_seed(seed)
            got = cached(*args)
            torch.manual_seed(seed)
            assert torch.equal(got, plain(*plain_args))
            if seed == 1:
                assert sc.wait(cached, timeout=WAIT)
    assert counts(cached) == {"upgrades": 0, "upgrades_not_kept": 1, "pending_builds": 0}
    assert backends(cached) == ["eager"]
    if case == "a buffer written":
        assert cached.norm.num_batches_tracked.item() == plain.norm.num_batches_tracked.item() == 4
        assert torch.equal(cached.norm.running_mean, plain.norm.running_mean)
    if case == "an input written":
        assert torch.equal(total, plain_total)


def test_a_bucket_that_cannot_be_compiled_keeps_its_entry_and_is_not_tried_again():
    def branchy(x):
        if x.sum() > 0:  # data-dependent: torch.export cannot capture it as one graph
            return x * 2
        return x - 1

    cached = sc.cached(branchy, upgrade=True, max_entries=1)
    a, b = torch.ones(3), torch.ones(4)
    with pytest.warns(RuntimeWarning, match="a bucket is not upgraded: it could not be compiled"):
        for _ in range(2):
            assert torch.equal(cached(a), a * 2)
        assert sc.wait(cached, timeout=WAIT)
    assert counts(cached) == {"upgrades": 0, "upgrades_not_kept": 1, "pending_builds": 0}
    assert backends(cached) == ["eager"]
    assert torch.equal(cached(-a), -a - 1)  # the eager entry still answers, both ways
    for _ in range(2):
        assert torch.equal(cached(b), b * 2)  # evicts a's entry; b's is tried
    assert sc.wait(cached, timeout=WAIT)
    assert counts(cached)["upgrades_not_kept"] == 2
    background_builds = sc.stats(cached)["background_builds"]
    for _ in range(2):
        assert torch.equal(cached(a), a * 2)  # a's entry built again: its upgrade is not tried again
    assert sc.wait(cached, timeout=WAIT)
    assert sc.stats(cached)["background_builds"] == background_builds
    assert counts(cached)["upgrades_not_kept"] == 2
    sc.clear(cached)  # clear forgets it: the next entry of a is tried again
    for _ in range(2):
        assert torch.equal(cached(a), a * 2)
    assert sc.wait(cached, timeout=WAIT)
    assert counts(cached)["upgrades_not_kept"] == 3


def test_an_upgrade_is_not_a_use_the_least_recently_used_entry_goes_first():
    cached = sc.cached(chain, upgrade=True, max_entries=2)
    a, b, c = torch.randn(64, 64), torch.randn(72, 72), torch.randn(80, 80)
    with _background.build_lock():  # compiled builds wait for it: a's upgrade ends after b's calls
        for x in (a, a, b, b):
            assert torch.equal(cached(x), chain(x))
    assert sc.wait(cached, timeout=WAIT)
    assert counts(cached)["upgrades"] == 2
    cached(c)  # a was used least recently, whatever its upgrade did since: it goes
    assert [e["bucket"] for e in sc.stats(cached)["entries"]] == [BUCKET.format(80), BUCKET.format(72)]


def test_an_entry_evicted_while_its_upgrade_waits_is_not_replaced_and_its_next_entry_asks_again():
    cached = sc.cached(chain, upgrade=True, max_entries=1)
    a, b = torch.randn(64, 64), torch.randn(96, 96)
    with _background.build_lock():  # compiled builds wait for it: a's upgrade cannot finish
        for x in (a, a, b):
            assert torch.equal(cached(x), chain(x))  # b's entry evicts a's
    assert sc.wait(cached, timeout=WAIT)
    assert counts(cached)["upgrades"] == 0 and backends(cached) == ["eager"]  # b's, called once
    for _ in range(2):
        torch.testing.assert_close(cached(a), chain(a), rtol=1e-5, atol=1e-5)  # built again, then asks
    assert sc.wait(cached, timeout=WAIT)
    assert counts(cached) == {"upgrades": 1, "upgrades_not_kept": 0, "pending_builds": 0}
    assert backends(cached) == ["compile"]
    torch.testing.assert_close(cached(a), chain(a), rtol=1e-5, atol=1e-5)


def test_threads_get_the_plain_answer_before_during_and_after_upgrades():
    cached = sc.cached(chain, upgrade=True)
    inputs = [torch.randn(128, 128), torch.randn(160, 96)]
    expected = [chain(x) for x in inputs]
    errors = []

    def serve():
        try:
            for _ in range(40):
                for x, want in zip(inputs, expected):
                    torch.testing.assert_close(cached(x), want, rtol=1e-5, atol=1e-5)
        except BaseException as error:  # noqa: BLE001  (reported by the test)
            errors.append(error)

    threads = [threading.Thread(target=serve) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert not errors, errors[0]
    assert sc.wait(cached, timeout=WAIT)
    assert counts(cached) == {"upgrades": 2, "upgrades_not_kept": 0, "pending_builds": 0}
    assert backends(cached) == ["compile", "compile"]
    for x, want in zip(inputs, expected):
        torch.testing.assert_close(cached(x), want, rtol=1e-5, atol=1e-5)


def test_upgrade_is_checked_where_the_cache_is_made():
    with pytest.raises(ValueError, match=r"upgrade=True was given with backend='eager'.*use backend='auto'"):
        sc.cached(chain, backend="eager", upgrade=True)
    with pytest.raises(TypeError, match=r"upgrade='yes' \(str\): expected True or False"):
        sc.cached(chain, upgrade="yes")
    cached = sc.cached(chain)  # off unless asked for
    x = torch.randn(8, 8)
    for _ in range(2):
        cached(x)
    assert sc.wait(cached, timeout=WAIT)
    assert counts(cached) == {"upgrades": 0, "upgrades_not_kept": 0, "pending_builds": 0}
    assert backends(cached) == ["eager"]


def test_what_a_graph_does_besides_computing_is_read_from_its_trace():
    from shapecache._backends.trace import effects

    def exported(function, *args):
        module = type("Call", (torch.nn.Module,), {"forward": lambda self, *a: function(*a)})()
        return torch.export.export(module, args)

    q = torch.randn(1, 2, 8, 4)
    norm = torch.nn.BatchNorm1d(4)
    cases = {
        "attention at inference": (lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q), ""),
        "dropout in eval": (lambda q: torch.nn.functional.dropout(q, 0.5, training=False), ""),
        "dropout in training": (lambda q: torch.nn.functional.dropout(q, 0.5, training=True), "draws random numbers"),
        "attention with dropout": (lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1),
                                   "draws random numbers"),
        "noise": (lambda q: q + torch.randn_like(q), "draws random numbers"),
        "rrelu in eval": (lambda q: torch.nn.functional.rrelu(q, training=False), ""),
        "rrelu in training": (lambda q: torch.nn.functional.rrelu(q, training=True), "draws random numbers"),
        "an input written": (lambda q: q.mul_(2), "writes its input"),
    }
    for name, (function, said) in cases.items():
        found = effects(exported(function, q.clone()))
        assert found.startswith(said) and bool(found) == bool(said), (name, found)
    assert effects(torch.export.export(norm.train(), (torch.randn(8, 4),))).startswith("writes the buffer")
    assert effects(torch.export.export(norm.eval(), (torch.randn(8, 4),))) == ""


class LayerDrop(torch.nn.Module):
    """Skips its layer at random, drawing from Python's or numpy's random numbers."""

    def __init__(self, draw):
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.draw = torch.nn.Linear(16, 16), draw

    def forward(self, x):
        return chain(self.linear(x) if self.draw() < 0.5 else x)


class ScaledInPlace(torch.nn.Module):
    """Writes its own parameter in place on every call."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(16), requires_grad=False)

    def forward(self, x):
        self.scale.mul_(1.5)
        return chain(x * self.scale)


@pytest.mark.parametrize("case", ["python random", "numpy random", "a parameter written"])
def test_randomness_outside_torch_and_writes_of_a_parameter_are_not_upgraded(case):
    import random

    import numpy

    make = {"python random": lambda: LayerDrop(random.random), "numpy random": lambda: LayerDrop(numpy.random.rand),
            "a parameter written": ScaledInPlace}[case]
    cached, plain = sc.cached(make(), upgrade=True), make()
    reason = {"python random": "draws Python's random numbers", "numpy random": "draws numpy's random numbers",
              "a parameter written": "writes the parameter scale,"}[case]
    x = torch.randn(8, 16)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=f"a bucket is not upgraded: its graph {reason}"):
        for seed in range(6):
            random.seed(seed)
            numpy.random.seed(seed)
            got = cached(x)
            random.seed(seed)
            numpy.random.seed(seed)
            torch.testing.assert_close(got, plain(x), rtol=0, atol=0)
            if seed == 1:
                assert sc.wait(cached, timeout=WAIT)
    assert counts(cached) == {"upgrades": 0, "upgrades_not_kept": 1, "pending_builds": 0}
    if case == "a parameter written":
        # the calls' writes, and no more (the trace wrote its copy; nothing else ran the call)
        assert torch.equal(cached.scale, plain.scale)


def test_a_compiled_entry_is_not_run_while_torch_export_traces_another_call():
    # torch.export marks the whole process as exporting, and a compiled graph run meanwhile can
    # fail in torch's trace metadata: its call runs uncached, and the entry stays.
    cached = sc.cached(chain, upgrade=True)
    x = torch.randn(64, 64)
    for _ in range(2):
        cached(x)
    assert sc.wait(cached, timeout=WAIT) and backends(cached) == ["compile"]
    before = sc.stats(cached)
    torch.compiler._is_exporting_flag = True  # as another thread's torch.export sets it
    try:
        assert torch.equal(cached(x), chain(x))  # the plain call's answer, exactly: it ran uncached
    finally:
        torch.compiler._is_exporting_flag = False
    after = sc.stats(cached)
    assert after["uncached_calls"] == before["uncached_calls"] + 1 and after["hits"] == before["hits"]
    torch.testing.assert_close(cached(x), chain(x), rtol=1e-5, atol=1e-5)
    assert sc.stats(cached)["hits"] == before["hits"] + 1 and backends(cached) == ["compile"]


def test_an_upgraded_entry_sees_requires_grad_and_a_weight_changed_in_shape_in_place():
    torch.manual_seed(0)
    model, plain = ChainModel().eval(), ChainModel().eval()
    plain.load_state_dict(model.state_dict())
    model.requires_grad_(False)
    plain.requires_grad_(False)
    x = torch.randn(32, 64)
    sc.cached(model, upgrade=True)
    for _ in range(2):
        model(x)
    assert sc.wait(model, timeout=WAIT) and backends(model) == ["compile"]
    for m in (model, plain):
        m.linear.requires_grad_(True)  # unfrozen: its gradient is asked for again
    model(x).sum().backward()
    plain(x).sum().backward()
    torch.testing.assert_close(model.linear.weight.grad, plain.linear.weight.grad, rtol=1e-5, atol=1e-5)
    assert sc.stats(model)["invalidations"] == 1  # rebuilt (eager), and asks for its upgrade again
    with torch.no_grad():  # (a bucket of its own: the key holds the grad mode)
        for _ in range(2):
            model(x)
        assert sc.wait(model, timeout=WAIT) and backends(model) == ["compile", "eager"]
        for m in (model, plain):
            m.linear.weight.t_()  # same memory, other strides: read where it is, it is a change
        torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-5)
    assert sc.stats(model)["invalidations"] == 2 and sc.stats(model)["uncached_calls"] == 0
