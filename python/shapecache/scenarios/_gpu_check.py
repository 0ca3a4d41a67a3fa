"""``python -m shapecache gpu-check``: the whole GPU path verified in one command, from a
checkout of the repository on a machine with a CUDA device.

Steps (``plan``), each in a process group of its own under a time limit: the tests marked
``cuda``; the graph memory benchmark (six sizes in the order that grows a pool most, a budget
that forces a rebuild, the pool's peak against the largest size alone); the comparison with
eager and per-size graphs; the SDXL-architecture out-of-memory loop. Strategies that compile a
full-size UNet with inductor (cold compiles of minutes each) run only with
``--with-compile``. Without it the whole check, from the command's start to its report, ends
within TOTAL_SECONDS: the steps' limits (each about twice the step's expected time on one
H100) and the time to stop each step's group add up to less.

A step that runs past its limit is stopped with its whole process group (the benchmarks' own
children included), and so is anything a finished step left running: nothing holds the GPU
after its step. SIGTERM to the check itself stops the running step's group the same way. The
report, Markdown and JSON (each step's exit status, time and the end of its output), is
rewritten after every step, so it exists whatever stops the check.
Without a CUDA device it says so and exits with status 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shapecache.scenarios._child_process import signal_name

TOTAL_SECONDS = 600
GRACE_SECONDS = 5  # between SIGTERM and SIGKILL for a step's process group
STOP_SECONDS = 2 * GRACE_SECONDS  # the longest a step's group takes to stop (stop_group)
OUTPUT_TAIL = 4000


@dataclass(frozen=True)
class Step:
    name: str
    command: tuple
    seconds: float  # the step's time limit


def plan(out: Path, with_compile: bool = False) -> list[Step]:
    """The steps, with `{out}` in their commands replaced by `out`."""
    python = sys.executable
    graph_strategies = "eager,naive_graphs,shapecache,largest_alone"
    compared = "eager,naive_graphs,shapecache"
    repro = "naive,shapecache"
    if with_compile:
        graph_strategies += ",reduce_overhead,shapecache_compile"
        compared += ",reduce_overhead,compile_dynamic,shapecache_compile,shapecache_tuned"
        repro += ",torch_compile"
    steps = [
        Step("cuda tests", (python, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"), 160),
        Step("graph memory", (python, "benchmarks/cuda_graph_memory.py", "--calls", "5", "--strategies",
                              graph_strategies, "--json", f"{out}/cuda_graph_memory.json"), 130),
        Step("comparison", (python, "benchmarks/comparison.py", "--models", "sd15", "--calls", "5", "--strategies",
                            compared, "--json", f"{out}/comparison.json"), 105),
        Step("sdxl out-of-memory loop", (python, "-m", "shapecache", "repro", "--model", "sdxl", "--budget", "24GiB",
                                         "--strategies", repro, "--json", f"{out}/repro_sdxl.json",
                                         "--plot", f"{out}/repro_sdxl.png"), 135),
    ]
    if with_compile:  # cold inductor compiles of full-size UNets: minutes per strategy
        steps = [Step(s.name, s.command, s.seconds * 4) for s in steps]
    return steps


# --quick: what a device lent for minutes measures, in the order of its tables' importance to
# the GPU route (the speed table is the compiled route's, the memory table the pool's). The
# speed step stops itself MEMORY_SECONDS (and the stopping time) before the check's end, so
# that the memory step after it keeps its time.
QUICK_SECONDS = 450
QUICK_TESTS = ("tests/backends/test_cuda_graph.py", "tests/ops", "tests/cache", "tests/core")
QUICK_SIZES = "1024x1024,1152x896"
MEMORY_SECONDS = 100
DRY_RUN_SIZES = "64x64,64x96"
# In the order they run at each size: what the goals compare first.
SPEED_STRATEGIES = "eager,cuda_graph,auto,torch_compile,auto_upgrade,compile_cuda_graph,compile,reduce_overhead"


QUICK_STEPS = ("cuda tests", "probes", "speed", "memory")


def quick_plan(out: Path, deadline: float, dry_run: bool = False, only: tuple = QUICK_STEPS) -> list[Step]:
    """The steps of ``--quick``: the CUDA tests of the graph pool, the cache and the
    convolutions (with their durations); the thread probes; speed by strategy and size (an
    SDXL-architecture UNet, fp16, batch 2), which stops itself by `deadline` (time.time()) less
    the memory step's time; then memory over the six sizes of the loop. `dry_run`: the same
    steps on the CPU with a tiny UNet (the memory step, which measures CUDA graph pools, is
    left out). `only`: the steps to run, of QUICK_STEPS (a second run on a machine still
    warm, for what the first one's time left out)."""
    python = sys.executable
    device = "cpu" if dry_run else "cuda"
    memory_after = not dry_run and "memory" in only
    speed_until = deadline - 2 * STOP_SECONDS - (MEMORY_SECONDS + STOP_SECONDS if memory_after else 0)
    steps = [
        Step("cuda tests", (python, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "--durations=0",
                            *QUICK_TESTS), 100),
        # (on the CPU the probes' calls are the slow part: 36 s alone on a slower 2-core machine)
        Step("probes", (python, "benchmarks/cuda_probes.py", "--device", device, "--out", str(out)),
             120 if dry_run else 60),
        Step("speed", (python, "benchmarks/compiled_speed.py", "--model", "tiny" if dry_run else "sdxl",
                       "--sizes", DRY_RUN_SIZES if dry_run else QUICK_SIZES, "--device", device, "--out", str(out),
                       "--until", f"{speed_until:.0f}",
                       # (a dry run's rows say that each strategy runs, not how fast: 3 calls each)
                       "--strategies", SPEED_STRATEGIES, *(("--calls", "3") if dry_run else ())),
             max(1.0, round(speed_until - time.time() + STOP_SECONDS))),  # its own --until ends it first
    ]
    if not dry_run:
        steps.append(Step("memory", (python, "benchmarks/cuda_graph_memory.py", "--model", "sdxl", "--calls", "3",
                                     "--strategies", "naive_graphs,shapecache,largest_alone",
                                     "--json", f"{out}/memory.json"), MEMORY_SECONDS))
    return [step for step in steps if step.name in only]


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="gpu-check", help="folder for the report (default %(default)s)")
    parser.add_argument("--with-compile", action="store_true",
                        help="also the strategies that compile full-size UNets with inductor (limits x4)")
    parser.add_argument("--quick", action="store_true",
                        help="what fits a device lent for minutes: the environment, the graph tests, thread probes, "
                             "speed by strategy and size, memory (docs/gpu.md)")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --quick: the same steps on the CPU with a tiny UNet, before any device time is spent")
    parser.add_argument("--steps", default=None,
                        help="with --quick: the steps to run, comma-separated, of: " + ", ".join(QUICK_STEPS) +
                             " (default: all)")
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"the whole check's limit, from the process's start (default {TOTAL_SECONDS}; "
                             f"{QUICK_SECONDS} with --quick)")


