#!/usr/bin/env bash
# Speed of the cuda backend on llama3-8b-shaped synthetic models, as llama-bench measures
# it (pp512, tg128), from a prebuilt `tether` binary. Run from the repository root on a GPU
# machine:
#
#   scripts/gpu_bench.sh [TYPE ...]          # default: q4_0 q8_0
#
# TETHER=path/to/tether (default .gpu/tether), MODELS=folder for the synthesized files
# (default /tmp/tether-models; kept between runs on the same machine), BENCH_ARGS= extra
# arguments for `tether bench` (default: -p 512 -n 128 -r 3), PARALLEL=1,4,8,16,32,64 also
# runs `tether bench --parallel` with those counts of sequences (PARALLEL_ARGS, default
# -p 128 -n 128 -r 2: llama-batched-bench's -npp 128 -ntg 128).
set -u

tether=${TETHER:-.gpu/tether}
models=${MODELS:-/tmp/tether-models}
args=${BENCH_ARGS:--p 512 -n 128 -r 3}
types=("$@")
[ "${#types[@]}" -eq 0 ] && types=(q4_0 q8_0)
mkdir -p "$models"
# shellcheck source=scripts/lib/nvrtc.sh
. "$(dirname "$0")/lib/nvrtc.sh"
setup_nvrtc gpu_bench.sh

failed=0
for ty in "${types[@]}"; do
    file="$models/llama3-8b-$ty.gguf"
    if [ ! -f "$file" ]; then
        start=$(date +%s%N)
        "$tether" gguf synth "$file" --shape llama3-8b --type "$ty" >/dev/null || { failed=1; continue; }
        echo "synthesized $file in $(( ($(date +%s%N) - start) / 1000000 )) ms"
    fi
    # shellcheck disable=SC2086
    "$tether" bench --model "$file" --device cuda:0 $args || failed=1
    if [ -n "${PARALLEL:-}" ]; then
        # shellcheck disable=SC2086
        "$tether" bench --model "$file" --device cuda:0 --parallel "$PARALLEL" \
            ${PARALLEL_ARGS:--p 128 -n 128 -r 2} || failed=1
    fi
done
exit "$failed"
