#!/usr/bin/env bash
# Two GPUs of one host, in one run (each step goes on when one before it failed):
#   1. synth: llama3-8b q4_0 and q4_k_m (q4_k when this tether has no q4_k_m mix) and a
#      llama3-70b q4_k_m (~42 GB, written in the background while steps 2-3 run) under
#      MODELS; existing files are kept.
#   2. bench: `tether bench --device cuda --pipeline 1,2` on both 8B files (one worker on
#      GPU 0 against one worker per GPU): decode t/s with two >= 0.97x of one, prompt t/s
#      >= 1.5x; then with `--parallel BENCH_SEQS` (many sequences at once): the aggregate
#      decode ratio, shown, not judged.
#   3. serve: `tether worker` processes on cuda:0 and cuda:1 behind `tether serve`, CLIENTS
#      streaming clients (`tether bench --url`: REQUESTS in all, PROMPT_TOKENS random prompt
#      tokens and GEN_TOKENS generated each, greedy, end of text ignored) after a warm-up;
#      aggregate generated t/s through both workers (--parallel PARALLEL_TWO and
#      CLIENTS_TWO clients: each GPU holds half the weights, so twice the KV room) against
#      the worker on cuda:0 alone (--parallel PARALLEL): two >= 1.8x of one.
#   4. big: the 70B file over both workers; serve loads it, one completion succeeds, serve
#      is SIGKILLed, and each worker must hold no session and be back at its device
#      memory from before the load (TOLERANCE_MIB) within 1 s.
# Prints one table at the end; exits non-zero when a check failed.
#
#   DEADLINE_S=420 LOAD_LIMIT_S=150 scripts/gpu_two.sh   # two GPUs, binaries in .gpu/
#   DEVICES=cpu TETHER=target/release/tether TETHERCTL=target/release/tetherctl \
#     scripts/gpu_two.sh                                    # dry run: cpu workers, tiny models
#
# Environment: TETHER, TETHERCTL (default .gpu/tether, .gpu/tetherctl, else .gpu/bin/),
# DEVICES (cuda; cpu: cpu workers, `tiny`-shaped models, small counts, STEPS without big,
# speed ratios printed but not judged), STEPS (which of "bench serve big" run; synth always
# does, the 70B file only with big), BIG_SYNTH (background: the 70B file is written while
# steps 2-3 run, and their rows say when it was; first: before them), MODELS (/tmp/tether-models), REPS (bench -r, 3),
# BENCH_P (512), BENCH_N (128), BENCH_SEQS (64), CLIENTS (64), CLIENTS_TWO (CLIENTS: clients
# of the serve over two workers, to fill the twice larger KV room), REQUESTS (256), PARALLEL
# (64, serve over one worker), PARALLEL_TWO (2 x PARALLEL, over two), CTX (512),
# PROMPT_TOKENS (128), GEN_TOKENS (128), SERVE_WORKERS ("1 2": which serve runs),
# SERVE_FLAGS_TWO (more `serve` flags for the run over two, e.g. "--pipeline-lanes 3"),
# BIG_CTX (2048), LOAD_LIMIT_S (300: longest wait
# for a serve to load), TOLERANCE_MIB (16), WPORT (50191, and the next), HPORT (18191),
# OUT (logs; /tmp/tether-two-logs), DEADLINE_S (start no step after this many seconds and
# print the table of what ran: for machines that end commands at a limit).
# Needs bash, coreutils, awk and python3 (stdlib only).
set -u

if [ -z "${TETHER:-}" ]; then
    TETHER=.gpu/tether
    [ -x "$TETHER" ] || TETHER=.gpu/bin/tether
fi
if [ -z "${TETHERCTL:-}" ]; then
    TETHERCTL=.gpu/tetherctl
    [ -x "$TETHERCTL" ] || TETHERCTL=.gpu/bin/tetherctl
