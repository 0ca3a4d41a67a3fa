"""Invariant 5's detector: replacing weights makes a snapshot stale; updating them in place does not."""

import pytest
import torch

from shapecache._backends.weights import snapshot
from shapecache._extension import _C


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)


@pytest.fixture
def net():
    return Net().eval()


def test_in_place_updates_keep_it(net):
    s = snapshot(net)
    assert len(s) == 4 + 3  # weight, bias of both; running mean, var, batches tracked
    with torch.no_grad():
        net.linear.weight.copy_(torch.randn(4, 4))
        net.norm.running_mean.add_(1)
    net.load_state_dict(Net().state_dict())
    assert s.valid()


def test_unrelated_registrations_keep_it(net):
    s = snapshot(net)
    before = _C.module_generation()
    Net()  # registers parameters elsewhere: the generation moves, the check looks and finds ours
    assert _C.module_generation() > before and s.valid()


@pytest.mark.parametrize(
    "replace",
    [
        lambda n: setattr(n.linear, "weight", torch.nn.Parameter(torch.randn(4, 4))),
        lambda n: setattr(n.norm, "running_mean", torch.zeros(4)),
        lambda n: setattr(n, "linear", torch.nn.Linear(4, 4)),
        lambda n: setattr(n.linear.weight, "data", torch.randn(4, 4)),
        lambda n: n.double(),
    ],
    ids=["parameter", "buffer", "submodule", "data", "to_dtype"],
)
def test_replacing_makes_it_stale_for_good(net, replace):
    s = snapshot(net)
    replace(net)
    assert not s.valid()
    assert not s.valid()  # stays stale


def test_the_owner_is_held_weakly():
    import gc
    import weakref

    net = Net()  # not the fixture's: pytest holds that one
    s = snapshot(net)
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None
    _C.bump_module_generation()
    assert not s.valid()  # its module is gone: nothing it captured can be trusted
