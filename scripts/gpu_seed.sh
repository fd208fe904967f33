#!/usr/bin/env bash
# The restart scenario users hit, on GPU workers: `tether serve` over two workers holds a
# model (default: a qwen2.5-14b-shaped F16 file, 29.5 GB, both workers on DEVICE0/DEVICE1),
# a client streams a completion, serve is SIGKILLed mid-stream and started again, STOPS
# times. Each round checks that both workers are back at their baseline (no session, device
# memory within TOLERANCE_MIB) within RELEASE_LIMIT_MS of the SIGKILL, and that the reload
# succeeds and answers. Prints a table; exits non-zero when any round failed.
#
#   scripts/gpu_seed.sh
#
# Environment: TETHER, TETHERCTL (default .gpu/bin/), MODEL (default: synthesized under
# MODELS=/tmp/tether-models), SHAPE (qwen2.5-14b), TYPE (f16), STOPS (20), CTX (4096),
# DEVICE0/DEVICE1 (cuda:0 / cuda:0; cuda:1 on a two-GPU machine), TOLERANCE_MIB (16),
# RELEASE_LIMIT_MS (1000), LOAD_LIMIT_S (300), DEADLINE_S (start no round after this many
# seconds), OUT (logs).
set -u

TETHER=${TETHER:-.gpu/bin/tether}
TETHERCTL=${TETHERCTL:-.gpu/bin/tetherctl}
MODELS=${MODELS:-/tmp/tether-models}
SHAPE=${SHAPE:-qwen2.5-14b}
TYPE=${TYPE:-f16}
MODEL=${MODEL:-$MODELS/$SHAPE-$TYPE.gguf}
STOPS=${STOPS:-20}
CTX=${CTX:-4096}
DEVICE0=${DEVICE0:-cuda:0}
DEVICE1=${DEVICE1:-cuda:0}
TOLERANCE_MIB=${TOLERANCE_MIB:-16}
RELEASE_LIMIT_MS=${RELEASE_LIMIT_MS:-1000}
LOAD_LIMIT_S=${LOAD_LIMIT_S:-300}
DEADLINE_S=${DEADLINE_S:-}
WPORT=${WPORT:-50281}
HPORT=${HPORT:-18281}
LOGS=${OUT:-/tmp/tether-seed-logs}
LIB="$(dirname "$0")/lib"
URL="http://127.0.0.1:$HPORT"
mkdir -p "$LOGS" "$MODELS"
if [ "${DEVICE0%%:*}" = cuda ]; then
    # shellcheck source=scripts/lib/nvrtc.sh
    . "$LIB/nvrtc.sh"
    setup_nvrtc gpu_seed.sh
fi

now_ns() { date +%s%N; }
ms_since() { echo $((($(now_ns) - $1) / 1000000)); }
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
healthy() { python3 -c "import urllib.request as u; u.urlopen('$URL/health', timeout=1)" 2>/dev/null; }

PIDS=()
SERVE_PID=
cleanup() {
    alive "$SERVE_PID" && kill -KILL "$SERVE_PID"
    for pid in "${PIDS[@]}"; do alive "$pid" && kill -TERM "$pid"; done
    wait 2>/dev/null
}
trap cleanup EXIT

if [ ! -f "$MODEL" ]; then
    t0=$(now_ns)
    "$TETHER" gguf synth "$MODEL" --shape "$SHAPE" --type "$TYPE" >"$LOGS/synth.log" 2>&1 ||
        { echo "gpu_seed.sh: synth failed (see $LOGS/synth.log)" >&2; exit 1; }
    echo "synthesized $MODEL in $(ms_since "$t0") ms"
fi
vocab=$("$TETHER" gguf inspect "$MODEL" --json | python3 -c "
import json, sys
t = [t for t in json.load(sys.stdin)['tensors'] if t['name'] == 'token_embd.weight']
print(t[0]['dims'][1])")
vocab=${vocab:-32000}

devices=("$DEVICE0" "$DEVICE1")
for i in 0 1; do
    "$TETHER" worker --listen "127.0.0.1:$((WPORT + i))" --device "${devices[i]}" \
        --model-dir "$(dirname "$MODEL")" --prepare-timeout 300s >"$LOGS/worker$i.log" 2>&1 &
    PIDS+=($!)
done
for i in 0 1; do
    for _ in $(seq 600); do
        "$TETHERCTL" --worker "127.0.0.1:$((WPORT + i))" status --json >/dev/null 2>&1 && break
        sleep 0.1
    done
done
mapfile -t baselines < <(TETHERCTL=$TETHERCTL python3 "$LIB/worker_release.py" used \
    "${DEVICE0%%:*}" "127.0.0.1:$WPORT" "127.0.0.1:$((WPORT + 1))")
if [ "${#baselines[@]}" -ne 2 ] || [[ "${baselines[*]}" == *" -"* ]]; then
    echo "gpu_seed.sh: a worker did not answer: ${baselines[*]}" >&2
    exit 1
fi
args=()
for line in "${baselines[@]}"; do args+=("${line% *}=${line#* }"); done

# A streaming completion that prints "streaming" once its first token arrived, then reads on
# until the server goes away.
stream_client() {
    python3 - "$URL" "$vocab" <<'PY'
import json, random, sys, urllib.request
url, vocab = sys.argv[1], int(sys.argv[2])
prompt = [random.randrange(16, vocab) for _ in range(64)]
body = json.dumps({"prompt": prompt, "max_tokens": 4000, "temperature": 0,
                   "stream": True, "ignore_eos": True}).encode()
req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=600) as r:
        told = False
        for line in r:
            if not told and line.startswith(b"data:"):
                print("streaming", flush=True)
                told = True
except Exception as e:
    print(f"ended: {type(e).__name__}", flush=True)
PY
}

