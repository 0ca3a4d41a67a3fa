"""pytest plugin (registered as ``shapecache`` through the ``pytest11`` entry point).

- marker ``vram_budget(budget, device=None)``: caps the test's GPU memory with
  ``torch.cuda.set_per_process_memory_fraction`` (restored afterwards); the budget is bytes,
  a string such as "20GiB", or a fraction of the device's memory. Skips the test where there
  is no CUDA device. Without a marker, ``--vram-budget`` / the ``vram_budget`` ini option /
  ``SHAPECACHE_VRAM_BUDGET`` (in that order) cap every test where there is a GPU.
- fixture ``vram_monitor``: a VramMonitor on the test's device (CUDA if there is one, else
  the CPU's resident memory).
- a report header line with the budget in force.

Nothing here loads torch or shapecache's extension until a test uses the marker or the
fixture, or a budget is configured for every test: every pytest session of an environment
where shapecache is installed loads this plugin.
"""

from __future__ import annotations

import os

import pytest

_STASH = pytest.StashKey[tuple]()  # item -> (device, fraction before the test)


def pytest_addoption(parser):
    group = parser.getgroup("shapecache")
    help_text = "cap each test's GPU memory (bytes, '20GiB', or a fraction); a vram_budget marker overrides it"
    group.addoption("--vram-budget", default=None, help=help_text)
    parser.addini("vram_budget", help_text, default=None)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "vram_budget(budget, device=None): cap this test's GPU memory to budget (bytes, a string such as "
        "'20GiB', or a fraction of the device's memory) on device (default: the current CUDA device); "
        "skipped without CUDA",
    )
    budget, source = _configured(config)
    if budget is not None:  # a bad value is one usage error for the session, not an error in every test
        from shapecache.budget import parse_budget

        try:
            parse_budget(budget, argument=source)
        except (TypeError, ValueError) as error:
            raise pytest.UsageError(str(error)) from None


def _configured(config) -> tuple:
    """(budget, where it was set) of the budget for every test, or (None, None)."""
    for budget, source in ((config.getoption("--vram-budget"), "--vram-budget"),
                           (config.getini("vram_budget"), "vram_budget (ini)"),
                           (os.environ.get("SHAPECACHE_VRAM_BUDGET"), "SHAPECACHE_VRAM_BUDGET")):
        if budget:
            return budget, source
    return None, None


def pytest_report_header(config):
    budget, _ = _configured(config)
    return f"shapecache: vram budget {budget or 'none by default, per-test markers only'} (skipped without CUDA)"


def _budget_for(item):
    marker = item.get_closest_marker("vram_budget")
    if marker is not None:
        if not marker.args and "budget" not in marker.kwargs:
            raise pytest.UsageError(f"{item.nodeid}: vram_budget(budget, device=None) needs a budget")
        budget = marker.kwargs.get("budget", marker.args[0] if marker.args else None)
        device = marker.kwargs.get("device", marker.args[1] if len(marker.args) > 1 else None)
        return budget, device, "vram_budget"
    budget, source = _configured(item.config)
    return (budget, "default", source) if budget else (None, None, None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    budget, device, source = _budget_for(item)
    if budget is None:
        return
    import torch

    from shapecache.budget import parse_budget

    parsed = parse_budget(budget, argument=source)  # bad values fail the test setup clearly
    if not torch.cuda.is_available():
        if device == "default":
            return  # a budget for every test caps GPU memory where there is a GPU, and nothing else
        pytest.skip("vram_budget needs a CUDA device")
    if device in (None, "default"):
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = parsed.fraction if parsed.fraction is not None else parsed.bytes / total
    if not 0 < fraction <= 1:
        raise pytest.UsageError(f"vram_budget={budget!r} is more than {device}'s {total} bytes")
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = getter(device) if getter else 1.0
    item.stash[_STASH] = (device, before)
    torch.cuda.set_per_process_memory_fraction(fraction, device)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    saved = item.stash.get(_STASH, None)
    if saved is None:
        return
    import torch

    device, before = saved
    torch.cuda.set_per_process_memory_fraction(before, device)


@pytest.fixture
def vram_monitor():
    """Records allocated / reserved / peak memory per step; ``assert_below(ceiling)`` checks them."""
    from shapecache.testing.memory import VramMonitor

    return VramMonitor()
