#!/usr/bin/env bash
# The memory plan against what a GPU worker really holds: for each context size and KV
# cache type, `tether plan --json` is compared with the worker's session bytes and with the
# device memory the driver reports in use beyond the worker's idle baseline, while
# `tether serve` holds the model loaded. Prints one row per case; exits non-zero when the
# session bytes differ from the plan or the driver's figure is off by more than 1% or
# 32 MiB (whichever is larger).
#
#   scripts/gpu_plan.sh                    # llama3-8b q4_0, ctx 8192 and 32768, f16 and q8_0
#
# Environment: TETHER, TETHERCTL (default .gpu/bin/), DEVICE (cuda:0), MODEL (default: the
# llama3-8b q4_0 synthesized by gpu_bench.sh), CTXS ("8192 32768"), CACHES ("f16 q8_0").
set -u

TETHER=${TETHER:-.gpu/bin/tether}
TETHERCTL=${TETHERCTL:-.gpu/bin/tetherctl}
DEVICE=${DEVICE:-cuda:0}
MODEL=${MODEL:-/tmp/tether-models/llama3-8b-q4_0.gguf}
CTXS=${CTXS:-8192 32768}
CACHES=${CACHES:-f16 q8_0}
WPORT=${WPORT:-50161}
HPORT=${HPORT:-18161}
LOGS=${OUT:-/tmp/tether-plan-logs}
mkdir -p "$LOGS"
# shellcheck source=scripts/lib/nvrtc.sh
. "$(dirname "$0")/lib/nvrtc.sh"
setup_nvrtc gpu_plan.sh

if [ ! -f "$MODEL" ]; then
    mkdir -p "$(dirname "$MODEL")"
    "$TETHER" gguf synth "$MODEL" --shape llama3-8b --type q4_0 >/dev/null || exit 2
fi

status() { "$TETHERCTL" --worker "127.0.0.1:$WPORT" status --json 2>/dev/null; }
field() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }

"$TETHER" worker --device "$DEVICE" --listen "127.0.0.1:$WPORT" >"$LOGS/worker.log" 2>&1 &
worker=$!
trap 'kill $worker 2>/dev/null; wait 2>/dev/null' EXIT
for _ in $(seq 600); do status >/dev/null && break; sleep 0.1; done

failed=0
printf '%-6s %-5s %12s %12s %12s %9s %s\n' ctx cache plan_MiB session_MiB driver_MiB drv-plan verdict
for ctx in $CTXS; do
    for cache in $CACHES; do
        flags=(--model "$MODEL" --worker "127.0.0.1:$WPORT" --ctx "$ctx" --parallel 1
            --cache-type-k "$cache" --cache-type-v "$cache")
        plan=$("$TETHER" plan "${flags[@]}" --json 2>"$LOGS/plan-$ctx-$cache.err") || {
            echo "$ctx $cache: plan failed (see $LOGS)"; failed=1; continue; }
        planned=$(echo "$plan" | field '["workers"][0]["total_bytes"]')
        "$TETHER" serve "${flags[@]}" --listen "127.0.0.1:$HPORT" >"$LOGS/serve-$ctx-$cache.log" 2>&1 &
        serve=$!
        ready=
        for _ in $(seq 1200); do
            if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$HPORT/health', timeout=1)" 2>/dev/null; then
                ready=1; break
            fi
            kill -0 $serve 2>/dev/null || break
            sleep 0.1
        done
        if [ -z "$ready" ]; then
            echo "$ctx $cache: serve did not become ready (see $LOGS/serve-$ctx-$cache.log)"
            failed=1; kill $serve 2>/dev/null; wait $serve 2>/dev/null; continue
        fi
        st=$(status)
        read -r session used <<<"$(echo "$st" | python3 -c "import json,sys; s=json.load(sys.stdin); print(s['session_bytes'], s['device_total_bytes']-s['device_free_bytes']-s['baseline_used_bytes'])")"
        verdict=$(python3 - "$planned" "$session" "$used" <<'PY'
import sys
plan, session, used = map(int, sys.argv[1:])
slack = max(plan // 100, 32 << 20)
ok = session == plan and abs(used - plan) <= slack
print(("ok" if ok else "FAIL") + f" (slack {slack / 2**20:.0f} MiB)")
PY
)
        mib() { python3 -c "print(f'{$1/2**20:.1f}')"; }
        printf '%-6s %-5s %12s %12s %12s %9s %s\n' "$ctx" "$cache" "$(mib "$planned")" \
            "$(mib "$session")" "$(mib "$used")" "$(mib "$((used - planned))")" "$verdict"
        case $verdict in ok*) ;; *) failed=1 ;; esac
        kill -TERM $serve; wait $serve 2>/dev/null
        for _ in $(seq 100); do
            [ "$(status | field '["sessions"]')" = 0 ] && break
            sleep 0.05
        done
    done
done
exit $failed