# What the steps import besides torch and shapecache, and which steps need it (--quick's tests
# leave out the pipelines' tests, which import transformers).
NEEDED_MODULES = {"pytest": "cuda tests", "hypothesis": "cuda tests", "diffusers": "every UNet step",
                  "transformers": "every UNet step"}
QUICK_NEEDED = ("pytest", "hypothesis", "diffusers")


def unmet_needs(quick: bool = False, dry_run: bool = False) -> list[str]:
    """What keeps the steps from checking the GPU path here, each with its fix: a build without
    CUDA code (every step would measure eager calls only; a dry run runs on the CPU anyway), a
    package a step imports."""
    import importlib.util

    from shapecache._built_with import cpu_only_reason
    from shapecache._extension import _C

    unmet = []
    if not _C.has_cuda_graphs and not dry_run:
        unmet.append(cpu_only_reason() or "this shapecache has no CUDA code: it was built against a torch without CUDA")
    needed = QUICK_NEEDED if quick else NEEDED_MODULES
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        needed_by = sorted({NEEDED_MODULES[name] for name in missing})
        unmet.append(f"missing Python packages {', '.join(missing)} (needed by: {'; '.join(needed_by)}): "
                     "pip install --no-build-isolation '.[test]', or bring them as wheels (docs/gpu.md)")
    return unmet


