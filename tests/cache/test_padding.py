"""Padded buckets: every output is cropped to what the plain call returns, or the call runs plain.

Functions here commute with zero padding at the end of a dimension (the contract of a padded
bucket, see docs/buckets.md): element-wise maps, sums over any dimension of zero-preserving values,
transposes, and functions of several arguments. Whatever the bucket policies, the cached call
must equal the plain one in shape and value.
"""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shapecache as sc

ONE_ARGUMENT = {
    "scale": lambda x: x * 2 - 1,
    "sin": torch.sin,
    "sum over dim 0": lambda x: x.sum(0),
    "sum over dim 1": lambda x: torch.relu(x).sum(1),
    "sum keeping dim 1": lambda x: (x * 3).sum(1, keepdim=True),
    "total": lambda x: x.sum(),
    "transpose": lambda x: x.t() + 1,
    "outer of sums": lambda x: x.sum(1)[:, None] * x.sum(0)[None, :],
    "with a constant": lambda x: (x * 2, torch.ones(8), {"rows": x.sum(1)}),
}
TWO_ARGUMENTS = {
    "each its own": lambda a, b: (a * 2, b.sum(0)),
    "scaled by the other's total": lambda a, b: a * b.sum(),
    "transposed pair": lambda a, b: [a.t(), b.t() * 3],
    "product of sums": lambda a, b: a.sum(1)[:, None] * b.sum(1)[None, :],
}

policies = st.one_of(
    st.just(None),
    st.builds(sc.power_of_two),
    st.integers(2, 6).map(sc.multiple_of),
    st.just(sc.one_of([4, 12])),
)
shapes = st.tuples(st.integers(1, 9), st.integers(1, 9))


def buckets_of(names, chosen):
    out = {}
    for name, (first, second) in zip(names, chosen, strict=True):
        dims = {d: p for d, p in ((0, first), (-1, second)) if p is not None}
        if dims:
            out[name] = dims
    return out


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(ONE_ARGUMENT)),
    chosen=st.tuples(st.tuples(policies, policies)),
    sizes=st.lists(shapes, min_size=1, max_size=4),
)
def test_one_argument_under_any_policy_equals_the_plain_call(name, chosen, sizes):
    function = ONE_ARGUMENT[name]
    cached = sc.cached(lambda x: function(x), buckets=buckets_of(["x"], chosen))
    for size in sizes:
        x = torch.randn(size)
        expected = function(x)
        torch.testing.assert_close(cached(x), expected, rtol=1e-5, atol=1e-5)
    assert sc.stats(cached)["uncached_calls"] == 0


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(TWO_ARGUMENTS)),
    chosen=st.tuples(st.tuples(policies, policies), st.tuples(policies, policies)),
    sizes=st.lists(st.tuples(shapes, shapes), min_size=1, max_size=3),
)
def test_two_arguments_under_any_policies_equal_the_plain_call(name, chosen, sizes):
    function = TWO_ARGUMENTS[name]
    cached = sc.cached(lambda a, b: function(a, b), buckets=buckets_of(["a", "b"], chosen))
    for size_a, size_b in sizes:
        a, b = torch.randn(size_a), torch.randn(size_b)
        torch.testing.assert_close(cached(a, b), function(a, b), rtol=1e-5, atol=1e-5)


def test_the_sum_over_a_padded_batch_keeps_the_plain_calls_length():
    # The rule this replaced narrowed every output dimension that matched the first padded
    # dimension: x.sum(0) of a (3, 5) x padded to (4, 8) came back with 6 values, not 5.
    f = sc.cached(lambda x: x.sum(0), buckets={"x": {0: sc.power_of_two(), 1: sc.multiple_of(8)}})
    x = torch.randn(3, 5)
    assert f(x).shape == (5,)
    torch.testing.assert_close(f(x), x.sum(0))


