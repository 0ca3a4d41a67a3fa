"""cmake/utils.cmake's link_shared_libstdcxx: a module links the shared libstdc++ torch runs
with even where the compiler's own prefix holds only the static archive (a GPU image's
`/opt/gcc/bin/g++` wrapper passes `-B` to such a prefix; a plain `-lstdc++` then takes the
archive, and the module's second copy of libstdc++ crashed the first cached call). Acted out
with a wrapper around the system g++ whose `-B` directory holds a copy of libstdc++.a."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("g++") and shutil.which("readelf")),
                                 reason="needs cmake, g++ and readelf on PATH")]

SOURCE = """
#include <sstream>
#include <string>
extern "C" const char* describe(long value) {
  static std::string text;
  std::ostringstream out;
  out << "value " << value;
  text = out.str();
  return text.c_str();
}
"""


def wrapper_with_only_the_archive(tmp_path: Path) -> Path:
    archive = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not Path(archive).is_file():
        pytest.skip("the system g++ has no libstdc++.a")
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    shutil.copy(archive, prefix / "libstdc++.a")
    wrapper = tmp_path / "g++"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} -B{prefix}/ "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def build(tmp_path: Path, compiler: Path, link_shared: bool, linker_flags: str = "") -> list[str]:
    """Builds a shared library that writes a number to a std::ostringstream; returns its NEEDED entries."""
    project = tmp_path / (("shared" if link_shared else "plain") + ("-flags" if linker_flags else ""))
    project.mkdir()
    (project / "describe.cpp").write_text(SOURCE)
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(describe LANGUAGES CXX)\n"
        f'include("{ROOT / "cmake" / "utils.cmake"}")\n'
        "add_library(describe SHARED describe.cpp)\n"
        + (f'target_link_libraries(describe PRIVATE "{linker_flags}")\n' if linker_flags else "")
        + ("link_shared_libstdcxx(describe)\n" if link_shared else ""))
    for command in (["cmake", "-S", str(project), "-B", str(project / "build"), f"-DCMAKE_CXX_COMPILER={compiler}"],
                    ["cmake", "--build", str(project / "build")]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
    dynamic = subprocess.run(["readelf", "-d", str(project / "build" / "libdescribe.so")], capture_output=True,
                             text=True, check=True).stdout
    return [line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]


def test_a_compiler_prefix_holding_only_the_archive_still_links_the_shared_libstdcxx(tmp_path):
    wrapper = wrapper_with_only_the_archive(tmp_path)
    # The hazard is real with this wrapper: a plain link takes the archive.
    assert "libstdc++.so.6" not in build(tmp_path, wrapper, link_shared=False)
    assert "libstdc++.so.6" in build(tmp_path, wrapper, link_shared=True)


def test_the_shared_libstdcxx_is_linked_under_a_static_link_mode_and_static_libstdcxx(tmp_path):
    # Flags a toolchain may add before the module's own libraries: the linker still in -Bstatic
    # mode where they end, and the driver's -static-libstdc++.
    wrapper = tmp_path / "g++"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    needed = build(tmp_path, wrapper, link_shared=True, linker_flags="-Wl,-Bstatic")
    assert "libstdc++.so.6" in needed