def run(args) -> int:
    import torch

    if (args.dry_run or args.steps) and not args.quick:
        print("shapecache gpu-check: --dry-run and --steps are --quick's; add --quick", file=sys.stderr)
        return 2
    only = QUICK_STEPS if not args.steps else tuple(name.strip() for name in args.steps.split(","))
    unknown = [name for name in only if name not in QUICK_STEPS]
    if unknown:
        print(f"shapecache gpu-check: --steps={args.steps!r}: {', '.join(map(repr, unknown))} is no step; expected "
              f"some of {', '.join(QUICK_STEPS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not args.dry_run:
        print("shapecache gpu-check: no CUDA device is visible; nothing was checked", file=sys.stderr)
        return 1
    unmet = unmet_needs(args.quick, args.dry_run)
    if unmet:
        for need in unmet:
            print(f"shapecache gpu-check: {need}", file=sys.stderr)
        print("shapecache gpu-check: nothing was checked", file=sys.stderr)
        return 1
    if not Path("tests").is_dir() or not Path("benchmarks").is_dir():
        print("shapecache gpu-check: run it from a checkout of the repository (tests/ and benchmarks/ are needed)",
              file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    environment = environment_table(args.dry_run)
    (out / "environment.md").write_text(environment + "\n")
    print(environment, flush=True)
    header = {"device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.quick:
        total = args.seconds or QUICK_SECONDS
        steps = quick_plan(out, time.time() + total - seconds_since_process_start(), args.dry_run, only)
    else:
        steps = plan(out, args.with_compile)
        total = args.seconds or (TOTAL_SECONDS if not args.with_compile else sum(s.seconds + STOP_SECONDS for s in steps))
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        report = run_steps(steps, out, header, total_seconds=total - seconds_since_process_start())
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if all(s["status"] == 0 for s in report["steps"]) else 1


def environment_table(dry_run: bool = False) -> str:
    """The first table: the device, torch, CUDA, cuDNN, the driver, how shapecache was built
    (its compiler, the libraries its module needs) and whether it has CUDA code."""
    import platform
    import shutil

    import torch

    from shapecache._built_with import build_info
    from shapecache._extension import _C

    info = build_info()
    rows = {"python": platform.python_version(), "torch": torch.__version__, "torch CUDA": torch.version.cuda,
            "cuDNN": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "shapecache": info["shapecache"], "built against torch": info["built_against_torch"],
            "compiler": info.get("compiler"), "cuda_code": info["cuda_code"]}
    if torch.cuda.is_available() and not dry_run:
        properties = torch.cuda.get_device_properties(0)
        rows.update(device=f"{properties.name}, {properties.total_memory / 2**30:.1f} GiB, "
                           f"compute capability {properties.major}.{properties.minor}",
                    driver=_command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]))
    else:
        rows.update(device="cpu (dry run)" if dry_run else "no CUDA device")
    readelf = shutil.which("readelf")
    needed = "readelf not found"
    if readelf:
        dynamic = _command_output([readelf, "-d", _C.__file__]) or ""
        needed = ", ".join(line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line)
    rows["module's NEEDED libraries"] = needed
    lines = ["# Environment and build", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows.items()]
    return "\n".join(lines)


def _command_output(command: list[str]) -> str | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _exit_on_sigterm(signum, frame):
    # Unwinds through run_step's `finally`, which stops the running step's group. Once: a
    # second SIGTERM (a supervisor that repeats it) must not cut that stopping short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def seconds_since_process_start() -> float:
    """How long this process has run, torch's import included (Linux's /proc; else 0)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return 0.0


def run_steps(steps: list[Step], out: Path, header: dict, total_seconds: float = TOTAL_SECONDS) -> dict:
    """Runs `steps` in order; writes the report after each, and each step's whole output to
    `out/<step>.log`. Each step runs within its limit and within what is left of
    `total_seconds` once the time to stop its group is kept aside, so the whole ends within
    `total_seconds`. A step the total leaves no time for is reported as not run; a step the
    check is stopped during (SIGTERM, Ctrl-C) is reported as stopped, with its output so far."""
    out.mkdir(parents=True, exist_ok=True)
    report = {**header, "steps": []}
    deadline = time.monotonic() + total_seconds
    for step in steps:
        left = deadline - time.monotonic() - STOP_SECONDS
        entry = {"step": step.name, "command": " ".join(step.command), "limit": step.seconds}
        if left <= 1:
            entry.update(status="not run", seconds=0.0, output_tail=f"the check's {total_seconds:.0f} s were spent")
            report["steps"].append(entry)
            write_report(report, out)
        else:
            log = out / f"{step.name.replace(' ', '-')}.log"
            started = time.monotonic()
            try:
                status, seconds, output = run_step(step.command, min(step.seconds, left), log)
            except BaseException as stopped:  # the check itself is stopped: say so before it ends
                status, output = f"stopped with the check ({type(stopped).__name__})", _read(log)
                seconds = time.monotonic() - started
                raise
            finally:
                entry.update(status=status, seconds=round(seconds, 1), output_tail=output[-OUTPUT_TAIL:],
                             log=log.name)
                report["steps"].append(entry)
                write_report(report, out)
        print(f"{step.name}: {entry['status']} in {entry['seconds']:.0f} s", flush=True)
    print(f"report: {out / 'report.md'}")
    return report


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:
        return ""


def run_step(command, seconds: float, log_path: Path) -> tuple:
    """(status, seconds, output) of `command` run in a process group of its own, its output
    written to `log_path`; status is the exit status, "killed by SIGNAL" or "timed out after
    N s". The group is stopped when the command ends or runs out of time."""
    start = time.monotonic()
    # Output goes to a file, not a pipe: a child left running would keep a pipe open.
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = process.wait(timeout=seconds)
            if status < 0:  # a crash in native code says nothing of itself: the report does
                status = f"killed by {signal_name(-status)}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {seconds:.0f} s"
        finally:  # also on KeyboardInterrupt: nothing of the step outlives it
            stop_group(process)
    return status, time.monotonic() - start, _read(log_path)


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group `process` leads, SIGKILL to what is left after GRACE_SECONDS."""
    group = process.pid  # start_new_session: the leader's pid is the group's id
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):  # the group is gone
            break
        end = time.monotonic() + GRACE_SECONDS
        while time.monotonic() < end and _group_alive(group):
            process.poll()  # reaps the leader: a zombie is still a member of its group
            time.sleep(0.05)
        if not _group_alive(group):
            break
    process.wait()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def write_report(report: dict, out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1))
    lines = [f"# shapecache gpu-check: {report.get('device', '?')}, torch {report.get('torch', '?')}", "",
             "| step | status | seconds | limit |", "|---|---|---|---|"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['limit']} |" for s in report["steps"]]
    for s in report["steps"]:
        whole = f" (whole output: {s['log']})" if "log" in s else ""
        lines += ["", f"## {s['step']}", "", f"`{s['command']}`{whole}", "", "```", s["output_tail"].rstrip(), "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
