#!/usr/bin/env bash
# Downloads, here, the wheels the device check needs that the GPU machine's image lacks, for
# its Python, into .whl/ (ignored by git): name `.whl` in the device call's `carry` so that it
# travels beside the checkout; scripts/device_check.sh installs them there. The image holds
# torch, pytest, hypothesis, transformers, huggingface_hub, scikit-build-core, pybind11, cmake
# and ninja, not diffusers or importlib_metadata (which diffusers needs); other images may
# lack more: name them as arguments.
#
#   scripts/device_wheels.sh [--python-version 3.12] [PACKAGE==VERSION ...]
set -euo pipefail
python_version=3.12
packages=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) python_version="$2"; shift 2 ;;
    -*) echo "usage: $0 [--python-version X.Y] [PACKAGE==VERSION ...]" >&2; exit 2 ;;
    *) packages+=("$1"); shift ;;
  esac
done
[[ ${#packages[@]} -gt 0 ]] || packages=("diffusers==0.42.1" "importlib_metadata==10.2.0")
root="$(cd "$(dirname "$0")/.." && pwd)"
wheels="$root/.whl"
rm -rf "$wheels" && mkdir -p "$wheels"
# --no-deps: the image's own packages stay (two versions of one package stop the install).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$wheels" "${packages[@]}"
echo "device_wheels: $(ls "$wheels" | wc -l) wheels, $(du -sh "$wheels" | cut -f1), in $wheels"