fi
DEVICES=${DEVICES:-cuda}
MODELS=${MODELS:-/tmp/tether-models}
if [ "$DEVICES" = cpu ]; then
    WORKER_DEVICES=(cpu cpu) BENCH_DEVICE=cpu JUDGE_SPEED=0
    : "${SMALL_SHAPE:=tiny}" "${BIG_SHAPE:=tiny-qwen2}"
    : "${REPS:=1}" "${BENCH_P:=64}" "${BENCH_N:=16}" "${CLIENTS:=4}" "${REQUESTS:=8}"
    : "${BENCH_SEQS:=4}"
    : "${PARALLEL:=4}" "${CTX:=64}" "${PROMPT_TOKENS:=16}" "${GEN_TOKENS:=16}"
    : "${STEPS:=bench serve}"
    : "${BIG_CTX:=64}"
else
    WORKER_DEVICES=(cuda:0 cuda:1) BENCH_DEVICE=cuda JUDGE_SPEED=1
    : "${SMALL_SHAPE:=llama3-8b}" "${BIG_SHAPE:=llama3-70b}"
fi
REPS=${REPS:-3}
BENCH_P=${BENCH_P:-512}
BENCH_N=${BENCH_N:-128}
CLIENTS=${CLIENTS:-64}
REQUESTS=${REQUESTS:-256}
PARALLEL=${PARALLEL:-64}
PARALLEL_TWO=${PARALLEL_TWO:-$((2 * PARALLEL))}
CLIENTS_TWO=${CLIENTS_TWO:-$CLIENTS}
BENCH_SEQS=${BENCH_SEQS:-64}
CTX=${CTX:-512}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
GEN_TOKENS=${GEN_TOKENS:-128}
STEPS=${STEPS:-bench serve big}
SERVE_WORKERS=${SERVE_WORKERS:-1 2}
SERVE_FLAGS_TWO=${SERVE_FLAGS_TWO:-}
BIG_SYNTH=${BIG_SYNTH:-background}
BIG_CTX=${BIG_CTX:-2048}
LOAD_LIMIT_S=${LOAD_LIMIT_S:-300}
TOLERANCE_MIB=${TOLERANCE_MIB:-16}
WPORT=${WPORT:-50191}
HPORT=${HPORT:-18191}
LOGS=${OUT:-/tmp/tether-two-logs}
DEADLINE_S=${DEADLINE_S:-}
LIB="$(dirname "$0")/lib"

# The criteria.
DECODE_MIN=0.97
PROMPT_MIN=1.5
SERVE_MIN=1.8
RELEASE_LIMIT_MS=1000
# serve's default lease is 10 s; past it plus a second the release has failed outright.
RELEASE_POLL_MS=11000
TERM_LIMIT_S=20

URL="http://127.0.0.1:$HPORT"
WORKER_PIDS=()
SERVE_PID=
BIG_SYNTH_PID=
ROWS=()
FAILURES=()

now_ns() { date +%s%N; }
ms_since() { echo $((($(now_ns) - $1) / 1000000)); }
want() { [[ " $STEPS " == *" $1 "* ]]; }
out_of_time() { [ -n "$DEADLINE_S" ] && ((SECONDS >= DEADLINE_S)); }
worker_addr() { echo "127.0.0.1:$((WPORT + $1))"; }
healthy() { python3 -c "import urllib.request as u; u.urlopen('$URL/health', timeout=1)" 2>/dev/null; }
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
# `a / b` with three decimals, and whether `a >= b`, without floating-point shell tools.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "0" }'; }
at_least() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a >= b) }'; }

row() { # STEP CHECK VALUE VERDICT
    ROWS+=("$(printf '%-13s %-28s %-58s %s' "$1" "$2" "$3" "$4")")
    case $4 in FAIL*) FAILURES+=("$1: $2: $3") ;; esac
    echo "-> $1 | $2 | $3 | $4"
}

# ok/FAIL for a speed criterion; on the cpu the ratios are shown, not judged.
judge() { # VALUE MINIMUM
    if ((JUDGE_SPEED == 0)); then
        echo "info (cpu: not judged)"
    elif at_least "$1" "$2"; then
        echo ok
    else
        echo FAIL
    fi
}

