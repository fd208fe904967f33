#!/usr/bin/env bash
# Device memory stays where Commit put it while a GPU worker serves. NVML's count of the
# worker process's device memory is sampled every 10 ms (scripts/lib/gpu_mem.py):
#   1. prefill: `tether serve --ctx 32768` runs one prompt of PREFILL_TOKENS tokens; the
#      peak during the prefill must stay within TOLERANCE_MIB of the level after Commit.
#   2. requests: `tether serve --ctx 8192 --parallel 4`, WARMUP requests, then REQUESTS of
#      random lengths, PARALLEL at a time: the peak must stay within TOLERANCE_MIB of the
#      level after the warm-up, and the worker's session bytes must not move.
# Each case also prints the process's device memory after Commit beyond its idle level next
# to `tether plan`. Prints one row per case; exits non-zero when a check fails.
#
#   scripts/gpu_steady.sh
#
# Environment: TETHER, TETHERCTL (default .gpu/bin/), DEVICE (cuda:0), MODEL (default: the
# llama3-8b q4_0 that gpu_bench.sh synthesizes), PREFILL_TOKENS (32000), REQUESTS (1000),
# PARALLEL (4), WARMUP (10), MAX_PROMPT (1024), MAX_GEN (32), TOLERANCE_MIB (16), OUT.
set -u

TETHER=${TETHER:-.gpu/bin/tether}
TETHERCTL=${TETHERCTL:-.gpu/bin/tetherctl}
DEVICE=${DEVICE:-cuda:0}
MODEL=${MODEL:-/tmp/tether-models/llama3-8b-q4_0.gguf}
PREFILL_TOKENS=${PREFILL_TOKENS:-32000}
REQUESTS=${REQUESTS:-1000}
PARALLEL=${PARALLEL:-4}
WARMUP=${WARMUP:-10}
MAX_PROMPT=${MAX_PROMPT:-1024}
MAX_GEN=${MAX_GEN:-32}
TOLERANCE_MIB=${TOLERANCE_MIB:-16}
WPORT=${WPORT:-50171}
HPORT=${HPORT:-18171}
LOGS=${OUT:-/tmp/tether-steady-logs}
LIB="$(dirname "$0")/lib"
mkdir -p "$LOGS"
# shellcheck source=scripts/lib/nvrtc.sh
. "$LIB/nvrtc.sh"
setup_nvrtc gpu_steady.sh

if [ ! -f "$MODEL" ]; then
    mkdir -p "$(dirname "$MODEL")"
    "$TETHER" gguf synth "$MODEL" --shape llama3-8b --type q4_0 >/dev/null || exit 2
