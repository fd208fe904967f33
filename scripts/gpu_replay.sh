#!/usr/bin/env bash
# The field's restart failure, replayed: a qwen2.5-14b-shaped F16 model split over two
# workers (one per GPU when there are two, else both on GPU 0) behind `tether serve`; the
# workers are stopped STOPS times (odd stops SIGTERM, even stops SIGKILL) and started again
# on the same ports, and serve loads the model again each time. For every stop: how long
# until NVML lists no memory for either stopped process and the GPUs are back at the level
# they had before any worker started (within TOLERANCE_MIB), and how long the load took
# (workers started to the first completion). Prints the plan and a table; exits non-zero
# when a load fails or memory stays held.
#
#   scripts/gpu_replay.sh
#
# Environment: TETHER, TETHERCTL (default .gpu/bin/), MODEL (default: synthesized under
# /tmp/tether-models), STOPS (20), CTX (8192), TOLERANCE_MIB (16), LOAD_LIMIT_S (300),
# DEADLINE_S (start no stop after this many seconds; print what ran), OUT (logs).
set -u

TETHER=${TETHER:-.gpu/bin/tether}
TETHERCTL=${TETHERCTL:-.gpu/bin/tetherctl}
MODEL=${MODEL:-/tmp/tether-models/qwen2.5-14b-f16.gguf}
STOPS=${STOPS:-20}
CTX=${CTX:-8192}
TOLERANCE_MIB=${TOLERANCE_MIB:-16}
LOAD_LIMIT_S=${LOAD_LIMIT_S:-300}
DEADLINE_S=${DEADLINE_S:-}
WPORT=${WPORT:-50181}
HPORT=${HPORT:-18181}
LOGS=${OUT:-/tmp/tether-replay-logs}
LIB="$(dirname "$0")/lib"
mkdir -p "$LOGS"
# shellcheck source=scripts/lib/nvrtc.sh
. "$LIB/nvrtc.sh"
setup_nvrtc gpu_replay.sh
began=$(date +%s)
now_ms() { echo $(($(date +%s%N) / 1000000)); }

if [ ! -f "$MODEL" ]; then
    mkdir -p "$(dirname "$MODEL")"
    t=$(now_ms)
    "$TETHER" gguf synth "$MODEL" --shape qwen2.5-14b --type f16 >/dev/null || exit 2
    echo "synthesized $MODEL ($(($(stat -c %s "$MODEL") >> 20)) MiB) in $(($(now_ms) - t)) ms"
fi
MODEL_DIR=$(dirname "$MODEL")
gpus=$(python3 "$LIB/gpu_mem.py" used | wc -l)
if [ "$gpus" -ge 2 ]; then DEVICES=(cuda:0 cuda:1); else DEVICES=(cuda:0 cuda:0); fi
URL="http://127.0.0.1:$HPORT"
worker_addr() { echo "127.0.0.1:$((WPORT + $1))"; }
status() { "$TETHERCTL" --worker "$(worker_addr "$1")" status --json 2>/dev/null; }
healthy() { python3 -c "import urllib.request as u; u.urlopen('$URL/health', timeout=1)" 2>/dev/null; }
used_total() { python3 "$LIB/gpu_mem.py" used | awk '{ s += $1 } END { print s }'; }

baseline=$(used_total)
PIDS=()
start_workers() {
    local i
    for i in 0 1; do
        "$TETHER" worker --device "${DEVICES[$i]}" --listen "$(worker_addr $i)" \
            --model-dir "$MODEL_DIR" >>"$LOGS/worker$i.log" 2>&1 &
        PIDS[i]=$!
    done
    for i in 0 1; do
        for _ in $(seq 600); do status $i >/dev/null && break; sleep 0.1; done
    done
}
serve=
trap 'kill -KILL ${PIDS[*]} $serve 2>/dev/null; wait 2>/dev/null' EXIT

start_workers
flags=(--model "$MODEL" --worker "$(worker_addr 0)" --worker "$(worker_addr 1)" --ctx "$CTX" --parallel 1)
echo "== plan (${DEVICES[*]})"
"$TETHER" plan "${flags[@]}" | tee "$LOGS/plan.txt"

wait_loaded() { # seconds limit; then one completion must succeed
    local t
    for t in $(seq $(($1 * 10))); do
        healthy && break
        kill -0 "$serve" 2>/dev/null || return 1
        sleep 0.1
    done
    python3 "$LIB/load_client.py" "$URL" one 8 4 1000 >>"$LOGS/requests.log" 2>&1
}
t=$(now_ms)
"$TETHER" serve "${flags[@]}" --model-path-on-workers "$(basename "$MODEL")" \
    --listen "127.0.0.1:$HPORT" >"$LOGS/serve.log" 2>&1 &
serve=$!
if wait_loaded "$LOAD_LIMIT_S"; then
    echo "first load (the coordinator checksums its copy too): $(($(now_ms) - t)) ms"
else
    echo "first load failed; see $LOGS"
    exit 1
fi

failed=0
rows=()
for i in $(seq "$STOPS"); do
    if [ -n "$DEADLINE_S" ] && [ $(($(date +%s) - began)) -ge "$DEADLINE_S" ]; then
        echo "deadline of $DEADLINE_S s reached after $((i - 1)) stops"
        break
    fi
    sig=KILL
    [ $((i % 2)) -eq 1 ] && sig=TERM
    t=$(now_ms)
    kill -"$sig" "${PIDS[@]}"
    wait "${PIDS[@]}" 2>/dev/null
    exited=$(($(now_ms) - t))
    # NVML must list neither process and the GPUs must be back where they started.
    released=
    for _ in $(seq 500); do
        held=$(python3 "$LIB/gpu_mem.py" procs | awk -v a="${PIDS[0]}" -v b="${PIDS[1]}" '$1 == a || $1 == b { s += $2 } END { print s + 0 }')
        over=$(($(used_total) - baseline))
        if [ "$held" -eq 0 ] && [ "$over" -le $((TOLERANCE_MIB << 20)) ]; then
            released=$(($(now_ms) - t))
            break
        fi
        sleep 0.01
    done
    # serve sees the loss before the new workers come up, so the load timed is a fresh one.
    for _ in $(seq 150); do healthy || break; sleep 0.1; done
    t=$(now_ms)
    start_workers
    if wait_loaded "$LOAD_LIMIT_S"; then
        load="$(($(now_ms) - t)) ms"
    else
        load=FAILED
    fi
    verdict=ok
    if [ -z "$released" ] || [ "$load" = FAILED ]; then verdict=FAIL; failed=1; fi
    rows+=("$(printf '%4d %-5s %8s %12s %12s %10s  %s' "$i" "$sig" "$exited" "${released:-held}" "$((over >> 20))" "$load" "$verdict")")
    echo "${rows[-1]}"
done

echo
echo "== replay: ${DEVICES[*]}, $(basename "$MODEL"), ctx $CTX"
printf '%4s %-5s %8s %12s %12s %10s  %s\n' stop sig exit_ms released_ms over_MiB load verdict
printf '%s\n' "${rows[@]}"
exit $failed
