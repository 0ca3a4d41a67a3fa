"""CMakeLists.txt's CUDA decision, by configure-only runs: SHAPECACHE_TORCH_CUDA stands for a
CUDA torch's version, CUDAToolkit_ROOT points at a fake toolkit tree, and
SHAPECACHE_DECISION_ONLY ends the run after the decision. (cmake/cuda_paths.py's own choices are
tested in test_cuda_paths.py; this checks what the build does with them.)"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shapecache._built_with import cpu_only_reason

ROOT = Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("cuda_paths", ROOT / "cmake" / "cuda_paths.py")
cuda_paths = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_paths)
HEADERS = cuda_paths.REQUIRED_HEADERS

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake on PATH")]


def toolkit(root: Path, headers, version=12080) -> Path:
    """A CUDA toolkit's layout: include/ with `headers` and cuda.h's version, lib64/libcudart.so."""
    for header in (*headers, "cuda.h"):
        (root / "include" / header).parent.mkdir(parents=True, exist_ok=True)
        (root / "include" / header).write_text("")
    (root / "include" / "cuda.h").write_text(f"#define CUDA_VERSION {version}\n")
    (root / "lib64").mkdir(parents=True, exist_ok=True)
    (root / "lib64" / "libcudart.so").write_text("")
    return root


def configure(tmp_path: Path, *definitions: str, toolkit_root: Path | None = None, succeeds: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDAToolkit_ROOT", "CUDA_HOME", "CUDA_PATH")}
    if toolkit_root is not None:
        env["CUDAToolkit_ROOT"] = str(toolkit_root)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    result = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), *generator,
                             f"-DPython_EXECUTABLE={sys.executable}", "-DSHAPECACHE_DECISION_ONLY=ON", *definitions],
                            capture_output=True, text=True, env=env, timeout=300)
    output = result.stdout + result.stderr
    assert (result.returncode == 0) == succeeds, output
    return " ".join(output.split())  # CMake wraps its messages' lines


def recorded_decision(tmp_path: Path):
    """The _build_info module the configure run wrote: the decision, as the package reads it."""
    spec = importlib.util.spec_from_file_location("_build_info", tmp_path / "build" / "_build_info.py")
    info = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(info)
    return info


def test_a_cuda_torch_with_the_headers_found_builds_the_cuda_code(tmp_path):
    found = toolkit(tmp_path / "cuda-12.8", HEADERS)
    output = configure(tmp_path, "-DSHAPECACHE_TORCH_CUDA=12.8", toolkit_root=found)
    assert f"CUDA headers {found / 'include'}" in output
    assert "torch CUDA '12.8', CUDA code ON" in output
    assert "were not found" not in output  # a warning that cuDNN is not found may come: it is optional
    info = recorded_decision(tmp_path)
    assert info.WITH_CUDA and cpu_only_reason(info, "12.8") is None


def test_missing_headers_stop_the_build_naming_the_packages_and_the_cpu_only_switch(tmp_path):
    partial = toolkit(tmp_path / "cuda-12.8", ["cuda_runtime_api.h", "cublas_v2.h"])
    output = configure(tmp_path, "-DSHAPECACHE_TORCH_CUDA=12.8", toolkit_root=partial, succeeds=False)
    assert "CMake Error" in output and "torch has CUDA 12.8 but crt/host_config.h, nv/target" in output
    # a command to paste: each requirement quoted (they hold '*'), separated by spaces
    assert "pip install 'nvidia-cuda-nvcc-cu12==12.8.*' 'nvidia-cuda-cccl-cu12==12.8.*' " in output and "' and build again" in output
    assert "CMAKE_ARGS=-DSHAPECACHE_CPU_ONLY=ON" in output
    assert not (tmp_path / "build" / "_build_info.py").exists()  # nothing recorded: nothing is built
    # ... and with the switch it names, the same machine builds without CUDA code
    output = configure(tmp_path, "-DSHAPECACHE_TORCH_CUDA=12.8", "-DSHAPECACHE_CPU_ONLY=ON", toolkit_root=partial)
    assert "CUDA code OFF" in output and not recorded_decision(tmp_path).WITH_CUDA


def test_under_pip_the_cpu_only_switch_holds_for_the_build_it_is_given_to_not_the_next(tmp_path):
    # pip reuses a build folder: a build asked for without the switch, after one with it, must
    # build the CUDA code (the switch used to stay in CMake's cache, and the fix the CPU-only
    # build's note names built CPU-only again). SKBUILD is what scikit-build-core defines.
    found = toolkit(tmp_path / "cuda-12.8", HEADERS)
    output = configure(tmp_path, "-DSKBUILD=2", "-DSHAPECACHE_TORCH_CUDA=12.8", "-DSHAPECACHE_CPU_ONLY=ON",
                       toolkit_root=found)
    assert "CUDA code OFF" in output
    output = configure(tmp_path, "-DSKBUILD=2", "-DSHAPECACHE_TORCH_CUDA=12.8", toolkit_root=found)
    assert "torch CUDA '12.8', CUDA code ON" in output and recorded_decision(tmp_path).WITH_CUDA


def test_a_folder_configured_by_hand_keeps_the_cpu_only_switch(tmp_path):
    # as any cached option: a configure that `cmake --build` reruns by itself is given no -D
    found = toolkit(tmp_path / "cuda-12.8", HEADERS)
    configure(tmp_path, "-DSHAPECACHE_TORCH_CUDA=12.8", "-DSHAPECACHE_CPU_ONLY=ON", toolkit_root=found)
    output = configure(tmp_path, "-DSHAPECACHE_TORCH_CUDA=12.8", toolkit_root=found)
    assert "CUDA code OFF" in output and not recorded_decision(tmp_path).WITH_CUDA


def test_cpu_only_is_honoured_even_where_everything_is_found(tmp_path):
    found = toolkit(tmp_path / "cuda-12.8", HEADERS)
    output = configure(tmp_path, "-DSHAPECACHE_TORCH_CUDA=12.8", "-DSHAPECACHE_CPU_ONLY=ON", toolkit_root=found)
    assert "SHAPECACHE_CPU_ONLY is set: building without CUDA code" in output
    assert "CUDA code OFF" in output and "CUDA headers" not in output
    reason = cpu_only_reason(recorded_decision(tmp_path), "12.8")
    assert "it was built with SHAPECACHE_CPU_ONLY=ON" in reason and "rebuild it without SHAPECACHE_CPU_ONLY" in reason


@pytest.mark.skipif(torch.version.cuda is not None, reason="the installed torch has CUDA")
def test_the_installed_cpu_torch_builds_no_cuda_code_and_warns_of_nothing(tmp_path):
    output = configure(tmp_path)
    assert "torch CUDA '', CUDA code OFF" in output and "CMake Warning" not in output
    assert cpu_only_reason(recorded_decision(tmp_path)) is None  # nothing to build: torch has no CUDA
