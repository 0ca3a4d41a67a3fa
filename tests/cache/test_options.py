"""Bad options raise ValueError/TypeError naming the argument, the value and what is accepted."""

import pytest
import torch

import shapecache as sc
from shapecache.budget import parse_budget


@pytest.mark.parametrize(
    "value, expected",
    [
        (1024, 1024),
        ("512MiB", 512 * 2**20),
        ("20GiB", 20 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        (" 2 kib ", 2048),
    ],
)
def test_budget_in_bytes(value, expected):
    assert parse_budget(value).bytes == expected


def test_budget_fractions_resolve_per_device():
    ram = parse_budget(1.0).bytes_for(torch.device("cpu"))
    assert ram > 0
    assert parse_budget(0.25).bytes_for(torch.device("cpu")) == int(0.25 * ram)
    assert parse_budget("50%").fraction == 0.5
    assert parse_budget("0.5").fraction == 0.5  # as the float: never half a byte


def test_budget_from_environment(monkeypatch):
    monkeypatch.setenv("SHAPECACHE_BUDGET", "3MiB")
    assert parse_budget(None).bytes == 3 * 2**20
    monkeypatch.setenv("SHAPECACHE_BUDGET", "plenty")
    with pytest.raises(ValueError, match="SHAPECACHE_BUDGET='plenty'"):
        parse_budget(None)
    monkeypatch.delenv("SHAPECACHE_BUDGET")
    assert parse_budget(None).fraction == 0.5


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"budget": "lots"}, ValueError, r"budget='lots': cannot read this size; expected an int number of bytes, a string such as '512MiB'"),
        ({"budget": "20 parsecs"}, ValueError, r"budget='20 parsecs'"),
        ({"budget": 1.5}, ValueError, r"budget=1.5: a float budget is a fraction of the device's memory in \(0, 1\]"),
        ({"budget": 0.0}, ValueError, r"budget=0.0"),
        ({"budget": -1}, ValueError, r"budget=-1: a byte budget must be >= 0"),
        ({"budget": True}, TypeError, r"budget=True"),
        ({"budget": [1]}, TypeError, r"budget=\[1\] \(type list\)"),
        ({"backend": "tensorrt"}, ValueError, r"backend='tensorrt': expected one of 'auto', 'eager', 'compile'"),
        ({"max_entries": 0}, ValueError, r"max_entries=0: expected a positive int, or None"),
        ({"max_entries": "3"}, TypeError, r"max_entries='3' \(str\): expected a positive int"),
        ({"buckets": [0]}, TypeError, r"buckets=\[0\]: expected a dict mapping an argument name or position"),
        ({"compile_options": {"mode": "max-autotune"}, "backend": "eager"}, ValueError, r"compile_options were given with backend='eager', which compiles nothing"),
        ({"compile_options": {"mode": "max-autotune"}}, ValueError, r"compile_options were given with backend='auto'"),
        ({"compile_options": {"dynamic": True}, "backend": "compile"}, ValueError, r"'dynamic' is fixed to False"),
        ({"compile_options": "fast", "backend": "compile"}, TypeError, r"compile_options='fast'"),
        # Values that used to pass validation and then fail deep inside, or mean something else:
        ({"budget": 2**63}, ValueError, r"budget=9223372036854775808: a byte budget must be at most 2\*\*63 - 1"),
        ({"max_entries": 2**63}, ValueError, r"max_entries=9223372036854775808: expected a positive int, or None for no count limit of at most 2\*\*63 - 1"),
        ({"budget": "1.5"}, ValueError, r"budget='1.5': a number with a decimal point and no unit is a fraction of the device's memory, in \(0, 1\]"),
        ({"budget": "0.0"}, ValueError, r"budget='0.0': a number with a decimal point"),
        ({"budget": "0%"}, ValueError, r"budget='0%': a percentage of the device's memory must be in \(0%, 100%\]"),
        ({"budget": "150%"}, ValueError, r"budget='150%': a percentage"),
        ({"disable": "false"}, TypeError, r"disable='false' \(str\): expected True or False"),
        ({"tune_convs": 1}, TypeError, r"tune_convs=1 \(int\): expected True or False"),
        ({"backend": "compile+cuda_graph", "compile_options": {"mode": "reduce-overhead"}}, ValueError,
         r"compile_options: mode='reduce-overhead' captures CUDA graphs of its own, inside the ones backend='compile\+cuda_graph' captures"),
    ],
)
def test_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        sc.cached(**kwargs)


