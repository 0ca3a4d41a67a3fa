"""The builders' registry: one Builder per backend name, and nothing registered twice."""

import pytest
import torch

import shapecache as sc
from shapecache import _backends
from shapecache._backends.entry import Builder, BuiltEntry, register


def test_every_backend_but_auto_has_one_registered_builder():
    assert set(_backends.BUILDERS) == set(_backends.BACKENDS) - {"auto"}
    for name, builder in _backends.BUILDERS.items():
        assert isinstance(builder, Builder) and type(builder).name == name


def test_a_second_builder_for_a_backend_is_refused_and_the_first_stays():
    first = _backends.BUILDERS["eager"]

    class Another(Builder):
        name = "eager"

        def build(self, function, args, kwargs, handle, context, asked):
            return BuiltEntry(function, 0, None, "eager", ran_call=False)

    with pytest.raises(ValueError, match="a builder for backend 'eager' is registered already: EagerBuilder"):
        register(Another)
    assert _backends.BUILDERS["eager"] is first
    f = sc.cached(lambda x: x + 1, backend="eager")
    assert torch.equal(f(torch.zeros(2)), torch.ones(2))
