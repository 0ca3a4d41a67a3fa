"""The pytest plugin, run in pytest's own sandbox (pytester)."""

import pytest
import torch

NO_CUDA = not torch.cuda.is_available()


def test_marker_is_registered_with_its_signature(pytester):
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["*@pytest.mark.vram_budget(budget, device=None): cap this test's GPU memory*"])


def test_report_header_names_the_budget(pytester):
    pytester.makepyfile("def test_nothing():\n    assert True\n")
    result = pytester.runpytest("--vram-budget", "12GiB")
    result.stdout.fnmatch_lines(["shapecache: vram budget 12GiB (skipped without CUDA)"])
    result.assert_outcomes(passed=1)


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