cleanup() {
    local pid
    # A synth still running runs in a subshell, its tether that subshell's child; what it
    # (or one a signal ended) leaves is a partial file of this run.
    if [ -n "$BIG_SYNTH_PID" ]; then
        pkill -P "$BIG_SYNTH_PID" 2>/dev/null
        kill "$BIG_SYNTH_PID" 2>/dev/null
        wait "$BIG_SYNTH_PID" 2>/dev/null
    fi
    rm -f "${FILE_Q4_0:-}".partial-* "${FILE_MIX:-}".partial-* "${FILE_BIG:-}".partial-*
    alive "$SERVE_PID" && kill -KILL "$SERVE_PID"
    for pid in "${WORKER_PIDS[@]}"; do alive "$pid" && kill -TERM "$pid"; done
    wait 2>/dev/null
}
trap cleanup EXIT

# ---------------------------------------------------------------------------------------
# 1. Model files.

# Writes FILE through a temporary name, so that a run cut short leaves no half file that
# the next run would take as done.
synth() { # FILE SHAPE TYPE
    local t0 partial="$1.partial-$BASHPID"
    [ -f "$1" ] && return 0
    t0=$(now_ns)
    if "$TETHER" gguf synth "$partial" --shape "$2" --type "$3" >"$LOGS/synth-$(basename "$1").log" 2>&1 &&
        mv "$partial" "$1"; then
        echo "synthesized $1 ($(($(stat -c %s "$1") >> 20)) MiB) in $(ms_since "$t0") ms"
    else
        echo "synth of $1 failed; see $LOGS/synth-$(basename "$1").log" >&2
        return 1
    fi
}

# Marks a measurement taken while the big model was still being written (BIG_SYNTH=first
# avoids that, at the cost of waiting for it before anything else).
synth_note() { alive "$BIG_SYNTH_PID" && echo " [big synth running]"; }

vocab_of() { # FILE
    "$TETHER" gguf inspect "$1" --json | python3 -c "
import json, sys
t = [t for t in json.load(sys.stdin)['tensors'] if t['name'] == 'token_embd.weight']
print(t[0]['dims'][1])"
}

step_synth() {
    local pids=() ok=1 note=
    MIX=q4_k_m
    if ! "$TETHER" gguf synth --help 2>/dev/null | grep -q q4_k_m; then
        MIX=q4_k
        note=" (no q4_k_m in this tether: q4_k instead)"
        echo "gpu_two.sh: this tether has no --type q4_k_m; using q4_k" >&2
    fi
    FILE_Q4_0=$MODELS/$SMALL_SHAPE-q4_0.gguf
    FILE_MIX=$MODELS/$SMALL_SHAPE-$MIX.gguf
    FILE_BIG=$MODELS/$BIG_SHAPE-$MIX.gguf
    if want big && [ ! -f "$FILE_BIG" ]; then
        synth "$FILE_BIG" "$BIG_SHAPE" "$MIX" &
        BIG_SYNTH_PID=$!
        if [ "$BIG_SYNTH" = first ]; then
            pids+=("$BIG_SYNTH_PID")
            BIG_SYNTH_PID=
        fi
    fi
    synth "$FILE_Q4_0" "$SMALL_SHAPE" q4_0 &
    pids+=($!)
    synth "$FILE_MIX" "$SMALL_SHAPE" "$MIX" &
    pids+=($!)
    for pid in "${pids[@]}"; do wait "$pid" || ok=0; done
    if ((ok)); then
        row synth "$SMALL_SHAPE q4_0, $MIX" "ready$note" ok
    else
        row synth "$SMALL_SHAPE q4_0, $MIX" "synth failed (logs in $LOGS)" FAIL
    fi
}

# ---------------------------------------------------------------------------------------
# 2. `tether bench --pipeline 1,2`.

# Field COLUMN (3: t/s, 5: ratio) of the row of TEST with WORKERS workers in bench's table
# (`| tg128 | 2 | 380.12 | 1.20 | 0.951 | ... |`).
bench_cell() { # LOG TEST WORKERS COLUMN
    awk -F'|' -v t="$2" -v w="$3" -v c="$4" '
        { for (i = 2; i <= NF; i++) gsub(/^ +| +$/, "", $i) }
        $2 == t && $3 == w { print $(c + 1); exit }' "$1"
}

