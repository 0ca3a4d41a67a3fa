#!/usr/bin/env bash
# The device check in one command, for a GPU machine lent for minutes: installs the wheels in
# .whl/ (scripts/device_wheels.sh) next to the image's packages, builds shapecache against the
# machine's torch, and runs `python3 -m shapecache gpu-check --quick`, all within
# DEVICE_CHECK_SECONDS (default 540) of its start. The tables are written to device-check/ as
# they are measured; where $OUT is set (a folder that is brought back, at most 8 files), the
# tables and an archive of the whole folder are copied there every 15 s and at the end, so a
# run stopped part-way keeps what it measured. --dry-run does the same on the CPU with a tiny
# UNet (no device time is spent on a broken check). DEVICE_CHECK_STEPS (comma-separated, of
# "cuda tests,probes,speed,memory") runs only those: a second run, on a machine still warm
# (its build folder kept), for what the first run's time left out.
#
#   scripts/device_check.sh [--dry-run]
set -uo pipefail
started=$SECONDS
total="${DEVICE_CHECK_SECONDS:-540}"
python="${PYTHON:-python3}"
dry_run=()
[[ "${1:-}" == "--dry-run" ]] && dry_run=(--dry-run)
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="$root/device-check"
rm -rf "$out" && mkdir -p "$out"
site="${SHAPECACHE_CHECK_SITE:-$(mktemp -d)/site}"  # what this check installs: nothing of the image changes
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$out/device_check.log"
step() { printf '\n== %s (%d s)\n' "$*" $((SECONDS - started)) | tee -a "$log"; }

bring_back() {  # the tables, and everything in one archive: within $OUT's 8 files
  [[ -n "${OUT:-}" ]] || return 0
  for table in report.md environment.md probes.md speed.md memory.log; do
    [[ -f "$out/$table" ]] && cp "$out/$table" "$OUT/"
  done
  tar -czf "$OUT/device-check.tgz.part" -C "$root" device-check 2> /dev/null && \
    mv "$OUT/device-check.tgz.part" "$OUT/device-check.tgz"
  cp "$log" "$OUT/" 2> /dev/null
  return 0
}

if compgen -G ".whl/*.whl" > /dev/null; then
  step "installing .whl/ into $site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    >> "$log" 2>&1 || echo "device_check: installing .whl/ failed (see $log); going on with what is installed"
fi
step "building shapecache against torch $("$python" -c 'import torch; print(torch.__version__)' 2> /dev/null)"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
if ! timeout $((total / 2)) "$python" -m pip install --no-build-isolation --no-deps --no-cache-dir --target "$site" \
    -v -C build-dir=build/device-check . > "$out/build.log" 2>&1; then
  tail -n 40 "$out/build.log"
  echo "device_check: the build failed or ran past $((total / 2)) s (whole log: build.log)" | tee -a "$log"
  bring_back
  exit 1
fi
grep -E "shapecache:|CMake Warning" "$out/build.log" || true
step "gpu-check --quick ${dry_run[*]}"
left=$((total - (SECONDS - started)))
( while sleep 15; do bring_back; done ) &
copier=$!
steps=()
[[ -n "${DEVICE_CHECK_STEPS:-}" ]] && steps=(--steps "$DEVICE_CHECK_STEPS")
"$python" -m shapecache gpu-check --quick "${dry_run[@]}" "${steps[@]}" --out "$out" --seconds "$left" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
kill "$copier" 2> /dev/null
wait "$copier" 2> /dev/null
step "done: status $status; tables in $out (report.md, environment.md, probes.md, speed.md, memory.log)"
bring_back
exit "$status"
