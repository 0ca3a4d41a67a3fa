"""What makes two calls share a key, and what keeps them apart."""

import pytest
import torch

import shapecache as sc
from shapecache._extension import _C


def key(*args, buckets=(), **kwargs):
    return _C._testing.call_key(tuple(args), kwargs, list(buckets))


def test_equal_shapes_dtypes_devices_give_equal_keys():
    a = key(torch.randn(2, 4, 8, 8), 3, "text", scale=0.5)
    b = key(torch.zeros(2, 4, 8, 8), 3, "text", scale=0.5)
    assert a["words"] == b["words"] and a["hash"] == b["hash"]


@pytest.mark.parametrize(
    "other",
    [
        lambda: key(torch.randn(2, 4, 8, 9)),  # size
        lambda: key(torch.randn(2, 4, 8)),  # rank
        lambda: key(torch.randn(2, 4, 8, 8, dtype=torch.float64)),  # dtype
        lambda: key(torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last)),  # layout
        lambda: key(torch.randn(2, 4, 8, 8, device="meta")),  # device
        lambda: key(torch.randn(2, 4, 8, 8, requires_grad=True)),  # autograd
        lambda: key(torch.randn(2, 4, 8, 8), None),  # extra argument
        lambda: key(x=torch.randn(2, 4, 8, 8)),  # passed by keyword
    ],
)
def test_differences_give_different_keys(other):
    assert key(torch.randn(2, 4, 8, 8))["words"] != other()["words"]


def test_channels_last_and_contiguous_differ_and_are_described():
    contiguous = key(torch.randn(1, 3, 8, 8))
    channels_last = key(torch.randn(1, 3, 8, 8).to(memory_format=torch.channels_last))
    assert contiguous["words"] != channels_last["words"]
    assert channels_last["description"] == "(1, 3, 8, 8) float32 cpu channels_last"


def test_values_keyed_by_value_and_type():
    assert key(1)["words"] != key(1.0)["words"] != key(True)["words"]
    assert key("a")["words"] != key("b")["words"]
    assert key((1, 2))["words"] != key([1, 2])["words"]
    assert key({"a": 1})["words"] != key({"a": 2})["words"]
    assert key(torch.float16)["words"] != key(torch.bfloat16)["words"]
    assert key(torch.device("cpu"))["words"] == key(torch.device("cpu"))["words"]


def test_long_strings_are_keyed_whole():
    assert key("x" * 40 + "a")["words"] != key("x" * 40 + "b")["words"]


def test_keyword_order_does_not_matter():
    assert key(a=1, b=torch.ones(2))["words"] == key(b=torch.ones(2), a=1)["words"]


def test_named_parameters_key_the_same_by_position_or_keyword():
    def named(*args, **kwargs):
        return _C._testing.call_key(args, kwargs, [], 0, -1, ["x", "t"])

    x, t = torch.ones(2, 3), torch.tensor(5)
    by_position = named(x, t, scale=2)
    assert named(x, t=t, scale=2)["words"] == by_position["words"]
    assert named(t=t, scale=2, x=x)["words"] == by_position["words"]
    assert by_position["description"] == "scale=2, t=() int64 cpu, x=(2, 3) float32 cpu"
    # a positional tail beyond the named parameters stays positional and ordered
    assert named(x, t, 1, 2)["words"] != named(x, t, 2, 1)["words"]
    assert named(x, t, 1)["description"] == "1, t=() int64 cpu, x=(2, 3) float32 cpu"


def test_padding_by_keyword_uses_the_named_policy():
    buckets = [_C.ArgumentBuckets(0, "x", [(0, sc.power_of_two())])]
    k = _C._testing.call_key((), {"x": torch.ones(3, 2)}, buckets, 0, -1, ["x"])
    assert k["padded"] and k["kwargs"]["x"].shape == (4, 2) and k["args"] == ()


def test_autograd_mode_and_training_are_part_of_the_key():
    x = torch.ones(2)
    with torch.no_grad():
        no_grad = key(x)
    with torch.inference_mode():
        inference = key(x)
    assert len({tuple(key(x)["words"]), tuple(no_grad["words"]), tuple(inference["words"])}) == 3
    train = _C._testing.call_key((x,), {}, [], 0, 1)
    evaluation = _C._testing.call_key((x,), {}, [], 0, 0)
    assert train["words"] != evaluation["words"]


def test_device_is_the_first_tensors():
    assert key(3, torch.ones(1, device="meta"), torch.ones(1))["device"] == torch.device("meta")
    assert key(3)["device"] == torch.device("cpu")


def test_description_reads_like_the_call():
    described = key(torch.ones(2, 3), 4, None, (1.5, "s"), mode="x")["description"]
    assert described == "(2, 3) float32 cpu, 4, None, (1.5, 's'), mode='x'"