step_bench() { # FILE TAG
    local file=$1 tag=$2 log="$LOGS/bench-$2.log" rc pp tg busy
    busy=$(synth_note)
    if [ ! -f "$file" ]; then
        row "bench $tag" "pipeline 1,2" "no model file" FAIL
        return
    fi
    echo "== bench $tag: $TETHER bench --model $file --device $BENCH_DEVICE --pipeline 1,2 -p $BENCH_P -n $BENCH_N -r $REPS"
    "$TETHER" bench --model "$file" --device "$BENCH_DEVICE" --pipeline 1,2 \
        -p "$BENCH_P" -n "$BENCH_N" -r "$REPS" >"$log" 2>"$LOGS/bench-$tag.err"
    rc=$?
    cat "$log"
    tg=$(bench_cell "$log" "tg$BENCH_N" 2 5)
    pp=$(bench_cell "$log" "pp$BENCH_P" 2 5)
    if ((rc != 0)) || [ -z "$tg" ] || [ -z "$pp" ]; then
        row "bench $tag" "pipeline 1,2" "bench exited $rc: $(tail -n 1 "$LOGS/bench-$tag.err")" FAIL
        return
    fi
    row "bench $tag" "tg$BENCH_N 2w/1w >= $DECODE_MIN" \
        "$tg ($(bench_cell "$log" "tg$BENCH_N" 1 3) -> $(bench_cell "$log" "tg$BENCH_N" 2 3) t/s)$busy" \
        "$(judge "$tg" "$DECODE_MIN")"
    row "bench $tag" "pp$BENCH_P 2w/1w >= $PROMPT_MIN" \
        "$pp ($(bench_cell "$log" "pp$BENCH_P" 1 3) -> $(bench_cell "$log" "pp$BENCH_P" 2 3) t/s)$busy" \
        "$(judge "$pp" "$PROMPT_MIN")"
    if out_of_time; then return; fi
    # Many sequences at once: lanes keep both workers busy.
    log="$LOGS/bench-$tag-seqs.log"
    echo "== bench $tag, $BENCH_SEQS sequences: --pipeline 1,2 --parallel $BENCH_SEQS"
    "$TETHER" bench --model "$file" --device "$BENCH_DEVICE" --pipeline 1,2 \
        --parallel "$BENCH_SEQS" -p "$BENCH_P" -n "$BENCH_N" -r "$REPS" \
        >"$log" 2>"$LOGS/bench-$tag-seqs.err"
    rc=$?
    cat "$log"
    tg=$(bench_cell "$log" "tg$BENCH_N" 2 5)
    if ((rc != 0)) || [ -z "$tg" ]; then
        row "bench $tag" "$BENCH_SEQS seqs" "bench exited $rc: $(tail -n 1 "$LOGS/bench-$tag-seqs.err")" FAIL
        return
    fi
    row "bench $tag" "tg$BENCH_N x$BENCH_SEQS 2w/1w" \
        "$tg ($(bench_cell "$log" "tg$BENCH_N" 1 3) -> $(bench_cell "$log" "tg$BENCH_N" 2 3) t/s)" info
}

# ---------------------------------------------------------------------------------------
# Workers and serve.

# Starts each worker that is not running and waits for its status. Returns non-zero when one
# does not answer within two minutes.
start_workers() {
    local i ok=0
    for i in 0 1; do
        alive "${WORKER_PIDS[i]:-}" && continue
        "$TETHER" worker --listen "$(worker_addr $i)" --device "${WORKER_DEVICES[i]}" \
            --model-dir "$MODELS" --prepare-timeout 300s >>"$LOGS/worker$i.log" 2>&1 &
        WORKER_PIDS[i]=$!
    done
    for i in 0 1; do
        for _ in $(seq 1200); do
            "$TETHERCTL" --worker "$(worker_addr $i)" status --json >/dev/null 2>&1 && break
            alive "${WORKER_PIDS[i]}" || break
            sleep 0.1
        done
        "$TETHERCTL" --worker "$(worker_addr $i)" status --json >/dev/null 2>&1 ||
            { echo "worker $i did not come up; see $LOGS/worker$i.log" >&2; ok=1; }
    done
    return $ok
}

