#!/usr/bin/env bash
# The device check in one command, for a GPU machine lent for minutes: installs the wheels
# prepared by scripts/device_wheels.sh that the machine lacks, builds shapecache against the
# machine's torch, and runs `python -m shapecache gpu-check --quick`, all within
# DEVICE_CHECK_SECONDS (default 540) of its start. Each table is written to the output folder
# ($OUT, else device-check/) as it is measured, so a run stopped part-way keeps what it
# measured; the report says which steps the time left out. --dry-run does the same on the CPU
# with a tiny UNet (no device time is spent on a broken check).
#
#   scripts/device_check.sh [--dry-run]
set -uo pipefail
started=$SECONDS
total="${DEVICE_CHECK_SECONDS:-540}"
dry_run=()
[[ "${1:-}" == "--dry-run" ]] && dry_run=(--dry-run)
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/device-check}"
mkdir -p "$out"
exec > >(tee -a "$out/device_check.log") 2>&1
step() { printf '\n== %s (%d s)\n' "$*" $((SECONDS - started)); }

if [[ -d .device-wheels ]]; then
  step "installing what this machine lacks from .device-wheels"
  pip install -q --no-index --find-links .device-wheels diffusers pytest hypothesis scikit-build-core ninja pybind11 \
    || echo "device_check: installing the wheels failed; going on with what is installed"
fi
step "building shapecache against torch $(python -c 'import torch; print(torch.__version__)' 2> /dev/null)"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
build_log="$out/build.log"
if ! timeout $((total / 2)) pip install --no-build-isolation --no-deps -v -C build-dir=build/device-check . \
    > "$build_log" 2>&1; then
  tail -n 40 "$build_log"
  echo "device_check: the build failed or ran past $((total / 2)) s (whole log: $build_log)"
  exit 1
fi
grep -E "shapecache:|CMake Warning" "$build_log" || true
step "gpu-check --quick ${dry_run[*]}"
left=$((total - (SECONDS - started)))
python -m shapecache gpu-check --quick "${dry_run[@]}" --out "$out" --seconds "$left"
status=$?
step "done: status $status; tables in $out (report.md, environment.md, probes.md, speed.md, memory.json)"
exit $status