@pytest.mark.parametrize(
    "buckets, error, message",
    [
        ({"y": {0: sc.multiple_of(2)}}, ValueError, r"the function has no argument 'y'; its arguments are \['x', 'scale'\]"),
        ({5: {0: sc.multiple_of(2)}}, ValueError, r"position 5 is out of range"),
        ({"x": {0: 8}}, TypeError, r"buckets\['x'\]\[0\]=8: expected a policy"),
        ({"x": {"0": sc.multiple_of(2)}}, TypeError, r"dimension '0' is not an int"),
        ({"x": {}}, TypeError, r"buckets\['x'\]=\{\}: expected a non-empty dict"),
        ({1.5: {0: sc.multiple_of(2)}}, TypeError, r"key 1.5 must be an argument name"),
    ],
)
def test_bad_buckets_raise_when_wrapping(conv_net, buckets, error, message):
    with pytest.raises(error, match=message):
        sc.cached(conv_net, buckets=buckets)
    assert "forward" not in conv_net.__dict__  # nothing was changed


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: sc.one_of(5), TypeError, r"one_of\(bucket_sizes=5\): expected a list of positive ints"),
        (lambda: sc.one_of("512"), TypeError, r"one_of\(bucket_sizes='512'\)"),
        (lambda: sc.one_of([512, 0]), ValueError, r"one_of\(...\)\[1\]=0: expected a positive int"),
        (lambda: sc.multiple_of(2**63), ValueError, r"multiple_of\(n\)=9223372036854775808: expected a positive int of at most"),
        (lambda: sc.power_of_two(1.5), TypeError, r"power_of_two\(minimum\)=1.5 \(float\): expected a positive int"),
    ],
)
def test_bad_policies_name_what_was_given(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_a_size_whose_bucket_overflows_is_a_clear_error_not_a_hang():
    policy = sc.power_of_two()
    # The whole message: its policy is written by a std::ostringstream, whose numbers come out
    # empty when the module carries a copy of libstdc++ of its own (CMakeLists.txt).
    with pytest.raises(OverflowError, match=r"^size 4611686018427387905 has no bucket under power_of_two\(minimum=1\): "
                       "its bucket would not fit in a signed 64-bit integer$"):
        policy.bucket(2**62 + 1)
    with pytest.raises(OverflowError, match="has no bucket under multiple_of\\(3\\)"):
        sc.multiple_of(3).bucket(2**63 - 1)  # the next multiple of 3 is 2**63 + 1
    assert sc.multiple_of(3).bucket(2**63 - 3) == 2**63 - 2  # the largest that fits
    assert sc.power_of_two().bucket(2**62) == 2**62


def test_a_padded_argument_whose_bucket_overflows_fails_the_call_with_its_name():
    f = sc.cached(lambda x: x, buckets={"x": {0: sc.power_of_two()}})
    with pytest.raises(ValueError, match="buckets: argument 'x', dimension 0: size .* has no bucket under power_of_two"):
        f(torch.empty(2**62 + 1, 0, device="meta"))


def test_bucket_dimension_out_of_range_names_the_argument(conv_net):
    sc.cached(conv_net, buckets={"x": {7: sc.multiple_of(2)}})
    with pytest.raises(ValueError, match="dimension 7 of argument 'x' is out of range for a tensor of 4 dimensions"):
        conv_net(torch.ones(1, 3, 8, 8))
    assert sc.stats(conv_net)["builds"] == 0


def test_wrapping_twice_or_wrapping_a_non_callable(conv_net):
    sc.cached(conv_net)
    with pytest.raises(ValueError, match="cached already; call shapecache.uncached on it first"):
        sc.cached(conv_net)
    with pytest.raises(TypeError, match="expected a function or an nn.Module, got 3"):
        sc.cached(3)
    with pytest.raises(TypeError, match="stats: expected a function or module wrapped by shapecache.cached, or a pipeline wrapped by shapecache.wrap, got object"):
        sc.stats(object())


def test_the_typed_options_of_cached_are_its_keyword_parameters():
    import inspect
    import typing

    from shapecache.cache import CachedOptions

    parameters = inspect.signature(sc.cached).parameters
    keywords = {name for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(typing.get_type_hints(CachedOptions)) == keywords


def test_wrap_takes_its_options_by_keyword_only():
    import inspect

    parameters = list(inspect.signature(sc.wrap).parameters.values())
    assert [p.name for p in parameters if p.kind is not inspect.Parameter.KEYWORD_ONLY] == ["pipe", "sizes"]
    assert parameters[[p.name for p in parameters].index("tune_convs")].default is False
