"""Where the CUDA headers and libraries that shapecache builds against are.

shapecache compiles no .cu file, so it needs no CUDA compiler: only the headers that ATen's
CUDA headers include (the runtime's with its crt/ folder, CCCL's nv/target, cuBLAS's,
cuBLASLt's, cuSPARSE's, cuSOLVER's), the CUDA runtime library, and optionally cuDNN. torch's
CUDA build depends on packages holding all of them but crt/ and nv/target: from CUDA 13 on
those are nvidia-cuda-crt and nvidia-cuda-cccl, packages of headers that a machine without a
toolkit installs beside torch (the build's warning names them). Each is looked for in a CUDA toolkit of torch's CUDA
major version first (CUDAToolkit_ROOT, CUDA_HOME, CUDA_PATH, nvcc's, /usr/local/cuda), then
in the nvidia-* packages that torch's CUDA build depends on (pip installs them as
site-packages/nvidia/<name>/{include,lib}), so that a machine with a driver and torch, and
no toolkit, builds the CUDA code too.

Run by CMakeLists.txt as ``python cuda_paths.py --cuda-version 13.0``; prints one
``KEY=VALUE`` line each (list items separated by "|"): INCLUDE_DIRS, CUDART,
CUDNN_INCLUDE_DIR, CUDNN_LIBRARY, MISSING (what was not found; empty when the CUDA code can
be built), INSTALL (the pip requirements that supply what is missing), SEARCHED. Needs nothing but the standard library.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

REQUIRED_HEADERS = ("cuda_runtime_api.h", "crt/host_config.h", "nv/target", "cublas_v2.h", "cublasLt.h", "cusparse.h",
                    "cusolverDn.h")

# The pip package that supplies each required file, by CUDA major version ({minor}: torch's).
PACKAGES = {
    "cuda_runtime_api.h": {12: "nvidia-cuda-runtime-cu12==12.{minor}.*", 13: "nvidia-cuda-runtime==13.{minor}.*"},
    "crt/host_config.h": {12: "nvidia-cuda-nvcc-cu12==12.{minor}.*", 13: "nvidia-cuda-crt==13.{minor}.*"},
    "nv/target": {12: "nvidia-cuda-cccl-cu12==12.{minor}.*", 13: "nvidia-cuda-cccl==13.{minor}.*"},
    "cublas_v2.h": {12: "nvidia-cublas-cu12", 13: "nvidia-cublas"},
    "cublasLt.h": {12: "nvidia-cublas-cu12", 13: "nvidia-cublas"},
    "cusparse.h": {12: "nvidia-cusparse-cu12", 13: "nvidia-cusparse"},
    "cusolverDn.h": {12: "nvidia-cusolver-cu12", 13: "nvidia-cusolver"},
    "libcudart.so": {12: "nvidia-cuda-runtime-cu12==12.{minor}.*", 13: "nvidia-cuda-runtime==13.{minor}.*"},
}
_VERSION = re.compile(r"#define\s+CUDA_VERSION\s+(\d+)")


def toolkit_roots() -> list[Path]:
    roots = [os.environ.get(name) for name in ("CUDAToolkit_ROOT", "CUDA_HOME", "CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots.append("/usr/local/cuda")
    return _unique(Path(r) for r in roots if r)


def package_roots() -> list[Path]:
    """The nvidia-* packages' folders (site-packages/nvidia/*), in the order Python finds them."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return _unique(child for location in spec.submodule_search_locations
                   for child in sorted(Path(location).iterdir()) if child.is_dir())


def toolkit_major(root: Path) -> int | None:
    """The CUDA major version of the toolkit at `root` (from include/cuda.h), or None."""
    try:
        found = _VERSION.search((root / "include" / "cuda.h").read_text(errors="replace"))
    except OSError:
        return None
    return int(found.group(1)) // 1000 if found else None


def locate(cuda_version: str, toolkits: list[Path], packages: list[Path]) -> dict:
    """What to build against, for torch's `cuda_version` ("13.0"): see the module's docstring.
    A toolkit of another major version than torch's is passed over: its headers would not
    match the libraries torch loads."""
    major, minor = (int(part) for part in cuda_version.split(".")[:2])
    matching = [root for root in toolkits if toolkit_major(root) == major]
    roots = matching + packages
    include_dirs, missing = [], []
    for header in REQUIRED_HEADERS:
        found = _first(root / "include" for root in roots if (root / "include" / header).is_file())
        if found is None:
            missing.append(header)
        elif found not in include_dirs:
            include_dirs.append(found)
    cudart = _library(roots, "cudart")
    if cudart is None:
        missing.append("libcudart.so")
    cudnn_include = _first(root / "include" for root in roots if (root / "include" / "cudnn.h").is_file())
    cudnn = _library(roots, "cudnn") if cudnn_include else None
    install = _unique(PACKAGES[name][major].format(minor=minor) for name in missing if major in PACKAGES[name])
    return {"INCLUDE_DIRS": include_dirs, "CUDART": cudart, "CUDNN_INCLUDE_DIR": cudnn_include if cudnn else None,
            "CUDNN_LIBRARY": cudnn, "MISSING": missing, "INSTALL": install, "SEARCHED": roots}


def _library(roots: list[Path], name: str) -> Path | None:
    """lib<name>.so, else the lowest-versioned lib<name>.so.N, from the first root that has one
    (pip's packages ship only the versioned file: the name torch itself loads)."""
    for root in roots:
        for folder in (root / "lib64", root / "lib"):
            plain = folder / f"lib{name}.so"
            if plain.is_file():
                return plain
            versioned = sorted(folder.glob(f"lib{name}.so.[0-9]*"), key=lambda p: len(p.name))
            if versioned:
                return versioned[0]
    return None


def _first(paths):
    return next(iter(paths), None)


def _unique(paths) -> list[Path]:
    out = []
    for path in paths:
        if path not in out:
            out.append(path)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda-version", required=True, help="torch.version.cuda, e.g. 13.0")
    args = parser.parse_args(argv)
    found = locate(args.cuda_version, toolkit_roots(), package_roots())
    for key, value in found.items():
        values = value if isinstance(value, list) else [] if value is None else [value]
        print(f"{key}={'|'.join(str(v) for v in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