@pytest.mark.parametrize("value", [object(), {1: 2}, 2**70, torch.ones(2).to_sparse()])
def test_unkeyable_values_raise(value):
    with pytest.raises(_C.UnkeyableArgument, match="argument 'args\\[0\\]' is"):
        key(value)


def test_nesting_limit():
    value = []
    value.append(value)  # a list that contains itself
    with pytest.raises(_C.UnkeyableArgument, match="nested more than 16 deep"):
        key(value)


def test_padding_pads_and_records_every_padded_dimension():
    buckets = [_C.ArgumentBuckets(0, "x", [(0, sc.power_of_two()), (-1, sc.multiple_of(8))])]
    x = torch.arange(15.0).reshape(3, 5)
    k = key(x, buckets=buckets)
    padded = k["args"][0]
    assert k["padded"] and padded.shape == (4, 8)
    assert torch.equal(padded[:3, :5], x) and padded[3:].abs().sum() == 0 and padded[:, 5:].abs().sum() == 0
    assert k["crop"] == [(0, 3, 4), (1, 5, 8)]
    assert k["description"] == "(4, 8) float32 cpu"
    # a size that is already a bucket is not copied
    same = key(torch.ones(4, 8), buckets=buckets)
    assert not same["padded"] and same["words"] == k["words"]


def test_padding_keeps_channels_last():
    buckets = [_C.ArgumentBuckets(0, "x", [(0, sc.multiple_of(2))])]
    x = torch.randn(3, 4, 5, 5).to(memory_format=torch.channels_last)
    padded = key(x, buckets=buckets)["args"][0]
    assert padded.is_contiguous(memory_format=torch.channels_last)


def test_crop_narrows_each_output_to_its_shape_and_keeps_containers():
    out = _C._testing.crop_outputs(
        {"up": torch.zeros(2, 64), "same": torch.zeros(8), "constant": torch.zeros(3)},
        [(2, 40), (5,), (3,)],
    )
    assert {k: tuple(v.shape) for k, v in out.items()} == {"up": (2, 40), "same": (5,), "constant": (3,)}
    t = _C._testing.crop_outputs((torch.arange(8.0), [torch.zeros(4, 4)], 7, None), [(5,), (4, 2)])
    assert isinstance(t, tuple) and isinstance(t[1], list) and t[1][0].shape == (4, 2) and t[2:] == (7, None)
    assert torch.equal(t[0], torch.arange(5.0))  # the leading corner


@pytest.mark.parametrize(
    ("outputs", "shapes"),
    [
        ((torch.zeros(4), torch.zeros(4)), [(3,)]),  # more tensors than the plain call returns
        (torch.zeros(4), [(3,), (3,)]),  # fewer
        (torch.zeros(4, 2), [(3,)]),  # another rank
        (torch.zeros(4), [(5,)]),  # larger than the padded output
    ],
)
def test_crop_refuses_outputs_that_do_not_match_the_plain_calls(outputs, shapes):
    assert _C._testing.crop_outputs(outputs, shapes) is None


def test_crop_rejects_outputs_it_cannot_walk():
    class Output:
        pass

    with pytest.raises(TypeError, match="cannot walk an output of type Output .padded buckets and CUDA graphs need"):
        _C._testing.crop_outputs(Output(), [(1,)])


def test_arguments_that_share_storage_are_keyed_apart_from_ones_that_do_not():
    a, b = torch.ones(3), torch.ones(3)
    same = _C._testing.call_key((a, a), {})
    apart = _C._testing.call_key((a, b), {})
    assert same["words"] != apart["words"]
    assert same["description"].endswith("same storage as tensor 0")
    assert _C._testing.call_key((b, b), {})["words"] == same["words"]  # which tensors, not which storage
    view = _C._testing.call_key((a, a[:2]), {})
    assert "same storage as tensor 0" in view["description"]


def test_tensors_that_share_storage_are_keyed_apart_from_tensors_that_do_not():
    # A CUDA graph captured as f(a, a) holds one static copy for both arguments: served f(b, c)
    # it would compute f(c, c). The key records which arguments share a storage.
    a, b, c = torch.randn(4), torch.randn(4), torch.randn(4)
    same = key(a, a)
    assert same["words"] == key(b, b)["words"]
    assert same["words"] != key(b, c)["words"]
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    assert key(x, x[0])["words"] == key(y, y[1])["words"]  # a view shares its base's storage
    assert key(x, x[0])["words"] != key(x, y[0])["words"]
    assert key([a, {"t": a}])["words"] != key([a, {"t": b}])["words"]  # inside containers too

    calls = sc.cached(lambda p, q: p + q)
    calls(a, a)
    calls(b, c)
    calls(c, c)
    assert sc.stats(calls)["builds"] == 2 and sc.stats(calls)["hits"] == 1
