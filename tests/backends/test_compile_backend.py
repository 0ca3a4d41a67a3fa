"""backend="compile": one torch.compile'd graph per bucket, none of them silently eager."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import shapecache as sc
from shapecache.testing.models import SIZES


def test_inductor_per_bucket_on_a_conv_net(conv_net):
    sizes = SIZES[:5]
    x = {s: torch.randn(1, 3, *s) for s in sizes}
    with torch.no_grad():
        expected = {s: conv_net(x[s]) for s in sizes}
        sc.cached(conv_net, backend="compile")
        for _ in range(2):
            for s in sizes:
                torch.testing.assert_close(conv_net(x[s]), expected[s], rtol=1e-5, atol=1e-5)
    st = sc.stats(conv_net)
    assert [e["backend"] for e in st["entries"]] == ["compile"] * 5
    assert st["hits"] == 5 and st["builds"] == 5


def test_more_buckets_than_dynamos_recompile_limit_all_compile():
    limit = torch._dynamo.config.recompile_limit
    n = limit + 4

    @sc.cached(backend="compile", compile_options={"backend": "eager"})
    def f(x):
        return torch.nn.functional.gelu(x) * 3

    graphs_before = counters["stats"]["unique_graphs"]
    for rows in range(1, n + 1):
        x = torch.randn(rows, 5)
        torch.testing.assert_close(f(x), torch.nn.functional.gelu(x) * 3)
    assert counters["stats"]["unique_graphs"] - graphs_before == n
    assert [e["backend"] for e in sc.stats(f)["entries"]] == ["compile"] * n

    # hits run the compiled graphs: no new graphs, no recompiles
    for rows in range(1, n + 1):
        f(torch.randn(rows, 5))
    assert counters["stats"]["unique_graphs"] - graphs_before == n
    assert sc.stats(f)["hits"] == n


def test_a_bucket_dynamo_cannot_compile_is_reported_not_hidden():
    @sc.cached(backend="compile", compile_options={"backend": "eager"})
    def no_tensor_code(x):
        return x

    with pytest.warns(RuntimeWarning, match="torch.compile made no graph for a new bucket"):
        no_tensor_code(torch.ones(2))
    assert sc.stats(no_tensor_code)["entries"][0]["backend"] == "eager"


def test_evicting_a_bucket_releases_its_compiled_code():
    import gc
    import weakref

    from shapecache._backends import compile as backends

    made = []
    original = backends.fresh_code_copy

    def recording_copy(function):
        copy = original(function)
        made.append(weakref.ref(copy))
        return copy

    backends.fresh_code_copy = recording_copy
    try:

        @sc.cached(backend="compile", max_entries=1, compile_options={"backend": "eager"})
        def f(x):
            return x.cos()

        f(torch.ones(2))
        f(torch.ones(3))  # evicts the (2,) bucket
    finally:
        backends.fresh_code_copy = original
    gc.collect()
    assert [r() is None for r in made] == [True, False]


class UserNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Holder:
    def __init__(self):
        self.scale = 3.0

    @sc.cached(backend="compile", compile_options={"backend": "eager"})
    def run(self, x):
        return x * self.scale + 1


def sequential():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()


@pytest.mark.parametrize("kind", ["function", "method", "user module", "torch-defined module"])
def test_every_bucket_of_every_kind_of_callable_compiles(kind):
    # A torch-defined module's forward (nn.Sequential) used to compile inside one frame of
    # torch's that every bucket shared: from the 9th bucket on nothing compiled, and the
    # entries said "eager".
    if kind == "function":
        call = sc.cached(lambda x: torch.sin(x) * 2, backend="compile", compile_options={"backend": "eager"})
        reference = lambda x: torch.sin(x) * 2  # noqa: E731
        target = call
    elif kind == "method":
        holder = Holder()
        call = holder.run
        reference = lambda x: x * 3.0 + 1  # noqa: E731
        target = call
    else:
        module = UserNet().eval() if kind == "user module" else sequential()
        with torch.no_grad():
            plain = [module(torch.ones(n, 4)) for n in range(1, 13)]
        reference = lambda x: plain[x.shape[0] - 1]  # noqa: E731
        call = target = sc.cached(module, backend="compile", compile_options={"backend": "eager"})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no bucket may fall back to eager with a warning
        for n in range(1, 13):
            x = torch.ones(n, 4)
            torch.testing.assert_close(call(x), reference(x))
    st = sc.stats(target)
    assert len(st["entries"]) == 12 and {e["backend"] for e in st["entries"]} == {"compile"}


CHARGED_ENTRIES = """
import json, sys, torch
import torch._inductor.config as inductor_config
import shapecache as sc

torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).eval()
budget = int(sys.argv[1]) if len(sys.argv) > 1 else None
freezing = {"options": {"freezing": True}}  # inductor's freezing, for this cache's builds only
net = sc.cached(mlp, backend="compile", compile_options=freezing, budget=budget)
accounted = []
with torch.no_grad():
    for n in ((4, 8, 12, 16) if budget is None else (4, 8, 12, 16, 20, 24, 4, 8)):
        net(torch.randn(n, 256))
        accounted.append(sc.stats(net)["bytes"])
st = sc.stats(net)
print(json.dumps({"sizes": [e["bytes"] for e in st["entries"]], "entry_bytes": st["entry_bytes"],
                  "freezing": inductor_config.freezing, "accounted": accounted, "evictions": st["evictions"]}))
"""


def run_charged_entries(*argv) -> dict:
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CHARGED_ENTRIES, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_compiled_cpu_entries_are_charged_what_their_builds_left_allocated_and_the_budget_bounds_them():
    # Each run in a process of its own: the heap figure is the process's, and builds would
    # reuse what earlier ones of the process loaded.
    from shapecache._backends.host_memory import heap_bytes

    if heap_bytes() is None:
        pytest.skip("the C library reports no heap figures here (not glibc >= 2.33)")
    measured = run_charged_entries()
    assert all(b > 0 for b in measured["sizes"]) and measured["entry_bytes"] == sum(measured["sizes"])
    assert measured["freezing"] is False  # the process's setting is left as it was
    budget = int(2.5 * min(measured["sizes"]))  # about two and a half entries (the first also pays one-time costs)
    bounded = run_charged_entries(str(budget))
    assert max(bounded["accounted"]) <= budget and bounded["evictions"] > 0
