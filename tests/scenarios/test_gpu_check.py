"""`python -m shapecache gpu-check`'s runner, with steps that stand for the real ones: limits,
process groups, the report. (The real steps need a CUDA device.)"""

import json
import os
import subprocess
import sys
import time

import pytest

from shapecache.scenarios import _gpu_check

LEAVES_A_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
print("started", child.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waits for its parent (init) to reap it
        return f.read().split(")")[-1].split()[0] != "Z"


def wait_gone(pid: int, seconds: float = 10) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_steps_run_in_order_a_late_one_is_stopped_with_its_children_and_the_report_is_written(tmp_path):
    pid_file = tmp_path / "child.pid"
    steps = [
        _gpu_check.Step("passes", (sys.executable, "-c", "print('fine')"), 30),
        _gpu_check.Step("fails", (sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"), 30),
        _gpu_check.Step("too slow", (sys.executable, "-c", LEAVES_A_CHILD, str(pid_file)), 3),
        _gpu_check.Step("after", (sys.executable, "-c", "print('still run')"), 30),
        _gpu_check.Step("crashes", (sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"), 30),
    ]
    started = time.monotonic()
    report = _gpu_check.run_steps(steps, tmp_path / "out", {"device": "none", "torch": "x"}, total_seconds=60)
    assert time.monotonic() - started < 30
    statuses = [s["status"] for s in report["steps"]]
    assert statuses == [0, 3, "timed out after 3 s", 0, "killed by SIGSEGV"], statuses
    assert "broken" in report["steps"][1]["output_tail"] and "started" in report["steps"][2]["output_tail"]
    assert wait_gone(int(pid_file.read_text())), "the step's child outlived it"
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [s["status"] for s in written["steps"]] == statuses
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "| too slow | timed out after 3 s |" in markdown and "## fails" in markdown
    assert (tmp_path / "out" / "fails.log").read_text() == "broken\n"  # each step's whole output
    assert "started" in (tmp_path / "out" / "too-slow.log").read_text()


def test_a_finished_step_leaves_nothing_running_and_the_total_limit_holds(tmp_path):
    pid_file = tmp_path / "child.pid"
    leaves_and_exits = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', "
                        "'import time; time.sleep(120)']); open(sys.argv[1], 'w').write(str(child.pid))")
    steps = [_gpu_check.Step("leaves a child", (sys.executable, "-c", leaves_and_exits, str(pid_file)), 30),
             _gpu_check.Step("sleeps", (sys.executable, "-c", "import time; time.sleep(60)"), 30),
             _gpu_check.Step("no time left", (sys.executable, "-c", "print('never')"), 30)]
    started = time.monotonic()
    report = _gpu_check.run_steps(steps, tmp_path, {}, total_seconds=4 + _gpu_check.STOP_SECONDS)
    assert time.monotonic() - started < 4 + _gpu_check.STOP_SECONDS
    assert wait_gone(int(pid_file.read_text()))
    assert [s["status"] for s in report["steps"]][0] == 0
    assert report["steps"][1]["status"].startswith("timed out after")
    assert report["steps"][2]["status"] == "not run"


def test_the_plan_fits_ten_minutes_and_compiles_only_when_asked(tmp_path):
    steps = _gpu_check.plan(tmp_path)
    startup = 30  # importing torch and finding the device
    assert sum(s.seconds + _gpu_check.STOP_SECONDS for s in steps) + startup <= _gpu_check.TOTAL_SECONDS
    compiling = ("reduce_overhead", "shapecache_compile", "compile_dynamic", "torch_compile", "shapecache_tuned")
    assert not [s.name for s in steps if any(c in " ".join(s.command) for c in compiling)]
    with_compile = " ".join(" ".join(s.command) for s in _gpu_check.plan(tmp_path, with_compile=True))
    assert all(c in with_compile for c in compiling)
    assert all(str(tmp_path) in " ".join(s.command) for s in steps[1:])


RUNS_A_LONG_STEP = """
import signal, sys
from pathlib import Path
from shapecache.scenarios import _gpu_check
signal.signal(signal.SIGTERM, _gpu_check._exit_on_sigterm)  # as run() sets it
step = _gpu_check.Step("long", (sys.executable, "-c", sys.argv[2], sys.argv[1] + "/child.pid"), 60)
_gpu_check.run_steps([step], Path(sys.argv[1]), {})
"""


def test_sigterm_to_the_check_stops_the_running_step_and_its_children(tmp_path):
    check = subprocess.Popen([sys.executable, "-c", RUNS_A_LONG_STEP, str(tmp_path), LEAVES_A_CHILD])
    pid_file = tmp_path / "child.pid"
    end = time.monotonic() + 30
    while time.monotonic() < end and not (pid_file.exists() and pid_file.read_text()):
        time.sleep(0.05)
    check.terminate()
    check.terminate()  # a second SIGTERM does not cut the stopping short
    assert check.wait(timeout=30) == 128 + 15
    assert wait_gone(int(pid_file.read_text())), "the running step's child outlived the check"
    stopped = json.loads((tmp_path / "report.json").read_text())["steps"]
    assert [s["status"] for s in stopped] == ["stopped with the check (SystemExit)"]
    assert "started" in stopped[0]["output_tail"]  # what it printed before the check was stopped


def test_the_checks_time_counts_from_the_process_start():
    script = "import time; time.sleep(1.5); from shapecache.scenarios import _gpu_check; " \
             "print(_gpu_check.seconds_since_process_start())"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert 1.5 <= float(out) < 30


def test_a_graph_benchmark_whose_strategies_could_not_run_exits_non_zero():
    # Here, without a CUDA device, the strategy fails to start: the table says so, and the
    # exit status too, so that gpu-check does not report the step as passed.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "cuda_graph_memory.py"), "--strategies",
                           "eager", "--calls", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "eager" in proc.stdout and "failed:" in proc.stdout
    assert "failed: eager (1 of 1 strategies asked for did not run)" in proc.stderr


def test_the_check_names_what_keeps_it_from_running_before_any_step():
    # This build (the CPU torch) has no CUDA code: the check would measure nothing of the GPU
    # path, so it stops first, saying why (here: torch itself has no CUDA).
    unmet = _gpu_check.unmet_needs()
    assert unmet[0] == "this shapecache has no CUDA code: it was built against a torch without CUDA"
    assert all("missing Python packages" not in need for need in unmet)  # the test extra is installed here


def test_the_quick_plan_keeps_the_memory_steps_time_and_fits_its_limit(tmp_path):
    deadline = time.time() + _gpu_check.QUICK_SECONDS
    steps = _gpu_check.quick_plan(tmp_path, deadline)
    assert [s.name for s in steps] == ["cuda tests", "probes", "speed", "memory"]
    speed = steps[2].command
    until = float(speed[speed.index("--until") + 1])
    # the speed step ends itself in time for the memory step and the stopping of both
    assert until <= deadline - _gpu_check.MEMORY_SECONDS - 3 * _gpu_check.STOP_SECONDS + 1
    fixed = sum(s.seconds + _gpu_check.STOP_SECONDS for s in steps if s.name != "speed")
    startup = 30
    assert _gpu_check.QUICK_SECONDS - fixed - startup >= 120, "the speed step is left too little time"
    assert "sdxl" in speed and "cuda" in speed
    again = _gpu_check.quick_plan(tmp_path, deadline, only=("speed",))  # a second run, for what time left out
    assert [s.name for s in again] == ["speed"]
    assert float(again[0].command[again[0].command.index("--until") + 1]) > until  # no memory step to keep time for
    dry = _gpu_check.quick_plan(tmp_path, deadline, dry_run=True)
    assert [s.name for s in dry] == ["cuda tests", "probes", "speed"]  # the memory step measures CUDA pools
    assert "tiny" in dry[2].command and "cpu" in dry[2].command
    assert "--calls" not in speed and dry[2].command[dry[2].command.index("--calls") + 1] == "3"  # the device's: 10


@pytest.mark.slow
def test_the_quick_dry_run_runs_each_step_on_the_cpu_and_writes_its_tables(tmp_path):
    # The dry run of the device check: the same steps and benchmarks, on the CPU, a tiny UNet.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # 200 s: the rows read here must end within what the speed step is left. On a slower
    # 2-core machine, alone, the cuda tests took 9 s and the probes 36 (each row of the speed
    # step starts a process, and its first took over 5 s), so 80 s left it 8 s and no row ended;
    # a faster one, with the other test worker busy, took up to 25 s for the three rows read
    # here (one torch thread per process, tests/conftest.py).
    proc = subprocess.run([sys.executable, "-m", "shapecache", "gpu-check", "--quick", "--dry-run", "--seconds", "200",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=400, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(s["step"], s["status"]) for s in report["steps"]] == [("cuda tests", 0), ("probes", 0), ("speed", 0)]
    assert "| cuda_code | False |" in (tmp_path / "environment.md").read_text()
    probes = json.loads((tmp_path / "probes.json").read_text())["probes"]
    assert probes[0]["calls"] == 18 and probes[0]["errors"] == [] and probes[0]["mismatches"] == []
    assert probes[1]["error_counts"] == {"default generator": 0, "own generator": 0}
    assert probes[2]["errors"] == probes[2]["mismatches"] == probes[2]["upgrade_failures"] == []
    assert probes[2]["upgrades"] + probes[2]["upgrades_not_kept"] == 1
    rows = {(r["strategy"], r["compile"], tuple(r["size"])): r for r in json.loads((tmp_path / "speed.json").read_text())}
    for measured in ("eager", "auto"):
        row = rows[(measured, "", (64, 64))]
        assert row["median_ms"] > 0 and row["max_abs_difference"] == 0, row
    assert "not available" in rows[("cuda_graph", "", (64, 64))]["error"]  # why a graph cannot run here
    assert all("error" in row or "median_ms" in row for row in rows.values())
    assert "| 64x64 | eager |" in (tmp_path / "speed.md").read_text()


def test_the_quick_checks_steps_are_named_and_a_wrong_name_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shapecache", "gpu-check", "--quick", "--dry-run", "--steps",
                           "probes,sped", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--steps='probes,sped': 'sped' is no step; expected some of cuda tests, probes, speed, memory" in proc.stderr
    assert not (tmp_path / "report.json").exists()