def test_a_function_that_cannot_run_on_fake_tensors_runs_plain_with_one_warning():
    f = sc.cached(lambda x: x[x > 0] * 2, buckets={"x": {0: sc.multiple_of(4)}})  # size depends on values
    x = torch.tensor([1.0, -2.0, 3.0])
    with pytest.warns(RuntimeWarning, match="cannot tell the sizes of a padded call's outputs") as caught:
        assert torch.equal(f(x), torch.tensor([2.0, 6.0]))
        assert torch.equal(f(-x), torch.tensor([4.0]))
    assert len([w for w in caught if "cannot tell" in str(w.message)]) == 1
    st_ = sc.stats(f)
    assert st_["uncached_calls"] == 2 and st_["entries"] == []
    assert torch.equal(f(torch.ones(4)), torch.full((4,), 2.0))  # an exact bucket needs no crop: cached
    assert len(sc.stats(f)["entries"]) == 1


def test_cached_functions_reached_while_sizing_outputs_build_nothing_from_fake_tensors():
    inner = sc.cached(lambda x: x * 2)
    outer = sc.cached(lambda x: inner(x).sum(0), buckets={"x": {0: sc.power_of_two()}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (3, 5):
            x = torch.randn(n, 4)
            torch.testing.assert_close(outer(x), (x * 2).sum(0))
    # inner ran at the padded sizes only (4 and 8 rows), never on the fake (3, 4) or (5, 4)
    assert sorted(e["bucket"] for e in sc.stats(inner)["entries"]) == ["x=(4, 4) float32 cpu", "x=(8, 4) float32 cpu"]


def test_outputs_are_sized_once_per_distinct_sizes():
    traced = []

    def f(x):
        traced.append(type(x).__name__)
        return x.sum(1)

    cached = sc.cached(f, buckets={"x": {0: sc.multiple_of(4)}})
    for n in (3, 3, 2, 3, 2):
        cached(torch.ones(n, 2))
    # one fake run per distinct size (3 and 2 rows); every call runs the shared (4, 2) bucket's
    # entry, which the eager backend's entry is the function itself
    assert traced.count("FakeTensor") == 2 and traced.count("Tensor") == 5
    assert sc.stats(cached)["builds"] == 1


def test_calls_of_one_bucket_padded_in_different_dimensions_are_cropped_each_to_its_own_shape():
    # 1x4 and 3x1 share the bucket 3x4, padded once in rows and once in columns, from the same size.
    function = ONE_ARGUMENT["outer of sums"]
    cached = sc.cached(lambda x: function(x), buckets={"x": {0: sc.multiple_of(3), 1: sc.one_of([4, 12])}})
    for size in [(1, 4), (3, 1), (1, 4)]:
        x = torch.randn(size)
        torch.testing.assert_close(cached(x), function(x), rtol=1e-5, atol=1e-5)
    # Two arguments, one padded at a time, in the same dimension from the same size.
    pair = TWO_ARGUMENTS["product of sums"]
    cached_pair = sc.cached(lambda a, b: pair(a, b), buckets={"a": {0: sc.multiple_of(3)}, "b": {0: sc.multiple_of(3)}})
    for size_a, size_b in [((1, 2), (3, 2)), ((3, 2), (1, 2))]:
        a, b = torch.randn(size_a), torch.randn(size_b)
        torch.testing.assert_close(cached_pair(a, b), pair(a, b), rtol=1e-5, atol=1e-5)


def test_a_stream_of_new_padded_sizes_leaves_torchs_fake_tensor_cache_as_it_was():
    # Each new size plans its crop with a fake-tensor run; FakeTensorMode's operator cache is
    # one dict for the process, never emptied, which those runs would fill size after size.
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    model = sc.cached(model, backend="eager", buckets={"input": {0: sc.multiple_of(8)}}, max_entries=2)
    before = len(FakeTensorMode.cache)
    with torch.no_grad():
        for n in range(1, 41):
            x = torch.randn(n, 4)
            torch.testing.assert_close(model(x), torch.nn.Sequential.forward(model, x))  # the plain call
    assert sc.stats(model)["builds"] >= 5  # 40 sizes padded into 5 buckets, entries coming and going
    assert len(FakeTensorMode.cache) == before