# Starts serve over the first N workers and waits for /health; sets SERVE_PID and
# LOAD_MS. Returns non-zero when serve exits or is not ready within LOAD_LIMIT_S.
start_serve() { # MODEL N_WORKERS PARALLEL CTX TAG
    local flags=(--model "$1" --model-path-on-workers "$(basename "$1")" --parallel "$3"
        --ctx "$4" --queue "$((CLIENTS > CLIENTS_TWO ? CLIENTS : CLIENTS_TWO))" --listen "127.0.0.1:$HPORT") i t0
    for ((i = 0; i < $2; i++)); do flags+=(--worker "$(worker_addr $i)"); done
    # shellcheck disable=SC2206 # word-split on purpose: several flags in one variable
    (($2 > 1)) && [ "$5" != serve-big ] && flags+=($SERVE_FLAGS_TWO)
    t0=$(now_ns)
    echo "$TETHER serve ${flags[*]}" >"$LOGS/$5.log"
    "$TETHER" serve "${flags[@]}" >>"$LOGS/$5.log" 2>&1 &
    SERVE_PID=$!
    for _ in $(seq $((LOAD_LIMIT_S * 10))); do
        healthy && { LOAD_MS=$(ms_since "$t0"); return 0; }
        alive "$SERVE_PID" || break
        sleep 0.1
    done
    echo "serve did not become ready; see $LOGS/$5.log" >&2
    stop_serve
    return 1
}

# SIGTERM, and SIGKILL when serve is still there TERM_LIMIT_S later. (Polled rather than a
# background watchdog, whose orphaned sleep would hold this script's stdout open.)
stop_serve() {
    alive "$SERVE_PID" || { SERVE_PID=; return; }
    kill -TERM "$SERVE_PID"
    for _ in $(seq $((TERM_LIMIT_S * 10))); do alive "$SERVE_PID" || break; sleep 0.1; done
    alive "$SERVE_PID" && kill -KILL "$SERVE_PID"
    wait "$SERVE_PID" 2>/dev/null
    SERVE_PID=
}

# ---------------------------------------------------------------------------------------
# 3. Aggregate generated tokens/s through one and two workers.

# Runs the fixed-length load against serve over N workers; sets GEN_TPS (empty on failure).
serve_load() { # N_WORKERS
    local n=$1 tag="serve-${1}w" summary parallel=$PARALLEL clients=$CLIENTS
    ((n > 1)) && parallel=$PARALLEL_TWO clients=$CLIENTS_TWO
    GEN_TPS=''
    BUSY=$(synth_note)
    if ! start_serve "$FILE_Q4_0" "$n" "$parallel" "$CTX" "$tag"; then
        SERVE_ERR="serve did not load (log $LOGS/$tag.log)"
        return 1
    fi
    echo "== $tag: loaded in $LOAD_MS ms; warm-up, then $REQUESTS requests from $clients clients"
    # The warm-up runs every batch size the measured part will.
    python3 "$LIB/load_client.py" "$URL" fixed "$clients" "$clients" "$PROMPT_TOKENS" 8 \
        "$VOCAB" 1 >"$LOGS/$tag-warmup.json"
    # The measured part streams, through tether's own client (`bench --url`), as the
    # one-GPU serve figures do.
    "$TETHER" bench --url "$URL" --clients "$clients" \
        --requests-per-client $(((REQUESTS + clients - 1) / clients)) \
        -p "$PROMPT_TOKENS" -n "$GEN_TOKENS" >"$LOGS/$tag.txt" 2>&1
    local rc=$?
    stop_serve
    summary=$(grep -E '^\| completions ' "$LOGS/$tag.txt")
    echo "$tag: $summary"
    if ((rc != 0)); then
        SERVE_ERR="bench --url exited $rc: $(tail -n 1 "$LOGS/$tag.txt" | cut -c1-160)"
        return 1
    fi
    # | completions | requests | errors | prompt tok | gen tok | wall s | gen t/s | ...
    GEN_TPS=$(awk -F'|' '{gsub(/ /, "", $8); print $8}' <<<"$summary")
    SHORT=0
}

