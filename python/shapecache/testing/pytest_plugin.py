"""pytest plugin (registered as ``shapecache`` through the ``pytest11`` entry point).

- marker ``memory_budget(budget, device=None)``: caps the test's memory on `device` (default:
  CUDA where there is a device, else the CPU), from the start of its setup to the end of its
  call (shapecache.testing.memory_cap): on CUDA the process's share of the device, as
  ``vram_budget``; on the CPU the soft RLIMIT_DATA, at the data segment's size when the test
  starts plus the budget, so that the budget is what the test may allocate (its fixtures
  included). Skipped with the reason where no cap can be set. An allocation that fails
  under the cap fails the test with MemoryBudgetExceeded, which names the budget and where
  it was set, the failed allocation as its cause; the cap is lifted before pytest reports.
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

__all__ = ["MemoryBudgetExceeded", "vram_monitor"]

_CAP = pytest.StashKey[tuple]()  # item -> (its MemoryCap, where the budget was set)


class MemoryBudgetExceeded(Exception):
    """A capped test ran out of its memory budget."""


def pytest_addoption(parser):
    group = parser.getgroup("shapecache")
    help_text = "cap each test's GPU memory (bytes, '20GiB', or a fraction); a vram_budget marker overrides it"
    group.addoption("--vram-budget", default=None, help=help_text)
    parser.addini("vram_budget", help_text, default=None)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "memory_budget(budget, device=None): cap the memory this test may allocate to budget (bytes or a string "
        "such as '512MiB') on device (default: CUDA if available, else the CPU); on the CPU the soft RLIMIT_DATA "
        "above the data segment at the test's start; skipped where no cap can be set",
    )
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
    budget, source = _configured(config)
    if budget is None:
        return "shapecache: no memory cap on every test; memory_budget caps a test on CUDA or the CPU"
    return f"shapecache: every test's GPU memory capped at {budget} ({source}; none without CUDA)"


def _requested(item):
    """(budget, device, marker name, where it was set) of the cap this test asks for, or None.
    `device` is None for a budget that applies to every test (GPU only, nothing elsewhere)."""
    for name in ("memory_budget", "vram_budget"):
        found = next(item.iter_markers_with_node(name), None)
        if found is None:
            continue
        node, marker = found
        if not marker.args and "budget" not in marker.kwargs:
            raise pytest.UsageError(f"{item.nodeid}: {name}(budget, device=None) needs a budget")
        budget = marker.kwargs.get("budget", marker.args[0] if marker.args else None)
        device = marker.kwargs.get("device", marker.args[1] if len(marker.args) > 1 else None)
        if budget is None:
            raise pytest.UsageError(f"{item.nodeid}: {name}(budget=None): expected a budget such as '512MiB', "
                                    "a number of bytes or a fraction of the device's memory")
        spelled = f"{budget!r}" if device is None else f"{budget!r}, device={device!r}"
        return budget, device or "any", name, f"@pytest.mark.{name}({spelled}) on {node.nodeid}"
    budget, source = _configured(item.config)
    return (budget, None, "vram_budget", source) if budget else None


def _set_cap(item):
    """Sets the cap `item` asks for and stashes it; skips the test where it cannot be set."""
    requested = _requested(item)
    if requested is None:
        return
    budget, device, name, where = requested
    import torch

    from shapecache.budget import parse_budget
    from shapecache.testing.memory_cap import CapUnavailable, cap_cuda_memory, cap_data_segment

    parsed = parse_budget(budget, argument=name)  # bad values fail the test's setup clearly
    if device is None:  # the budget for every test caps GPU memory where there is a GPU, and nothing else
        if not torch.cuda.is_available():
            return
        device = "cuda"
    if device == "any":
        device = "cuda" if name == "vram_budget" or torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type not in ("cuda", "cpu") or (name == "vram_budget" and device.type != "cuda"):
        accepted = "a 'cuda' device" if name == "vram_budget" else "a 'cuda' or 'cpu' device"
        raise pytest.UsageError(f"{item.nodeid}: {name}(device={str(device)!r}): expected {accepted}")
    try:
        if device.type == "cuda":
            if not torch.cuda.is_available():
                pytest.skip(f"{name} needs a CUDA device")
            cap = cap_cuda_memory(parsed.bytes_for(device), device)
        else:
            cap = cap_data_segment(parsed.bytes_for(device))
    except CapUnavailable as error:
        pytest.skip(f"{name}: no memory cap can be set here: {error}")
    except ValueError as error:
        raise pytest.UsageError(f"{item.nodeid}: {name}({budget!r}): {error}") from None
    item.stash[_CAP] = (cap, where)


def _lift_cap(item, error: BaseException | None = None) -> BaseException | None:
    """Lifts `item`'s cap on the CPU (a GPU's stays for the teardown, as the fixtures' memory
    does), so that pytest reports uncapped. Returns what to raise for `error`: a
    MemoryBudgetExceeded when it is a failed allocation under a cap, else `error` itself."""
    cap, where = item.stash.get(_CAP, (None, None))
    if cap is None or not cap.in_force:
        return error
    if cap.device.type == "cpu":
        cap.lift()
    from shapecache.budget import format_bytes
    from shapecache.testing.memory_cap import allocation_failure, out_of_memory

    if error is None or not out_of_memory(error):
        return error
    return MemoryBudgetExceeded(
        f"{item.nodeid} ran out of its memory budget of {format_bytes(cap.budget)} on {cap.device}, set by "
        f"{where}: {cap.description}; the allocation that failed: {allocation_failure(error)}")


def _raise_for(item, error: BaseException):
    __tracebackhide__ = True
    replaced = _lift_cap(item, error)
    if replaced is error:
        raise error
    raise replaced from error


# Both wrappers are the innermost (trylast): the cap is set after the other plugins' wrappers
# began (a skip raised here reaches them as any setup's would) and lifted before they go on.
@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_setup(item):
    __tracebackhide__ = True
    _set_cap(item)  # before the fixtures: what they allocate counts against the budget
    try:
        return (yield)
    except BaseException as error:
        _raise_for(item, error)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item):
    __tracebackhide__ = True
    try:
        result = yield
    except BaseException as error:
        _raise_for(item, error)
    _lift_cap(item)
    return result


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    cap, _ = item.stash.get(_CAP, (None, None))
    if cap is not None:
        cap.lift()


@pytest.fixture
def vram_monitor():
    """Records allocated / reserved / peak memory per step; ``assert_below(ceiling)`` checks them."""
    from shapecache.testing.memory import VramMonitor

    return VramMonitor()
