"""`python -m shapecache info`: what this copy was built with, as a new user asks it."""

import subprocess
import sys

import torch

from shapecache._built_with import cpu_only_reason


def test_info_names_the_torch_it_was_built_against_and_whether_cuda_code_was_built():
    proc = subprocess.run([sys.executable, "-m", "shapecache", "info"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if not line.startswith("note: "))
    assert lines["built_against_torch"] == torch.__version__ == lines["torch"]
    from shapecache._extension import _C

    assert lines["cuda_code"] == str(bool(_C.has_cuda_graphs))
    # A note only where torch has CUDA and this build has none, naming the fix.
    assert ("note: " in proc.stdout) == (cpu_only_reason() is not None)
