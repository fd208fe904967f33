#!/usr/bin/env bash
# Runs every prebuilt test binary in .gpu/ with its ignored (GPU) tests and prints a
# PASS/FAIL table. Run from the repository root on a machine with an NVIDIA GPU:
#
#   scripts/gpu.sh            # all binaries in .gpu/
#   scripts/gpu.sh FILTER     # passes FILTER to each binary (a test name substring)
#
# GPU_DIR=folder runs the binaries of another folder. Exits non-zero if any binary failed. Logs go to .gpu/logs/ (or $OUT when set).
set -u

dir=${GPU_DIR:-.gpu}
if [ ! -d "$dir" ]; then
    echo "gpu.sh: no $dir/ folder here; copy the test binaries into $dir/ first" >&2
    exit 2
fi
logs=${OUT:-$dir/logs}
mkdir -p "$logs"

# The CUDA backend loads libcuda and libnvrtc at run time (see lib/nvrtc.sh).
# shellcheck source=scripts/lib/nvrtc.sh
. "$(dirname "$0")/lib/nvrtc.sh"
setup_nvrtc gpu.sh

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

results=()
failed=0
for bin in "$dir"/*; do
    [ -f "$bin" ] && [ -x "$bin" ] || continue
    name=$(basename "$bin")
    log="$logs/$name.log"
    start=$(date +%s)
    "$bin" --ignored --test-threads=1 "$@" >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    summary=$(grep -E '^test result:' "$log" | tail -n 1)
    if [ "$rc" -eq 0 ]; then
        results+=("PASS  $name  ${secs}s  $summary")
    else
        failed=1
        results+=("FAIL  $name  ${secs}s  rc=$rc  $summary")
        echo "---- $name (last 40 lines of $log)"
        tail -n 40 "$log"
    fi
done

echo
echo "==== GPU test results"
if [ "${#results[@]}" -eq 0 ]; then
    echo "no executable test binaries in $dir/"
    exit 2
fi
printf '%s\n' "${results[@]}"
exit "$failed"
