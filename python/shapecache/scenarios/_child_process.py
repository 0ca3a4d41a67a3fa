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
        return f"killed by {signal_name(-done.returncode)}" + (f"; its last line: {last}" if last else "")
    return last or f"exit status {done.returncode}, with nothing on stderr"


def signal_name(number: int) -> str:
    """SIGSEGV for 11; "signal N" for a number Python does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
