"""`python -m shapecache serve` runs and its table adds up; `demo` is the repro scenario."""

import re
import subprocess
import sys

import torch


def test_serve_prints_a_consistent_per_size_table():
    result = subprocess.run(
        [sys.executable, "-m", "shapecache", "serve", "--requests", "15", "--max-entries", "2",
         "--sizes", "16x16,16x24,24x16,32x32"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"^\s*\d+x\d+\s", line)]
    assert [r[0] for r in rows] == ["16x16", "16x24", "24x16", "32x32"]
    requests, builds, hits = (sum(int(r[i]) for r in rows) for i in (1, 2, 3))
    assert requests == 15 and builds + hits == 15
    assert sum(r[-1] == "yes" for r in rows) == 2  # max_entries=2 holds two sizes at the end
    summary = re.search(r"hits (\d+), misses (\d+), evictions (\d+)", result.stdout)
    assert summary, result.stdout
    assert (int(summary[1]), int(summary[2])) == (hits, builds)
    assert int(summary[3]) == builds - 2


def test_serve_rejects_bad_sizes():
    result = subprocess.run(
        [sys.executable, "-m", "shapecache", "serve", "--sizes", "16by16"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "--sizes: cannot read '16by16'" in result.stderr


def test_serving_tiny_sd_prewarms_everything_the_pipeline_uses():
    result = subprocess.run(
        [sys.executable, "-m", "shapecache", "serve", "--model", "tiny-sd", "--sizes", "32x32,32x48,48x48"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "pre-warm order: 48x48, 32x48, 32x32" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"^\s*\d+x\d+\s", line)]
    assert [r[0] for r in rows] == ["32x32", "32x48", "48x48"]
    assert all(r[-2] == "0" and r[-1] == "yes" for r in rows), result.stdout  # built in call, equal


def test_demo_is_the_repro_scenario_with_the_tiny_pipeline_on_the_default_device():
    result = subprocess.run(
        [sys.executable, "-m", "shapecache", "demo", "--sizes", "32x32,48x32", "--strategies", "shapecache"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert result.stdout.startswith(f"shapecache demo: tiny-sd on {device}, 2 sizes (given)"), result.stdout
    assert "verdicts: shapecache: completed" in result.stdout
    assert len(re.findall(r"^\s+\d+x\d+\s+\d+\.\d+", result.stdout, flags=re.M)) == 2