step_serve() {
    local one two
    if [ ! -f "$FILE_Q4_0" ] || ! VOCAB=$(vocab_of "$FILE_Q4_0"); then
        row serve "2w/1w gen t/s >= $SERVE_MIN" "no model file" FAIL
        return
    fi
    if ! start_workers; then
        row serve "workers up" "a worker did not start (logs in $LOGS)" FAIL
        return
    fi
    local n tps=()
    echo "serve: ${CLIENTS} clients (one worker) / ${CLIENTS_TWO} (two) x (${PROMPT_TOKENS}+${GEN_TOKENS}) tokens, --parallel $PARALLEL / $PARALLEL_TWO --ctx $CTX"
    for n in $SERVE_WORKERS; do
        if out_of_time; then
            row "serve ${n}w" "gen t/s" "skipped: DEADLINE_S" skipped
            return
        fi
        if serve_load "$n"; then
            tps[n]=$GEN_TPS
            row "serve ${n}w" "gen t/s, $( ((n > 1)) && echo "$CLIENTS_TWO" || echo "$CLIENTS") clients" \
                "$GEN_TPS t/s (${SHORT} of $REQUESTS short)$BUSY" info
        else
            row "serve ${n}w" "gen t/s, ${CLIENTS} clients" "$SERVE_ERR" FAIL
        fi
    done
    one=${tps[1]:-} two=${tps[2]:-}
    [ -n "$one" ] && [ -n "$two" ] &&
        row serve "2w/1w gen t/s >= $SERVE_MIN" "$(ratio "$two" "$one") ($one -> $two t/s)" \
            "$(judge "$(ratio "$two" "$one")" "$SERVE_MIN")"
}

# ---------------------------------------------------------------------------------------
# 4. The big model over both workers; release after serve is SIGKILLed.

step_big() {
    local t0 line addr verdict ms kib why i baselines=() args=()
    if alive "$BIG_SYNTH_PID"; then
        echo "== big: waiting for the synth of $FILE_BIG"
        t0=$(now_ns)
        while alive "$BIG_SYNTH_PID"; do
            if out_of_time; then
                row big "release after SIGKILL" "skipped: synth unfinished at DEADLINE_S" skipped
                return
            fi
            sleep 1
        done
        wait "$BIG_SYNTH_PID"
        echo "waited $(ms_since "$t0") ms for it"
    fi
    BIG_SYNTH_PID=
    if [ ! -f "$FILE_BIG" ] || ! VOCAB=$(vocab_of "$FILE_BIG"); then
        row big "load" "no model file (synth log in $LOGS)" FAIL
        return
    fi
    if ! start_workers; then
        row big "workers up" "a worker did not start (logs in $LOGS)" FAIL
        return
    fi
    "$TETHER" plan --model "$FILE_BIG" --worker "$(worker_addr 0)" --worker "$(worker_addr 1)" \
        --ctx "$BIG_CTX" --parallel 1 2>&1 | tee "$LOGS/big-plan.txt"
    mapfile -t baselines < <(TETHERCTL=$TETHERCTL python3 "$LIB/worker_release.py" used \
        "${WORKER_DEVICES[0]%%:*}" "$(worker_addr 0)" "$(worker_addr 1)")
    echo "baselines (address, used bytes): ${baselines[*]}"
    if [ "${#baselines[@]}" -ne 2 ] || [[ "${baselines[*]}" == *" -"* ]]; then
        row big "baseline before the load" "a worker did not answer or kept a session: ${baselines[*]}" FAIL
        return
    fi
    if ! start_serve "$FILE_BIG" 2 1 "$BIG_CTX" serve-big; then
        row big "load + 1 completion" "serve did not load (log $LOGS/serve-big.log)" FAIL
        return
    fi
    if python3 "$LIB/load_client.py" "$URL" one 16 8 "$VOCAB" >"$LOGS/big-request.json"; then
        row big "load + 1 completion" "loaded in $(awk -v m="$LOAD_MS" 'BEGIN { printf "%.1f", m / 1000 }') s, completion in $(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["seconds"])' "$LOGS/big-request.json") s" ok
    else
        row big "load + 1 completion" "completion failed: $(cat "$LOGS/big-request.json")" FAIL
    fi
    kill -KILL "$SERVE_PID"
    t0=$(now_ns)
    wait "$SERVE_PID" 2>/dev/null
    SERVE_PID=
    for line in "${baselines[@]}"; do args+=("${line% *}=${line#* }"); done
    i=0
    while read -r addr verdict ms kib why; do
        if [ "$verdict" = ok ] && ((ms <= RELEASE_LIMIT_MS)); then
            verdict=ok
        else
            verdict=FAIL
        fi
        row big "release ${WORKER_DEVICES[i]} <= $RELEASE_LIMIT_MS ms" \
            "$ms ms after SIGKILL, residual ${kib} KiB ($addr)${why:+; $why}" "$verdict"
        i=$((i + 1))
    done < <(TETHERCTL=$TETHERCTL python3 "$LIB/worker_release.py" wait \
        "${WORKER_DEVICES[0]%%:*}" "$t0" "$RELEASE_POLL_MS" "$TOLERANCE_MIB" "${args[@]}")
}

