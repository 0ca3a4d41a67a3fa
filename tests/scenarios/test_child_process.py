"""What the repro command and the benchmarks say of a strategy's process that ended badly."""

import os
import subprocess
import sys

from shapecache.scenarios._child_process import why_it_failed


def run(code: str) -> subprocess.CompletedProcess:
    # without faulthandler, which would print a traceback of the crash after the last line
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONFAULTHANDLER", "PYTHONDEVMODE")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)


def test_a_process_killed_by_a_signal_is_named_so_not_by_its_last_words():
    # A crash in native code writes nothing itself: the last line is whatever came before it
    # (a library's warning), which read alone would pass for the reason.
    done = run("import os, signal, sys; print('a harmless warning', file=sys.stderr, flush=True); "
               "os.kill(os.getpid(), signal.SIGSEGV)")
    assert why_it_failed(done) == "killed by SIGSEGV; its last line: a harmless warning"
    assert why_it_failed(run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")) == "killed by SIGKILL"


def test_a_process_that_exits_with_an_error_says_its_last_line_or_its_status():
    assert why_it_failed(run("raise SystemExit('out of memory at 1536x1536')")) == "out of memory at 1536x1536"
    assert why_it_failed(run("raise SystemExit(3)")) == "exit status 3, with nothing on stderr"
