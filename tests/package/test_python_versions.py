"""The C++ that reads Python's C API differently by version compiles against every Python the
package supports (pyproject: 3.11 and newer), not only the one the tests run on: GPU machines
run 3.12, where such a branch once failed to build. Each other Python found on this machine
(on PATH or under pyenv) lends its headers to a syntax-only compile of the sources that branch
on PY_VERSION_HEX."""

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SUPPORTED_MINORS = range(11, 15)

pytestmark = pytest.mark.slow


def headers_of(minor: int) -> str | None:
    """The include folder of Python 3.`minor` found here (on PATH or under pyenv), if any."""
    version = f"3.{minor}"
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [shutil.which(f"python{version}"), *sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))]
    for python in filter(None, candidates):
        done = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                              capture_output=True, text=True)
        include = done.stdout.strip()
        if done.returncode == 0 and (Path(include) / "Python.h").exists():
            return include
    return None


def version_dependent_sources() -> list:
    return sorted(str(p) for p in (ROOT / "csrc").rglob("*.cpp") if "PY_VERSION_HEX" in p.read_text())


def test_the_version_dependent_sources_are_the_ones_checked():
    sources = version_dependent_sources()
    assert any(s.endswith("shape_dispatcher.cpp") for s in sources), sources


@pytest.mark.parametrize("minor", [m for m in SUPPORTED_MINORS if m != sys.version_info.minor])
def test_the_sources_compile_against_another_pythons_headers(minor):
    from torch.utils.cpp_extension import include_paths

    include = headers_of(minor)
    if include is None:
        pytest.skip(f"no Python 3.{minor} with headers on this machine")
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    flags = ["-fsyntax-only", "-std=c++17", f"-I{ROOT / 'csrc'}", "-isystem", include]
    for path in include_paths():
        flags += ["-isystem", path]
    for source in version_dependent_sources():
        done = subprocess.run([compiler, *flags, source], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{source} against Python 3.{minor}:\n{done.stderr[-3000:]}"
