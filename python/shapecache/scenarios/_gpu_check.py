"""``python -m shapecache gpu-check``: the whole GPU path verified in one command, from a
checkout of the repository on a machine with a CUDA device.

Steps, each in a process of its own with a time limit: the tests marked ``cuda``; the graph
memory benchmark (six sizes in the order that grows a pool most, a budget that forces a
rebuild, the pool's peak against the largest size alone); the comparison with eager, per-size
graphs and torch.compile; the SDXL-architecture out-of-memory loop. One report is written,
as Markdown and JSON: each step's exit status, time and the end of its output.
Without a CUDA device it says so and exits with status 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

# (name, command, seconds allowed): about 7 minutes in all on an H100.
STEPS = (
    ("cuda tests", [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"], 240),
    ("graph memory", [sys.executable, "benchmarks/cuda_graph_memory.py", "--calls", "5",
                      "--json", "{out}/cuda_graph_memory.json"], 120),
    ("comparison", [sys.executable, "benchmarks/comparison.py", "--models", "sd15",
                    "--json", "{out}/comparison.json"], 150),
    ("sdxl out-of-memory loop", [sys.executable, "-m", "shapecache", "repro", "--model", "sdxl", "--budget", "24GiB",
                                 "--json", "{out}/repro_sdxl.json", "--plot", "{out}/repro_sdxl.png"], 150),
)


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="gpu-check", help="folder for the report (default %(default)s)")


def run(args) -> int:
    if not torch.cuda.is_available():
        print("shapecache gpu-check: no CUDA device is visible; nothing was checked", file=sys.stderr)
        return 1
    if not Path("tests").is_dir() or not Path("benchmarks").is_dir():
        print("shapecache gpu-check: run it from a checkout of the repository (tests/ and benchmarks/ are needed)",
              file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": []}
    for name, command, limit in STEPS:
        command = [part.replace("{out}", str(out)) for part in command]
        start = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
            status, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            status = "timed out"
            output = (expired.stdout or b"").decode(errors="replace") if isinstance(expired.stdout, bytes) else \
                (expired.stdout or "")
        seconds = time.monotonic() - start
        report["steps"].append({"step": name, "command": " ".join(command), "status": status,
                                "seconds": round(seconds, 1), "output_tail": output[-4000:]})
        print(f"{name}: {status} in {seconds:.0f} s", flush=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    lines = [f"# shapecache gpu-check: {report['device']}, torch {report['torch']}", "",
             "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} |" for s in report["steps"]]
    for s in report["steps"]:
        lines += ["", f"## {s['step']}", "", f"`{s['command']}`", "", "```", s["output_tail"].rstrip(), "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"report: {out / 'report.md'}")
    return 0 if all(s["status"] == 0 for s in report["steps"]) else 1
