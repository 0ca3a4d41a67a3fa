#!/usr/bin/env bash
# Builds shapecache against torch's CUDA wheel in a fresh virtual environment, on a machine
# without a GPU, and checks the result: _build_info records CUDA, and shapecache._C imports
# after torch. By default any CUDA toolkit is hidden (a private mount namespace, as root) so
# that the CUDA code must build from torch's own nvidia-* packages, as on a machine with a
# driver and no toolkit; --with-toolkit leaves it visible. It builds twice: first with torch's
# packages alone, where CUDA 13's crt/ and CCCL headers are missing, which must stop with an
# error naming the packages to install (and the CPU-only switch); then with those packages.
#
#   scripts/check_cuda_build.sh [--with-toolkit] [--wheels DIR] [--venv DIR]
#
# --wheels DIR: install torch from wheels in DIR (pip download torch==$TORCH_VERSION -d DIR)
# instead of the index. TORCH_VERSION defaults to 2.13.0. The venv (default: a temporary
# folder) is left in place when --venv is given.
set -euo pipefail

args=("$@")
hide_toolkit=1
wheels=""
venv=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --with-toolkit) hide_toolkit=0; shift ;;
    --wheels) wheels="$2"; shift 2 ;;
    --venv) venv="$2"; shift 2 ;;
    *) echo "usage: $0 [--with-toolkit] [--wheels DIR] [--venv DIR]" >&2; exit 2 ;;
  esac
done
root="$(cd "$(dirname "$0")/.." && pwd)"
torch_version="${TORCH_VERSION:-2.13.0}"
if [[ -z "$venv" ]]; then
  venv="$(mktemp -d)/venv"
fi

if [[ $hide_toolkit == 1 && -z "${SHAPECACHE_TOOLKIT_HIDDEN:-}" ]]; then
  if [[ $(id -u) != 0 ]] || ! command -v unshare > /dev/null; then
    echo "check_cuda_build: hiding the toolkit needs root and unshare; rerun with --with-toolkit" >&2
    exit 2
  fi
  # Re-run this script in a private mount namespace where the toolkit's folders are empty
  # and nvcc is not executable; nothing outside the namespace changes.
  exec unshare -m env SHAPECACHE_TOOLKIT_HIDDEN=1 bash -c '
    set -e
    for dir in /usr/local/cuda*/ /opt/cuda*/; do
      [[ -d "$dir" ]] && mount -t tmpfs none "$(readlink -f "$dir")"
    done
    for nvcc in $(which -a nvcc 2> /dev/null); do mount --bind /dev/null "$nvcc"; done
    exec "$0" "$@"' "$0" "${args[@]}"
fi

step() { printf '\n== %s\n' "$*"; }
step "toolkit: $([[ -n "${SHAPECACHE_TOOLKIT_HIDDEN:-}" ]] && echo hidden || echo visible); nvcc: $(nvcc --version 2> /dev/null | tail -n 1 || true)"
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
# The index's default torch for Linux is the CUDA build; a pip configuration that points
# elsewhere (a CPU-only mirror) is set aside.
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL || true
step "installing torch==$torch_version ${wheels:+from $wheels}"
if [[ -n "$wheels" ]]; then
  pip install -q --find-links "$wheels" "torch==$torch_version"
else
  pip install -q "torch==$torch_version"
fi
pip install -q scikit-build-core ninja
cuda="$(python -c "import torch; print(torch.version.cuda)")"
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
step "a first build with torch's packages alone: it stops, naming what to install"
log="$(mktemp)"
if pip install --no-build-isolation --no-deps -v -C build-dir="$(mktemp -d)" "$root" > "$log" 2>&1; then
  echo "check_cuda_build: the build without CUDA 13's crt/ and CCCL headers did not stop" >&2
  exit 1
fi
grep -E -A6 "CMake Error" "$log" | sed 's/^ *//' | grep -v '^$' || true
grep -q "SHAPECACHE_CPU_ONLY=ON" "$log" || { echo "check_cuda_build: the error does not name the CPU-only switch" >&2; exit 1; }
# What the error named (cmake/cuda_paths.py): on CUDA 13, the crt/ and CCCL headers.
mapfile -t needed < <(python "$root/cmake/cuda_paths.py" --cuda-version "$cuda" | sed -n 's/^INSTALL=//p' | tr '|' '\n' | grep .)
for package in "${needed[@]}"; do
  grep -qF "$package" "$log" || { echo "check_cuda_build: the error does not name $package" >&2; exit 1; }
done
step "installing what it named: ${needed[*]}"
pip install -q ${wheels:+--find-links "$wheels"} "${needed[@]}"
step "building shapecache (--no-build-isolation)"
log="$(mktemp)"
if ! pip install --no-build-isolation --no-deps -v -C build-dir="$(mktemp -d)" "$root" > "$log" 2>&1; then
  tail -n 60 "$log"
  echo "check_cuda_build: the build failed (whole log: $log)" >&2
  exit 1
fi
grep -E -A2 "shapecache:|CMake Warning" "$log" || true
step "checking the build"
cd "$(mktemp -d)"  # import the installed copy, not the checkout
python - <<'EOF'
import torch
import shapecache._build_info as info
print("build info:", {"TORCH_VERSION": info.TORCH_VERSION, "TORCH_CUDA": info.TORCH_CUDA, "WITH_CUDA": info.WITH_CUDA})
assert info.WITH_CUDA, "the CUDA code was not built"
assert info.TORCH_CUDA == torch.version.cuda, (info.TORCH_CUDA, torch.version.cuda)
from shapecache import _C
print("shapecache._C imported after torch:", _C.__file__)
print("CUDA graphs built in:", _C.has_cuda_graphs, "; a CUDA device here:", torch.cuda.is_available())
assert _C.has_cuda_graphs
EOF
step "passed"
