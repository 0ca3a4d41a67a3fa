"""What a strategy's process says when it ends badly: the repro command and the benchmarks run
each strategy in a process of its own and report this instead of its result."""

from __future__ import annotations

import signal
import subprocess


def why_it_failed(done: subprocess.CompletedProcess) -> str:
    """The signal that killed the process, if one did (a crash in native code writes nothing of
    its own: its last line is whatever it printed before), then the last line of its stderr."""
    lines = (done.stderr or "").strip().splitlines()
    last = lines[-1] if lines else ""
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return f"killed by {name}" + (f"; its last line: {last}" if last else "")
    return last or f"exit status {done.returncode}, with nothing on stderr"
