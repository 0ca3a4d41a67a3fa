"""backend="compile": one torch.compile'd graph per bucket, none of them silently eager."""

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