rows=()
failed=0
loads=()
releases=()
for ((round = 1; round <= STOPS; round++)); do
    if [ -n "$DEADLINE_S" ] && ((SECONDS > DEADLINE_S)); then
        rows+=("$(printf '%-6s %s' "$round" "not run: DEADLINE_S reached")")
        break
    fi
    t0=$(now_ns)
    "$TETHER" serve --model "$MODEL" --model-path-on-workers "$(basename "$MODEL")" \
        --worker "127.0.0.1:$WPORT" --worker "127.0.0.1:$((WPORT + 1))" --ctx "$CTX" \
        --parallel 4 --listen "127.0.0.1:$HPORT" >"$LOGS/serve$round.log" 2>&1 &
    SERVE_PID=$!
    load_ms=
    for _ in $(seq $((LOAD_LIMIT_S * 20))); do
        healthy && { load_ms=$(ms_since "$t0"); break; }
        alive "$SERVE_PID" || break
        sleep 0.05
    done
    if [ -z "$load_ms" ]; then
        rows+=("$(printf '%-6s %-10s %s' "$round" FAIL "serve did not load (log $LOGS/serve$round.log)")")
        failed=1
        kill -KILL "$SERVE_PID" 2>/dev/null
        wait "$SERVE_PID" 2>/dev/null
        SERVE_PID=
        continue
    fi
    loads+=("$load_ms")
    stream_client >"$LOGS/client$round.txt" 2>&1 &
    client=$!
    for _ in $(seq 600); do grep -q streaming "$LOGS/client$round.txt" && break; sleep 0.05; done
    if ! grep -q streaming "$LOGS/client$round.txt"; then
        rows+=("$(printf '%-6s %-10s %s' "$round" FAIL "no token streamed: $(head -c 200 "$LOGS/client$round.txt")")")
        failed=1
    fi
    sleep 0.3
    kill -KILL "$SERVE_PID"
    t0=$(now_ns)
    wait "$SERVE_PID" 2>/dev/null
    SERVE_PID=
    verdicts=()
    worst=0
    while read -r addr verdict ms kib why; do
        ((ms > worst)) && worst=$ms
        if [ "$verdict" != ok ] || ((ms > RELEASE_LIMIT_MS)); then
            failed=1
            verdicts+=("$addr FAIL ${ms} ms ${kib} KiB $why")
        else
            verdicts+=("${ms} ms/${kib} KiB")
        fi
    done < <(TETHERCTL=$TETHERCTL python3 "$LIB/worker_release.py" wait \
        "${DEVICE0%%:*}" "$t0" 5000 "$TOLERANCE_MIB" "${args[@]}")
    releases+=("$worst")
    wait "$client" 2>/dev/null
    rows+=("$(printf '%-6s %-10s %-14s %s' "$round" "${load_ms} ms" "$(tail -1 "$LOGS/client$round.txt")" "${verdicts[*]}")")
done

echo
echo "== gpu_seed: $(basename "$MODEL") over two workers ($DEVICE0, $DEVICE1), serve SIGKILLed mid-stream =="
printf '%-6s %-10s %-14s %s\n' round load client "release after SIGKILL (per worker: ms / residual)"
printf '%s\n' "${rows[@]}"
if ((${#loads[@]})); then
    printf 'loads: %s rounds, min %s ms, max %s ms; release: max %s ms\n' "${#loads[@]}" \
        "$(printf '%s\n' "${loads[@]}" | sort -n | head -1)" \
        "$(printf '%s\n' "${loads[@]}" | sort -n | tail -1)" \
        "$(printf '%s\n' "${releases[@]}" | sort -n | tail -1)"
fi
((failed == 0)) && echo "all rounds ok" || echo "SOME ROUNDS FAILED"
exit "$failed"
