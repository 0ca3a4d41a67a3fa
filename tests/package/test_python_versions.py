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


def other_pythons() -> dict:
    """{'3.12': its include folder, ...} for the supported Pythons found here, this one apart."""
    found = {}
    for minor in SUPPORTED_MINORS:
        version = f"3.{minor}"
        if (sys.version_info.major, sys.version_info.minor) == (3, minor):
            continue
        root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
        candidates = [shutil.which(f"python{version}"), *sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))]
        for python in filter(None, candidates):
            done = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                                  capture_output=True, text=True)
            include = done.stdout.strip()
            if done.returncode == 0 and (Path(include) / "Python.h").exists():
                found[version] = include
                break
    return found


def version_dependent_sources() -> list:
    return sorted(str(p) for p in (ROOT / "csrc").rglob("*.cpp") if "PY_VERSION_HEX" in p.read_text())


PYTHONS = other_pythons()


def test_the_version_dependent_sources_are_the_ones_checked():
    sources = version_dependent_sources()
    assert any(s.endswith("shape_dispatcher.cpp") for s in sources), sources


@pytest.mark.parametrize("version", sorted(PYTHONS) or [pytest.param("none", marks=pytest.mark.skip(
    reason="no other supported Python with headers on this machine"))])
def test_the_sources_compile_against_another_pythons_headers(version):
    from torch.utils.cpp_extension import include_paths

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    flags = ["-fsyntax-only", "-std=c++17", f"-I{ROOT / 'csrc'}", "-isystem", PYTHONS[version]]
    for path in include_paths():
        flags += ["-isystem", path]
    for source in version_dependent_sources():
        done = subprocess.run([compiler, *flags, source], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{source} against Python {version}:\n{done.stderr[-3000:]}"
