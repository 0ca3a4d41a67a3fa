"""Process-level guarantees: the CPU path never initializes CUDA; SHAPECACHE_DISABLE."""

import subprocess
import sys
import textwrap

import pytest

import shapecache as sc

CPU_PROGRAM = textwrap.dedent(
    """
    import torch, shapecache as sc
    net = sc.cached(torch.nn.Conv2d(3, 4, 3), budget=0.5, buckets={"input": {0: sc.power_of_two()}})
    for n in (1, 3, 5):
        net(torch.randn(n, 3, 8, 8))
    sc.stats(net)

    @sc.cached(backend="compile", compile_options={"backend": "eager"})
    def f(x):
        return x.sin()

    f(torch.randn(3))
    print("initialized" if torch.cuda.is_initialized() else "not initialized")
    """
)


def test_cpu_use_never_initializes_cuda():
    result = subprocess.run([sys.executable, "-c", CPU_PROGRAM], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "not initialized"


def test_disable_env_makes_every_wrapper_a_passthrough(monkeypatch, conv_net):
    monkeypatch.setenv("SHAPECACHE_DISABLE", "1")

    def f(x):
        return x

    assert sc.cached(f) is f
    assert sc.cached(max_entries=3)(f) is f
    assert sc.cached(conv_net) is conv_net and "forward" not in conv_net.__dict__
    with pytest.raises(TypeError, match="SHAPECACHE_DISABLE is set"):
        sc.stats(f)


def test_disable_argument(conv_net):
    assert sc.cached(conv_net, disable=True) is conv_net and "forward" not in conv_net.__dict__


def test_bad_options_raise_even_when_disabled(monkeypatch):
    monkeypatch.setenv("SHAPECACHE_DISABLE", "1")
    with pytest.raises(ValueError, match="budget='lots'"):
        sc.cached(budget="lots")


@pytest.mark.parametrize("value, disabled", [("1", True), ("true", True), ("YES", True), ("on", True),
                                             ("0", False), ("false", False), ("no", False), ("off", False), ("", False)])
def test_disable_env_values(monkeypatch, conv_net, value, disabled):
    monkeypatch.setenv("SHAPECACHE_DISABLE", value)
    assert ("forward" not in sc.cached(conv_net).__dict__) == disabled


@pytest.mark.parametrize("value", ["y", "disable", "2"])
def test_an_unknown_disable_value_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("SHAPECACHE_DISABLE", value)
    with pytest.raises(ValueError, match=f"SHAPECACHE_DISABLE='{value}': expected one of 1, true, yes, on"):
        sc.cached(lambda x: x)