fi
URL="http://127.0.0.1:$HPORT"
status() { "$TETHERCTL" --worker "127.0.0.1:$WPORT" status --json 2>/dev/null; }
field() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }
proc_bytes() { python3 "$LIB/gpu_mem.py" procs | awk -v p="$1" '$1 == p { print $2; f = 1 } END { if (!f) print 0 }'; }
mib() { python3 -c "print(f'{$1/2**20:.1f}')"; }
vocab=$("$TETHER" gguf inspect "$MODEL" --json | python3 -c "
import json, sys
t = [t for t in json.load(sys.stdin)['tensors'] if t['name'] == 'token_embd.weight']
print(t[0]['dims'][1])") || exit 2

"$TETHER" worker --device "$DEVICE" --listen "127.0.0.1:$WPORT" >"$LOGS/worker.log" 2>&1 &
worker=$!
serve=
trap 'kill $serve $worker 2>/dev/null; wait 2>/dev/null' EXIT
for _ in $(seq 600); do status >/dev/null && break; sleep 0.1; done
idle=$(proc_bytes $worker)
echo "worker pid $worker: $(mib "$idle") MiB of device memory idle; unaccounted counts $(status | field '["memory_source"]')"

start_serve() { # ctx parallel tag
    local flags=(--model "$MODEL" --worker "127.0.0.1:$WPORT" --ctx "$1" --parallel "$2")
    planned=$("$TETHER" plan "${flags[@]}" --json 2>"$LOGS/plan-$3.err" | field '["workers"][0]["total_bytes"]') || planned=0
    "$TETHER" serve "${flags[@]}" --listen "127.0.0.1:$HPORT" >"$LOGS/serve-$3.log" 2>&1 &
    serve=$!
    for _ in $(seq 1200); do
        python3 -c "import urllib.request as u; u.urlopen('$URL/health', timeout=1)" 2>/dev/null && return 0
        kill -0 $serve 2>/dev/null || break
        sleep 0.1
    done
    echo "serve ($3) did not become ready; see $LOGS/serve-$3.log"
    return 1
}
stop_serve() {
    kill -TERM $serve 2>/dev/null; wait $serve 2>/dev/null; serve=
    for _ in $(seq 100); do [ "$(status | field '["sessions"]')" = 0 ] && break; sleep 0.05; done
}
sampler_start() { python3 "$LIB/gpu_mem.py" sample "$worker" "$1" 10 & sampler=$!; sleep 0.2; }
sampler_stop() { kill -TERM $sampler; wait $sampler 2>/dev/null; }

failed=0
rows=()
row() { # case plan committed level peak extra verdict
    rows+=("$(printf '%-9s %9s %11s %9s %9s %8s  %s' "$1" "$(mib "$2")" "$(mib "$3")" "$(mib "$4")" "$(mib "$5")" "$(mib "$(($5 - $4))")" "$6")")
}

# 1. One long prefill.
if start_serve 32768 1 prefill; then
    sleep 0.5
    level=$(proc_bytes $worker)
    sampler_start "$LOGS/prefill.json"
    python3 "$LIB/load_client.py" "$URL" one "$PREFILL_TOKENS" 1 "$vocab" >"$LOGS/prefill-request.json"
    rc=$?
    sampler_stop
    read -r n peak gap <<<"$(python3 -c "import json; d=json.load(open('$LOGS/prefill.json')); print(d['n'], d['max'], d['max_gap_ms'])")"
    verdict=$(python3 - "$rc" "$level" "$peak" "$TOLERANCE_MIB" "$planned" "$((level - idle))" <<'PY'
import sys
rc, level, peak, tol, plan, committed = map(int, sys.argv[1:])
slack = max(plan // 100, 32 << 20)
ok = rc == 0 and peak - level <= tol << 20 and abs(committed - plan) <= slack
print(("ok" if ok else "FAIL") + f" (commit-plan {(committed - plan) / 2**20:+.1f} MiB, slack {slack >> 20} MiB)")
PY
)
    echo "prefill: $(cat "$LOGS/prefill-request.json"); $n samples, largest gap $gap ms"
    row "prefill32k" "$planned" "$((level - idle))" "$level" "$peak" "$verdict"
    case $verdict in ok*) ;; *) failed=1 ;; esac
    stop_serve
else
    failed=1
fi

# 2. Many requests of random lengths, PARALLEL at a time.
if start_serve 8192 "$PARALLEL" requests; then
    python3 "$LIB/load_client.py" "$URL" many "$WARMUP" "$PARALLEL" "$MAX_PROMPT" "$MAX_GEN" "$vocab" 1 >/dev/null
    sleep 0.5
    level=$(proc_bytes $worker)
    before=$(status | field '["session_bytes"]')
    sampler_start "$LOGS/requests.json"
    python3 "$LIB/load_client.py" "$URL" many "$REQUESTS" "$PARALLEL" "$MAX_PROMPT" "$MAX_GEN" "$vocab" 2 >"$LOGS/requests-client.json"
    rc=$?
    sampler_stop
    after=$(status | field '["session_bytes"]')
    peak=$(python3 -c "import json; print(json.load(open('$LOGS/requests.json'))['max'])")
    n=$(python3 -c "import json; print(json.load(open('$LOGS/requests.json'))['n'])")
    verdict=$(python3 - "$rc" "$level" "$peak" "$TOLERANCE_MIB" "$before" "$after" <<'PY'
import sys
rc, level, peak, tol, before, after = map(int, sys.argv[1:])
ok = rc == 0 and peak - level <= tol << 20 and before == after
print(("ok" if ok else "FAIL") + f" (session bytes {before} -> {after})")
PY
)
    echo "requests: $(cat "$LOGS/requests-client.json"); $n samples"
    row "requests" "$planned" "$((level - idle))" "$level" "$peak" "$verdict"
    case $verdict in ok*) ;; *) failed=1 ;; esac
    stop_serve
else
    failed=1
fi

echo
printf '%-9s %9s %11s %9s %9s %8s  %s\n' case plan_MiB commit_MiB level_MiB peak_MiB peak-lvl verdict
printf '%s\n' "${rows[@]}"
exit $failed
