"""The pytest plugin, run in pytest's own sandbox (pytester)."""

import re
from pathlib import Path

import pytest
import torch

NO_CUDA = not torch.cuda.is_available()


def test_markers_are_registered_with_their_signatures(pytester):
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["*@pytest.mark.memory_budget(budget, device=None): cap the memory this test*",
                                 "*@pytest.mark.vram_budget(budget, device=None): cap this test's GPU memory*"])


def test_report_header_names_the_budget(pytester):
    pytester.makepyfile("def test_nothing():\n    assert True\n")
    result = pytester.runpytest("--vram-budget", "12GiB")
    result.stdout.fnmatch_lines(["shapecache: every test's GPU memory capped at 12GiB (--vram-budget; none without CUDA)"])
    result.assert_outcomes(passed=1)
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(["shapecache: no memory cap on every test; memory_budget caps a test on CUDA or the CPU"])


def test_the_plugin_loads_neither_torch_nor_the_extension_for_tests_that_do_not_use_it(pytester):
    pytester.makepyfile("import sys\n\ndef test_nothing():\n    assert 'torch' not in sys.modules\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.skipif(not NO_CUDA, reason="checks the behaviour without CUDA")
def test_marked_tests_skip_cleanly_without_cuda_and_global_budgets_do_not(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.vram_budget("1GiB")
        def test_capped():
            raise AssertionError("must not run without CUDA")

        def test_plain():
            assert True
        """
    )
    result = pytester.runpytest("-rs", "--vram-budget", "0.5")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*vram_budget needs a CUDA device*"])


def test_bad_budget_fails_setup_with_a_clear_message(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.vram_budget("lots")
        def test_capped():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*vram_budget='lots': cannot read this size*"])


def test_vram_monitor_records_steps_and_checks_a_ceiling(pytester):
    pytester.makepyfile(
        """
        import pytest
        import torch

        def test_monitor(vram_monitor):
            vram_monitor.record("start")
            block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
            vram_monitor.record("after 64 MiB")
            assert len(vram_monitor.steps) == 2
            grown = vram_monitor.steps[1]["allocated"] - vram_monitor.steps[0]["allocated"]
            assert grown >= 60 * 2**20, grown
            vram_monitor.assert_below("1000GiB")
            with pytest.raises(AssertionError, match="peak memory on .* went above 1.0 MiB at step"):
                vram_monitor.assert_below("1MiB")
            del block
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)


def test_a_monitors_peak_counts_from_its_own_start_not_from_earlier_tests(pytester):
    pytester.makepyfile(
        """
        import os
        import torch

        def test_a_large_allocation_first():
            block = torch.ones(512 * 2**20 // 4)  # 512 MiB, touched, then freed
            del block

        def test_a_small_loop_after_it(vram_monitor):
            vram_monitor.record("start")
            resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            vram_monitor.assert_below(resident + 256 * 2**20)  # room, but not the earlier test's 512 MiB
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_a_budget_of_none_is_a_usage_error(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.memory_budget(None)
        def test_capped():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    assert "memory_budget(budget=None): expected a budget" in result.stdout.str() + result.stderr.str()


@pytest.mark.skipif(not NO_CUDA, reason="the CPU cap applies where there is no GPU")
def test_a_thread_that_cannot_start_under_the_cap_fails_as_out_of_budget(pytester):
    pytester.makepyfile(
        """
        import threading

        import pytest

        @pytest.mark.memory_budget("32MiB", device="cpu")
        def test_threads():
            threads = [threading.Thread(target=threading.Event().wait, args=(1,)) for _ in range(16)]
            for thread in threads:  # 8 MiB of stack each: the fifth cannot start
                thread.start()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*MemoryBudgetExceeded*32.0 MiB*device='cpu'*"])


@pytest.mark.cuda
def test_vram_budget_caps_and_restores(pytester):
    pytester.makepyfile(
        """
        import pytest
        import torch

        @pytest.mark.vram_budget("1GiB")
        def test_capped():
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")

        def test_after():
            torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
        """
    )
    pytester.runpytest().assert_outcomes(passed=2)


def test_a_bad_budget_for_every_test_is_one_usage_error_naming_where_it_was_set(pytester, monkeypatch):
    pytester.makepyfile("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    monkeypatch.setenv("SHAPECACHE_VRAM_BUDGET", "lots")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*SHAPECACHE_VRAM_BUDGET='lots': cannot read this size*"])
    result = pytester.runpytest_subprocess("--vram-budget", "2 parsecs")
    result.stderr.fnmatch_lines(["*--vram-budget='2 parsecs': cannot read this size*"])


# The CPU cap is RLIMIT_DATA on the whole process: these sessions run in a process of their own.
CAPPED_THEN_UNCAPPED = """
import resource

import pytest
import torch

LIMIT_BEFORE = resource.getrlimit(resource.RLIMIT_DATA)


@pytest.fixture
def block():  # a fixture's memory counts against the budget: the cap is set before it runs
    return torch.ones(32 << 20, dtype=torch.uint8)


@pytest.mark.memory_budget("64MiB", device="cpu")
def test_capped(block):
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    assert hard == LIMIT_BEFORE[1] and soft != LIMIT_BEFORE[0]
    torch.ones(48 << 20, dtype=torch.uint8)  # 32 + 48 MiB: more than the budget


@pytest.mark.memory_budget("64MiB", device="cpu")
def test_capped_python_objects():
    kept = [bytearray(1 << 20) for _ in range(128)]


def test_uncapped_after():
    assert resource.getrlimit(resource.RLIMIT_DATA) == LIMIT_BEFORE
    block = torch.ones(256 << 20, dtype=torch.uint8)  # four times the cap
    assert block[-1] == 1


class TestUnderAClassMarker:
    pytestmark = pytest.mark.memory_budget("256MiB", device="cpu")

    def test_within(self):
        assert torch.ones(64 << 20, dtype=torch.uint8)[-1] == 1
"""


def test_memory_budget_fails_a_test_that_outgrows_it_on_the_cpu_and_nothing_after(pytester):
    pytester.makepyfile(test_cap=CAPPED_THEN_UNCAPPED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-ra")
    result.assert_outcomes(failed=2, passed=2)
    result.stdout.fnmatch_lines([
        "*MemoryBudgetExceeded: test_cap.py::test_capped ran out of its memory budget of 64.0 MiB on cpu, set by "
        "@pytest.mark.memory_budget('64MiB', device='cpu') on test_cap.py::test_capped: RLIMIT_DATA soft limit * the data "
        "segment's * when the cap was set + 64.0 MiB; the allocation that failed: DefaultCPUAllocator: can't "
        "allocate memory*",
    ])
    result.stdout.fnmatch_lines(["*MemoryBudgetExceeded: test_cap.py::test_capped_python_objects ran out of its "
                                 "memory budget*the allocation that failed: MemoryError*"])
    result.stdout.no_fnmatch_line("*INTERNALERROR*")


def test_memory_budget_caps_each_pytest_xdist_worker_on_its_own(pytester):
    pytest.importorskip("xdist")
    pytester.makepyfile(test_cap=CAPPED_THEN_UNCAPPED)
    # Each test in a worker of its own where it can: the capped ones fail there, and the
    # uncapped one, in whichever worker, finds its process's limit restored.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "load", "-ra")
    result.assert_outcomes(failed=2, passed=2)
    result.stdout.fnmatch_lines(["*MemoryBudgetExceeded: test_cap.py::test_capped ran out of its memory budget*"])
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.stdout.no_fnmatch_line("*worker*crashed*")


def test_memory_budget_is_skipped_with_the_reason_where_no_cap_can_be_set(pytester):
    pytester.makeconftest("""
import resource
del resource.RLIMIT_DATA  # as on a platform without it
""")
    pytester.makepyfile("""
import pytest

@pytest.mark.memory_budget("64MiB", device="cpu")
def test_capped():
    raise AssertionError("must not run uncapped")
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*memory_budget: no memory cap can be set here: this platform has no RLIMIT_DATA*"])


def test_memory_budget_rejects_what_it_cannot_cap(pytester):
    pytester.makepyfile("""
import pytest

@pytest.mark.memory_budget("lots")
def test_unreadable():
    pass

@pytest.mark.memory_budget("64MiB", device="meta")
def test_no_such_cap():
    pass

@pytest.mark.memory_budget()
def test_no_budget():
    pass
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines(["*memory_budget='lots': cannot read this size*"])
    result.stdout.fnmatch_lines(["*test_no_such_cap: memory_budget(device='meta'): expected a 'cuda' or 'cpu' device*"])
    result.stdout.fnmatch_lines(["*test_no_budget: memory_budget(budget, device=None) needs a budget*"])


@pytest.mark.skipif(not NO_CUDA, reason="checks the behaviour without CUDA")
def test_memory_budget_on_cuda_is_skipped_without_it(pytester):
    pytester.makepyfile("""
import pytest

@pytest.mark.memory_budget("1GiB", device="cuda")
def test_capped():
    raise AssertionError("must not run without CUDA")
""")
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*memory_budget needs a CUDA device*"])


def readme_block(containing: str) -> str:
    """The README's Python example that contains `containing`, as written there."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    found = [block for block in blocks if containing in block]
    assert len(found) == 1, f"expected one README example with {containing!r}, found {len(found)}"
    return found[0]


@pytest.mark.slow
def test_the_readmes_pytest_example_fails_per_size_graphs_and_passes_shapecache(pytester):
    pytester.makepyfile(test_sizes=readme_block("@pytest.mark.memory_budget"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-ra")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["FAILED test_sizes.py::test_a_graph_per_size*"])
    result.stdout.fnmatch_lines(["*MemoryBudgetExceeded: test_sizes.py::test_a_graph_per_size ran out of its memory "
                                 "budget of 600.0 MiB on cpu*"])
