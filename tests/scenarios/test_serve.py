"""`python -m shapecache serve`: what it serves adds up; bad options exit with status 2."""

import subprocess
import sys

import pytest

from shapecache.scenarios import _cli, _serve

pytestmark = pytest.mark.slow


def serve(*argv) -> dict:
    return _serve.run(_cli.parse_arguments(["serve", *argv]))


def test_serve_counts_add_up():
    sizes = [(16, 16), (16, 24), (24, 16), (32, 32)]
    out = serve("--requests", "15", "--max-entries", "2", "--sizes", "16x16,16x24,24x16,32x32", "--backend", "eager")
    rows = out["sizes"]
    assert list(rows) == sizes
    requests = sum(r["requests"] for r in rows.values())
    builds = sum(r["builds"] for r in rows.values())
    hits = sum(len(r["hit_ms"]) for r in rows.values())
    assert requests == 15 and builds + hits == 15
    assert len(out["held"]) == 2  # max_entries=2 holds two sizes at the end
    st = out["stats"]
    assert (st["hits"], st["misses"], st["evictions"]) == (hits, builds, builds - 2)


def test_serve_on_the_cpu_compiles_by_default():
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU's default")
    out = serve("--requests", "2", "--sizes", "16x16")
    assert out["stats"]["backend"] == "compile"
    assert out["sizes"][(16, 16)]["builds"] == 1 and len(out["sizes"][(16, 16)]["hit_ms"]) == 1


def test_a_usage_error_exits_with_status_2_and_argparses_message():
    result = subprocess.run(
        [sys.executable, "-m", "shapecache", "serve", "--sizes", "16by16"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "argument --sizes: cannot read '16by16'" in result.stderr


def test_serving_tiny_sd_prewarms_everything_the_pipeline_uses():
    pytest.importorskip("diffusers")
    out = serve("--model", "tiny-sd", "--sizes", "32x32,32x48,48x48")
    assert [tuple(r["size"]) for r in out["stats"]["prewarmed"]] == [(48, 48), (32, 48), (32, 32)]
    assert list(out["sizes"]) == [(32, 32), (32, 48), (48, 48)]
    assert all(r["builds"] == 0 and r["equal"] for r in out["sizes"].values()), out["sizes"]


def test_demo_runs_its_model_with_freezing_and_exits_1_when_it_cannot_show_its_result(tmp_path):
    # Only the shapecache strategy: the demo cannot show per-size graphs outgrowing the limit.
    import json

    import torch

    if torch.cuda.is_available():
        pytest.skip("on CUDA the demo runs the tiny pipeline (tested by the GPU check)")
    out = tmp_path / "demo.json"
    result = subprocess.run(
        [sys.executable, "-m", "shapecache", "demo", "--sizes", "64x64,64x96", "--strategies", "shapecache",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 1, result.stderr
    assert "the demo could not show its result: the demo needs both the naive and the shapecache strategies" \
        in result.stdout
    saved = json.loads(out.read_text())
    assert (saved["model"], saved["device"], saved["budget"]) == ("res-convnet", "cpu", "160MiB")
    records = saved["results"]["shapecache"]["records"]
    assert [r["size"] for r in records] == [[64, 64], [64, 96]]
    assert all(r["error"] is None and r["call_seconds"] > 0 for r in records)
    assert "shapecache: completed" in result.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["repro", "--strategies", "bogus"], "argument --strategies: unknown strategy 'bogus'; expected some of naive"),
        (["repro", "--budget", "abc"], "argument --budget: budget='abc': cannot read this size"),
        (["repro", "--batch", "0"], "argument --batch: expected a positive int, got '0'"),
        (["demo", "--sizes", "0x0"], "argument --sizes: '0x0': height and width must be positive"),
        (["serve", "--sizes", "16by16"], "argument --sizes: cannot read '16by16'"),
        (["serve", "--requests", "-3"], "argument --requests: expected a positive int, got '-3'"),
        (["serve", "--backend", "fast"], "argument --backend: invalid choice: 'fast'"),
        (["serve", "--device", "gpu"], "argument --device:"),
    ],
)
def test_bad_options_are_usage_errors_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        _cli.parse_arguments(argv)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_a_strategy_that_fails_to_run_makes_the_command_exit_1(capsys):
    pytest.importorskip("diffusers")
    # The meta device holds no data: the pipeline cannot run there, so the strategy's process fails.
    assert _cli.main(["repro", "--device", "meta", "--sizes", "32x32", "--strategies", "shapecache"]) == 1
    assert "shapecache: failed:" in capsys.readouterr().out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the answer without a CUDA device")
def test_gpu_check_without_a_gpu_says_so_and_exits_1(capsys):
    assert _cli.main(["gpu-check"]) == 1
    assert "no CUDA device is visible; nothing was checked" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "expected"), [
    (["repro", "--device", "cpu"], ("res-convnet", "160MiB", True)),
    (["demo", "--device", "cpu"], ("res-convnet", "160MiB", True)),
    (["repro", "--device", "cpu", "--no-freezing", "--budget", "1GiB"], ("res-convnet", "1GiB", False)),
    (["repro", "--device", "cpu", "--model", "tiny-sd"], ("tiny-sd", None, False)),
    (["repro", "--device", "cpu", "--model", "sdxl"], ("sdxl", None, False)),  # its 24GiB cap is CUDA's
])
def test_repro_has_the_demos_defaults(argv, expected):
    from shapecache.scenarios import _repro

    args = _cli.parse_arguments(argv)
    _repro.apply_defaults(args)
    assert (args.model, args.budget, args.freezing) == expected
    assert args.strategies == ["naive", "torch_compile", "shapecache"]
