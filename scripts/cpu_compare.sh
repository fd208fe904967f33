#!/usr/bin/env bash
# tether's cpu backend against llama.cpp's on this machine: `tether bench --device cpu` and
# `llama-bench` take turns on the same files, ROUNDS times, so a machine whose speed drifts
# (a shared VM) moves both alike; prints each run and then the mean of each and the ratio.
#
#   LLAMA_BENCH=path/to/llama-bench scripts/cpu_compare.sh FILE.gguf [FILE.gguf ...]
#
# Environment: LLAMA_BENCH (required: a CPU build of llama.cpp's llama-bench), TETHER
# (default target/release/tether), THREADS (2), PROMPT (64), GEN (32), REPS (-r of each
# run, 5), ROUNDS (3). Needs bash and awk.
set -u

TETHER=${TETHER:-target/release/tether}
THREADS=${THREADS:-2}
PROMPT=${PROMPT:-64}
GEN=${GEN:-32}
REPS=${REPS:-5}
ROUNDS=${ROUNDS:-3}
if [ -z "${LLAMA_BENCH:-}" ] || [ ! -x "$LLAMA_BENCH" ]; then
    echo "cpu_compare.sh: set LLAMA_BENCH to a llama-bench binary" >&2
    exit 2
fi
if [ "$#" -eq 0 ]; then
    echo "usage: LLAMA_BENCH=... $0 FILE.gguf [FILE.gguf ...]" >&2
    exit 2
fi

runs=$(mktemp)
trap 'rm -f "$runs"' EXIT
for round in $(seq "$ROUNDS"); do
    for file in "$@"; do
        name=$(basename "$file" .gguf)
        "$TETHER" bench --model "$file" --device cpu -t "$THREADS" -p "$PROMPT" -n "$GEN" \
            -r "$REPS" 2>/dev/null |
            awk -v f="$name" -v r="$round" '/^\| (pp|tg)[0-9]/ { print "tether", f, r, $2, $4 }' |
            tee -a "$runs"
        "$LLAMA_BENCH" -m "$file" -t "$THREADS" -p "$PROMPT" -n "$GEN" -r "$REPS" 2>/dev/null |
            awk -F'|' -v f="$name" -v r="$round" '$7 ~ /(pp|tg)[0-9]/ {
                gsub(/ /, "", $7); split($8, v, " "); print "llama.cpp", f, r, $7, v[1] }' |
            tee -a "$runs"
    done
done
echo
echo "| file | test | tether t/s | llama.cpp t/s | ratio |"
echo "|---|---|---:|---:|---:|"
awk '{ key = $2 " " $4; sum[$1 " " key] += $5; n[$1 " " key]++; keys[key] = 1 }
    END {
        for (k in keys) {
            t = sum["tether " k] / n["tether " k]; l = sum["llama.cpp " k] / n["llama.cpp " k]
            split(k, p, " ")
            printf "| %s | %s | %.1f | %.1f | %.2fx |\n", p[1], p[2], t, l, t / l
        }
    }' "$runs" | sort