# ---------------------------------------------------------------------------------------

preflight() {
    local bin
    for bin in "$TETHER" "$TETHERCTL"; do
        [ -x "$bin" ] || { echo "gpu_two.sh: $bin is not an executable; set TETHER/TETHERCTL" >&2; exit 2; }
    done
    command -v python3 >/dev/null || { echo "gpu_two.sh: python3 is needed" >&2; exit 2; }
    mkdir -p "$LOGS" "$MODELS"
    if [ "$DEVICES" != cpu ]; then
        # shellcheck source=scripts/lib/nvrtc.sh
        . "$LIB/nvrtc.sh"
        setup_nvrtc gpu_two.sh
        local gpus
        gpus=$(python3 "$LIB/gpu_mem.py" used 2>/dev/null | wc -l)
        ((gpus >= 2)) || echo "gpu_two.sh: warning: NVML lists $gpus GPU(s); this run needs two" >&2
    fi
}

print_table() {
    echo
    echo "== tether on two devices (${WORKER_DEVICES[*]}): $SMALL_SHAPE q4_0/$MIX, $BIG_SHAPE $MIX; $SECONDS s =="
    printf '%-13s %-28s %-58s %s\n' step check value verdict
    printf '%s\n' "${ROWS[@]}"
    echo "logs: $LOGS"
}

finish() {
    print_table
    if ((${#FAILURES[@]} > 0)); then
        echo
        echo "FAILED (${#FAILURES[@]}):"
        printf '  %s\n' "${FAILURES[@]}"
        exit 1
    fi
    local skipped
    skipped=$(printf '%s\n' "${ROWS[@]}" | grep -c ' skipped$')
    if ((skipped)); then echo "all checks that ran passed ($skipped skipped)"; else echo "all checks passed"; fi
}

# `timeout N scripts/gpu_two.sh` signals the whole process group (this script, its workers,
# serve and clients): the step that was running is marked, and the table still prints.
interrupted() {
    row "$STEP" "run" "interrupted by a signal after $SECONDS s" FAIL
    finish
}

main() {
    preflight
    echo "gpu_two.sh: $TETHER, workers on ${WORKER_DEVICES[*]}, models in $MODELS, logs in $LOGS"
    trap interrupted TERM INT
    STEP=synth
    step_synth
    local file tag
    for file in "$FILE_Q4_0" "$FILE_MIX"; do
        want bench || break
        tag=$(basename "$file" .gguf)
        tag=${tag#"$SMALL_SHAPE"-}
        if out_of_time; then row "bench $tag" "pipeline 1,2" "skipped: DEADLINE_S" skipped; continue; fi
        STEP="bench $tag"
        step_bench "$file" "$tag"
    done
    if ! want serve; then
        :
    elif out_of_time; then
        row serve "2w/1w gen t/s" "skipped: DEADLINE_S" skipped
    else
        STEP=serve
        step_serve
    fi
    if ! want big; then
        row big "release after SIGKILL" "not run (STEPS has no big)" skipped
    elif out_of_time; then
        row big "release after SIGKILL" "skipped: DEADLINE_S" skipped
    else
        STEP=big
        step_big
    fi
    finish
}

main "$@"
