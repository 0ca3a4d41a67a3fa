#!/usr/bin/env bash
# Downloads, here, the wheels the device check needs that a GPU machine without network may
# lack (diffusers and its dependencies, pytest and hypothesis, the build's tools), for its
# Python, into .device-wheels/ (ignored by git; carried to the device beside the checkout).
# scripts/device_check.sh installs from it whatever the machine does not have already.
#
#   scripts/device_wheels.sh [--python-version 3.12]
set -euo pipefail
python_version=3.12
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) python_version="$2"; shift 2 ;;
    *) echo "usage: $0 [--python-version X.Y]" >&2; exit 2 ;;
  esac
done
root="$(cd "$(dirname "$0")/.." && pwd)"
wheels="$root/.device-wheels"
rm -rf "$wheels" && mkdir -p "$wheels"
# The packages the check imports (shapecache.scenarios._gpu_check.QUICK_NEEDED) and what a
# --no-build-isolation build needs; torch is the machine's own and is never downloaded.
# shellcheck disable=SC2086
pip download -q --only-binary=:all: --python-version "$python_version" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$wheels" diffusers pytest hypothesis scikit-build-core ninja pybind11
if ls "$wheels"/torch-* > /dev/null 2>&1; then
  echo "device_wheels: torch was pulled in as a dependency; it must stay the machine's own" >&2
  exit 1
fi
echo "device_wheels: $(ls "$wheels" | wc -l) wheels, $(du -sh "$wheels" | cut -f1), in $wheels"
