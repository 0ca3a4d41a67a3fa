"""cmake/cuda_paths.py: which CUDA headers and libraries the build uses, on fake folder trees
laid out as a toolkit and as torch's nvidia-* packages are (CUDA 13: one nvidia/cu13 folder;
cuDNN in nvidia/cudnn)."""

import importlib.util
from pathlib import Path


def load():
    path = Path(__file__).parents[2] / "cmake" / "cuda_paths.py"
    spec = importlib.util.spec_from_file_location("cuda_paths", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HEADERS = load().REQUIRED_HEADERS


def tree(root: Path, headers=(), libraries=(), version=None, lib="lib") -> Path:
    (root / "include").mkdir(parents=True, exist_ok=True)
    (root / lib).mkdir(parents=True, exist_ok=True)
    for header in headers:
        (root / "include" / header).parent.mkdir(parents=True, exist_ok=True)
        (root / "include" / header).write_text("")
    for library in libraries:
        (root / lib / library).write_text("")
    if version is not None:
        (root / "include" / "cuda.h").write_text(f"#define CUDA_VERSION {version}\n")
    return root


def test_torchs_packages_alone_are_enough(tmp_path):
    cuda_paths = load()
    cu13 = tree(tmp_path / "nvidia" / "cu13", HEADERS, ["libcudart.so.13", "libcublas.so.13"])
    cudnn = tree(tmp_path / "nvidia" / "cudnn", ["cudnn.h"], ["libcudnn.so.9", "libcudnn_adv.so.9"])
    found = cuda_paths.locate("13.0", [], [cu13, cudnn])
    assert found["MISSING"] == []
    assert found["INCLUDE_DIRS"] == [cu13 / "include"]
    assert found["CUDART"] == cu13 / "lib" / "libcudart.so.13"
    assert (found["CUDNN_INCLUDE_DIR"], found["CUDNN_LIBRARY"]) == (cudnn / "include", cudnn / "lib" / "libcudnn.so.9")


def test_a_toolkit_of_torchs_version_comes_first_and_packages_fill_its_gaps(tmp_path):
    # As on the development machines: a toolkit without cuBLAS, cuSPARSE and cuSOLVER headers.
    cuda_paths = load()
    toolkit = tree(tmp_path / "cuda-13.0", ["cuda_runtime_api.h"], ["libcudart.so", "libcudart.so.13"],
                   version=13000, lib="lib64")
    cu13 = tree(tmp_path / "nvidia" / "cu13", HEADERS, ["libcudart.so.13"])
    found = cuda_paths.locate("13.0", [toolkit], [cu13])
    assert found["MISSING"] == []
    assert found["INCLUDE_DIRS"] == [toolkit / "include", cu13 / "include"]
    assert found["CUDART"] == toolkit / "lib64" / "libcudart.so"
    assert found["CUDNN_LIBRARY"] is None  # optional: built without tuned cuDNN paths


def test_a_toolkit_of_another_major_version_is_passed_over(tmp_path):
    cuda_paths = load()
    old = tree(tmp_path / "cuda-12.8", HEADERS, ["libcudart.so"], version=12080, lib="lib64")
    cu13 = tree(tmp_path / "nvidia" / "cu13", HEADERS, ["libcudart.so.13"])
    found = cuda_paths.locate("13.0", [old], [cu13])
    assert found["INCLUDE_DIRS"] == [cu13 / "include"] and found["SEARCHED"] == [cu13]


def test_what_is_missing_is_named_with_the_packages_that_supply_it(tmp_path):
    cuda_paths = load()
    runtime_only = tree(tmp_path / "nvidia" / "cuda_runtime", ["cuda_runtime_api.h"], [])
    found = cuda_paths.locate("12.8", [], [runtime_only])
    assert found["MISSING"] == ["crt/host_config.h", "nv/target", "cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h",
                                "libcudart.so"]
    assert found["INSTALL"] == ["nvidia-cuda-nvcc-cu12==12.8.*", "nvidia-cuda-cccl-cu12==12.8.*", "nvidia-cublas-cu12",
                                "nvidia-cusparse-cu12", "nvidia-cusolver-cu12", "nvidia-cuda-runtime-cu12==12.8.*"]


def test_torchs_cuda_13_packages_lack_only_the_crt_and_cccl_headers(tmp_path):
    # torch 2.13+cu130's dependencies, as installed: everything but crt/ and nv/target.
    cuda_paths = load()
    cu13 = tree(tmp_path / "nvidia" / "cu13", [h for h in HEADERS if not h.startswith(("crt/", "nv/"))], ["libcudart.so.13"])
    found = cuda_paths.locate("13.0", [], [cu13])
    assert found["MISSING"] == ["crt/host_config.h", "nv/target"]
    assert found["INSTALL"] == ["nvidia-cuda-crt==13.0.*", "nvidia-cuda-cccl==13.0.*"]


def test_the_command_prints_what_cmake_reads(tmp_path):
    import subprocess
    import sys

    path = Path(__file__).parents[2] / "cmake" / "cuda_paths.py"
    done = subprocess.run([sys.executable, str(path), "--cuda-version", "13.0"], capture_output=True, text=True,
                          timeout=60, env={"PATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    keys = [line.split("=", 1)[0] for line in done.stdout.splitlines()]
    assert keys == ["INCLUDE_DIRS", "CUDART", "CUDNN_INCLUDE_DIR", "CUDNN_LIBRARY", "MISSING", "INSTALL", "SEARCHED"]
