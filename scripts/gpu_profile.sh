#!/usr/bin/env bash
# Where a decode step's time goes: runs `tether bench` under Nsight Compute (ncu) on a
# llama3-8b-shaped model, keeps only the kernels of the last decode steps, and prints the
# GPU time per kernel name (sum per step, count per step, mean) beside the step's total.
# The sum of kernel times against the measured time per token (tg, printed first) is what
# launch gaps and host work cost. Run from the repository root on a GPU machine:
#
#   scripts/gpu_profile.sh [TYPE ...]        # default: q4_0
#
# TETHER (default .gpu/tether), MODELS (as gpu_bench.sh), STEPS (decode steps profiled,
# default 2), OUT (where the raw CSV goes; default /tmp/tether-profile), BENCH_ARGS (what
# `tether bench` runs; default -p 0 -n 8 -r 1; e.g. --parallel 32 -p 128 -n 4 -r 1 profiles
# steps of 32 sequences).
set -u

tether=${TETHER:-.gpu/tether}
models=${MODELS:-/tmp/tether-models}
steps=${STEPS:-2}
bench_args=${BENCH_ARGS:--p 0 -n 8 -r 1}
logs=${OUT:-/tmp/tether-profile}
types=("$@")
[ "${#types[@]}" -eq 0 ] && types=(q4_0)
mkdir -p "$models" "$logs"
# shellcheck source=scripts/lib/nvrtc.sh
. "$(dirname "$0")/lib/nvrtc.sh"
setup_nvrtc gpu_profile.sh
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n 1)
if [ -z "$ncu" ]; then
    echo "gpu_profile.sh: ncu (Nsight Compute) not found" >&2
    exit 2
fi

for ty in "${types[@]}"; do
    file="$models/llama3-8b-$ty.gguf"
    [ -f "$file" ] || "$tether" gguf synth "$file" --shape llama3-8b --type "$ty" >/dev/null || exit 2
    csv="$logs/profile-$ty.csv"
    # shellcheck disable=SC2086
    "$ncu" --clock-control none --cache-control none --graph-profiling node \
        --metrics gpu__time_duration.sum --csv --print-units base \
        "$tether" bench --model "$file" --device cuda:0 $bench_args >"$csv" 2>"$logs/ncu-$ty.err"
    python3 - "$csv" "$steps" "$ty" <<'PY'
import csv, sys, collections
path, steps, ty = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = []
with open(path) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") == "gpu__time_duration.sum":
        rows.append((r["Kernel Name"], r.get("Grid Size", ""), float(r["Metric Value"].replace(",", ""))))
if not rows:
    print(f"{ty}: no kernels profiled (see ncu-{ty}.err)"); sys.exit(1)
# A decode step ends with the output head's matvec (the widest grid of that kernel): the
# step boundaries are the launches of that kernel with that grid.
keys = [(n, g) for n, g, _ in rows]
last = keys[-1]
ends = [i for i, k in enumerate(keys) if k == last]
if len(ends) < steps + 1:
    print(f"{ty}: only {len(ends)} steps found"); sys.exit(1)
tail = [(n, t) for n, _, t in rows[ends[-steps - 1] + 1:]]
per = collections.defaultdict(lambda: [0.0, 0])
for n, t in tail:
    per[n][0] += t; per[n][1] += 1
total = sum(t for _, t in tail) / steps
print(f"== {ty}: {len(tail) // steps} kernels per decode step, {total / 1e3:.1f} us of kernel time per step")
print(f"{'kernel':40s} {'us/step':>9s} {'n/step':>7s} {'us each':>8s} {'share':>6s}")
for n, (t, c) in sorted(per.items(), key=lambda kv: -kv[1][0]):
    print(f"{n[:40]:40s} {t / steps / 1e3:9.1f} {c / steps:7.1f} {t / c / 1e3:8.2f} {t / steps / total:6.1%}")
PY
done
