#!/usr/bin/env bash
# Proves that a tether worker gives back every byte a session held, as its own status and
# (when present) nvidia-smi see it, through three kinds of ending:
#   1. CYCLES ordinary sessions: `tether run` loads the whole model, decodes 16 tokens,
#      closes; the worker must be back at its idle baseline within 1 s.
#   2. KILLS clients SIGKILLed mid-decode; back at baseline within the lease TTL + 1 s.
#   3. RESTARTS worker restarts (odd: SIGTERM, even: SIGKILL) on the same port, each followed
#      by a full load+decode cycle on the fresh worker.
# Prints a table at the end and exits non-zero if any check failed.
#
#   scripts/gpu_memory.sh                                   # cuda:0, llama3-8b q4_0 (synthesized)
#   DEVICE=cpu CYCLES=5 KILLS=2 RESTARTS=4 MODEL=/tmp/l1b.gguf \
#     TETHER=target/release/tether TETHERCTL=target/release/tetherctl scripts/gpu_memory.sh
#
# Environment: TETHER, TETHERCTL (binaries; default .gpu/bin/), DEVICE (cuda:0), MODEL,
# CYCLES (100), KILLS (5), RESTARTS (20), TOLERANCE_MIB (16), PORT (a free one),
# PROMPT, CLIENT_TIMEOUT_S (900), WORKER_ARGS (extra worker flags), OUT (log folder;
# default /tmp/tether-mem-logs), DEADLINE_S (stop starting new steps after this many
# seconds and print the table of what ran: for machines that end commands at a limit).
# Needs bash, coreutils and python3 (JSON parsing).
set -u

TETHER=${TETHER:-.gpu/bin/tether}
TETHERCTL=${TETHERCTL:-.gpu/bin/tetherctl}
DEVICE=${DEVICE:-cuda:0}
DEFAULT_MODEL=/tmp/tether-models/llama3-8b-q4_0.gguf
MODEL=${MODEL:-$DEFAULT_MODEL}
CYCLES=${CYCLES:-100}
KILLS=${KILLS:-5}
RESTARTS=${RESTARTS:-20}
TOLERANCE_MIB=${TOLERANCE_MIB:-16}
PROMPT=${PROMPT:-Once upon a time}
CLIENT_TIMEOUT_S=${CLIENT_TIMEOUT_S:-900}
WORKER_ARGS=${WORKER_ARGS:-}
DEADLINE_S=${DEADLINE_S:-}
LOGS=${OUT:-/tmp/tether-mem-logs}

RELEASE_LIMIT_MS=1000
# `tether run` asks every worker for a 10 s lease (LoadOptions::default in
# crates/tether-coordinator/src/load.rs); neither `run` nor the worker can shorten it (the
# worker's --min-ttl is a floor). A SIGKILLed client's TCP connection closes at once, so
# release should come long before the TTL; the TTL is only the bound the design promises.
LEASE_TTL_S=10
KILL_LIMIT_MS=$(((LEASE_TTL_S + 1) * 1000))
# SIGTERM must finish within --shutdown-grace (10 s default); 5 s more for process exit.
TERM_LIMIT_S=15
WORKER_UP_LIMIT_MS=120000

FAILURES=()
WORKER_PID=
CLIENT_PID=

# ---------------------------------------------------------------------------------------
# Status probe. One python3 process per wait, so that polling every 10 ms costs one
# tetherctl call per tick rather than a python start-up.
PROBE_PY=$(
    cat <<'PY'
import json, os, subprocess, sys, time

MIB = 1 << 20
CTL = os.environ["TETHERCTL"]
ADDR = os.environ["WORKER_ADDR"]
DEVICE = os.environ["DEVICE"]
TOL = int(os.environ["TOLERANCE_MIB"]) * MIB


def status():
    try:
        r = subprocess.run([CTL, "--worker", ADDR, "status", "--json"],
                           capture_output=True, timeout=2)
    except subprocess.TimeoutExpired:
        return None
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout)
    except ValueError:
        return None


def residual(s):
    # On the cpu device the driver numbers are system-wide, so the worker's own
    # unaccounted bytes (RSS beyond baseline + sessions) are the measure; on a GPU the
    # device's used bytes against the worker's idle baseline.
    if DEVICE == "cpu":
        return s["unaccounted_bytes"]
    return s["device_total_bytes"] - s["device_free_bytes"] - s["baseline_used_bytes"]


def idle(s):
    return s["sessions"] == 0 and s["session_bytes"] == 0 and abs(residual(s)) <= TOL


def describe(s):
    if s is None:
        return "status did not answer"
    return "sessions=%d session_bytes=%d residual=%.1fMiB" % (
        s["sessions"], s["session_bytes"], residual(s) / MIB)


def pid_alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_idle(start_ns, limit_ms):
    # Prints "ok|fail MS RESIDUAL_KIB [why]"; the time counts from start_ns (the moment
    # the session's end began), not from this process's start.
    start_ns, limit_ms = int(start_ns), int(limit_ms)
    last = None
    while True:
        s = status()
        ms = (time.time_ns() - start_ns) // 1_000_000
        if s is not None:
            last = s
            if idle(s):
                print("ok %d %d" % (ms, residual(s) // 1024))
                return 0
        if ms > limit_ms:
            kib = residual(last) // 1024 if last else 0
            print("fail %d %d %s" % (ms, kib, describe(last)))
            return 1
        time.sleep(0.010)


def wait_up(pid, limit_ms):
    # Prints "BASELINE_USED_BYTES DEVICE_TOTAL_BYTES" once the worker answers.
    pid, deadline = int(pid), time.time() + int(limit_ms) / 1000
    while time.time() < deadline:
        if not pid_alive(pid):
            print("worker %d exited before answering" % pid)
            return 1
        s = status()
        if s is not None:
            print("%d %d" % (s["baseline_used_bytes"], s["device_total_bytes"]))
            return 0
        time.sleep(0.05)
    print("no status answer within %d ms" % int(limit_ms))
    return 1


def wait_decoding(out_file, pid, limit_ms):
    # Decoding has begun when the session holds its whole load (session_bytes > 0 and
    # unchanged for a second) and the client's stdout grows: `run` prints nothing before
    # the first token.
    pid, deadline = int(pid), time.time() + int(limit_ms) / 1000
    stable_since, last_bytes, out_at_stable = None, None, None
    while time.time() < deadline:
        if not pid_alive(pid):
            print("client %d exited before decoding" % pid)
            return 1
        s = status()
        out = os.path.getsize(out_file) if os.path.exists(out_file) else 0
        if s is not None and s["sessions"] >= 1 and s["session_bytes"] > 0:
            if s["session_bytes"] != last_bytes:
                last_bytes, stable_since, out_at_stable = s["session_bytes"], time.time(), out
            elif time.time() - stable_since >= 1.0 and out > out_at_stable:
                print("%d %d" % (s["session_bytes"] // 1024, out))
                return 0
        time.sleep(0.1)
    print("no decoding seen within %d ms" % int(limit_ms))
    return 1


MODES = {"idle": wait_idle, "up": wait_up, "decoding": wait_decoding}
sys.exit(MODES[sys.argv[1]](*sys.argv[2:]))
PY
)

probe() { python3 -c "$PROBE_PY" "$@"; }

# ---------------------------------------------------------------------------------------
# Helpers.

now_ns() { date +%s%N; }

fail() { # STEP MESSAGE
    FAILURES+=("$1: $2")
    echo "FAIL $1: $2" >&2
}

# KiB (signed integer) as MiB with one decimal, without floating-point tools.
mib() {
    local k=$1 sign=
    if ((k < 0)); then sign=-; k=$((-k)); fi
    printf '%s%d.%d' "$sign" $((k / 1024)) $(((k % 1024) * 10 / 1024))
}

# Milliseconds as seconds with two decimals.
secs() { printf '%d.%02d' $(($1 / 1000)) $(($1 % 1000 / 10)); }

abs() { if (($1 < 0)); then echo $((-$1)); else echo "$1"; fi; }

# True once DEADLINE_S has passed; the loops then stop starting steps.
out_of_time() { [ -n "$DEADLINE_S" ] && ((SECONDS >= DEADLINE_S)); }

have_smi() { command -v nvidia-smi >/dev/null 2>&1; }

# MiB nvidia-smi charges to PID, or "-" when it lists no such process (always "-" without
# nvidia-smi, and inside a container whose pids the driver does not see).
smi_mib() {
    have_smi || { echo -; return; }
    local pid used
    while IFS=', ' read -r pid used; do
        [ "$pid" = "$1" ] && { echo "$used"; return; }
    done < <(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null)
    echo -
}

# Waits up to 5 s for the driver to stop listing PID: a dead worker's memory must go with it.
smi_forgets() {
    have_smi || return 0
    local i
    for i in $(seq 1 50); do
        [ "$(smi_mib "$1")" = - ] && return 0
        sleep 0.1
    done
    return 1
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cleanup() {
    [ -n "$CLIENT_PID" ] && kill -9 "$CLIENT_PID" 2>/dev/null
    [ -n "$WORKER_PID" ] && kill -TERM "$WORKER_PID" 2>/dev/null && wait "$WORKER_PID" 2>/dev/null
}
trap cleanup EXIT

# ---------------------------------------------------------------------------------------
# Worker lifecycle.

# Starts a worker on WORKER_ADDR and waits for its status; sets WORKER_PID, BASELINE_USED,
# DEVICE_TOTAL. Returns non-zero (with the reason in UP_ERR) when it never answers.
start_worker() { # LOG_NAME
    # shellcheck disable=SC2086 # WORKER_ARGS holds several flags on purpose.
    "$TETHER" worker --listen "$WORKER_ADDR" --device "$DEVICE" $WORKER_ARGS \
        >"$LOGS/$1.log" 2>&1 &
    WORKER_PID=$!
    local answer
    if ! answer=$(probe up "$WORKER_PID" "$WORKER_UP_LIMIT_MS"); then
        UP_ERR="$answer (log $LOGS/$1.log)"
        return 1
    fi
    read -r BASELINE_USED DEVICE_TOTAL <<<"$answer"
}

# Signals the worker and reaps it; sets STOP_RC and STOP_MS. A watchdog SIGKILLs a worker
# that ignores SIGTERM past TERM_LIMIT_S, so a hung shutdown shows as a failure, not a hang.
stop_worker() { # SIGNAL
    local t0 watchdog
    t0=$(now_ns)
    kill -s "$1" "$WORKER_PID"
    (sleep "$TERM_LIMIT_S" && kill -9 "$WORKER_PID" 2>/dev/null) &
    watchdog=$!
    wait "$WORKER_PID" 2>/dev/null
    STOP_RC=$?
    STOP_MS=$((($(now_ns) - t0) / 1000000))
    kill "$watchdog" 2>/dev/null
    wait "$watchdog" 2>/dev/null
}

# ---------------------------------------------------------------------------------------
# The checks.

# One session from open to close: load the whole model, decode 16 tokens. Then the worker
# must be idle again within RELEASE_LIMIT_MS. Sets RUN_MS, RELEASE_MS, RESIDUAL_KIB; returns
# non-zero with the reason in CYCLE_ERR.
load_decode_cycle() { # NAME
    local name=$1 t0 t1 rc answer verdict
    t0=$(now_ns)
    timeout "$CLIENT_TIMEOUT_S" "$TETHER" run --model "$MODEL" --worker "$WORKER_ADDR" \
        --prompt "$PROMPT" -n 16 >"$LOGS/$name.out" 2>"$LOGS/$name.err"
    rc=$?
    t1=$(now_ns)
    RUN_MS=$(((t1 - t0) / 1000000))
    answer=$(probe idle "$t1" "$RELEASE_LIMIT_MS")
    read -r verdict RELEASE_MS RESIDUAL_KIB _ <<<"$answer"
    RELEASE_MS=${RELEASE_MS:-0} RESIDUAL_KIB=${RESIDUAL_KIB:-0}
    printf '%s\t%d\t%d\t%d\t%s\t%s\n' "$name" "$rc" "$RUN_MS" "$RELEASE_MS" \
        "$(mib "$RESIDUAL_KIB")" "$(smi_mib "$WORKER_PID")" >>"$LOGS/results.tsv"
    if ((rc != 0)); then
        CYCLE_ERR="client exited $rc: $(tail -n 2 "$LOGS/$name.err" | tr '\n' ' ')"
        return 1
    fi
    if [ "$verdict" != ok ]; then
        CYCLE_ERR="not back at baseline within ${RELEASE_LIMIT_MS} ms: ${answer#fail * * }"
        return 1
    fi
}

run_cycles() {
    local i
    CYCLES_OK=0 CYCLES_DONE=0 CYCLES_WORST_MS=0 CYCLES_WORST_KIB=0
    for ((i = 1; i <= CYCLES; i++)); do
        out_of_time && break
        CYCLES_DONE=$i
        if load_decode_cycle "cycle-$i"; then
            CYCLES_OK=$((CYCLES_OK + 1))
        else
            fail "cycle $i" "$CYCLE_ERR"
        fi
        ((RELEASE_MS > CYCLES_WORST_MS)) && CYCLES_WORST_MS=$RELEASE_MS
        (($(abs "$RESIDUAL_KIB") > $(abs "$CYCLES_WORST_KIB"))) && CYCLES_WORST_KIB=$RESIDUAL_KIB
        echo "cycle $i/$CYCLES: run $(secs "$RUN_MS") s, released in $RELEASE_MS ms, residual $(mib "$RESIDUAL_KIB") MiB"
    done
}

# A client SIGKILLed while decoding: its connection breaks without a Close, and the worker
# must still free the session, within the lease TTL + 1 s at the latest.
kill_mid_decode() { # INDEX
    local name=kill-$1 answer verdict t0 release_ms kib decoding=1
    # Empty before the client starts: the probe watches this file grow.
    : >"$LOGS/$name.out"
    "$TETHER" run --model "$MODEL" --worker "$WORKER_ADDR" --prompt "$PROMPT" -n 1000000 \
        >"$LOGS/$name.out" 2>"$LOGS/$name.err" &
    CLIENT_PID=$!
    if ! answer=$(probe decoding "$LOGS/$name.out" "$CLIENT_PID" $((CLIENT_TIMEOUT_S * 1000))); then
        fail "kill $1" "$answer (client log $LOGS/$name.err)"
        decoding=0
    fi
    kill -9 "$CLIENT_PID" 2>/dev/null
    t0=$(now_ns)
    wait "$CLIENT_PID" 2>/dev/null
    CLIENT_PID=
    answer=$(probe idle "$t0" "$KILL_LIMIT_MS")
    read -r verdict release_ms kib _ <<<"$answer"
    release_ms=${release_ms:-0} kib=${kib:-0}
    printf '%s\t%d\t%d\t%d\t%s\t%s\n' "$name" 137 0 "$release_ms" "$(mib "$kib")" \
        "$(smi_mib "$WORKER_PID")" >>"$LOGS/results.tsv"
    ((release_ms > KILLS_WORST_MS)) && KILLS_WORST_MS=$release_ms
    if [ "$verdict" = ok ]; then
        KILLS_OK=$((KILLS_OK + decoding))
        echo "kill $1/$KILLS: released in $release_ms ms after SIGKILL, residual $(mib "$kib") MiB"
    else
        fail "kill $1" "not back at baseline within ${KILL_LIMIT_MS} ms of SIGKILL: ${answer#fail * * }"
    fi
}

run_kills() {
    local i
    KILLS_OK=0 KILLS_DONE=0 KILLS_WORST_MS=0
    for ((i = 1; i <= KILLS; i++)); do
        out_of_time && break
        KILLS_DONE=$i
        kill_mid_decode "$i"
    done
}

# Stops the worker (odd: SIGTERM, which must exit 0 in time; even: SIGKILL), checks the
# driver forgets its pid, starts a fresh one on the same port and runs one full cycle. The
# fresh worker's idle baseline must not carry memory the previous one left behind.
restart_once() { # INDEX
    local i=$1 sig expect old=$WORKER_PID ok=1
    if ((i % 2 == 1)); then sig=TERM expect=0; else sig=KILL expect=137; fi
    stop_worker "$sig"
    echo "restart $i/$RESTARTS: SIG$sig, worker $old exited $STOP_RC after $STOP_MS ms"
    if ((STOP_RC != expect)); then
        fail "restart $i" "worker $old exited $STOP_RC after SIG$sig (expected $expect) in $STOP_MS ms; log $LOGS/worker-$((i - 1)).log"
        ok=0
    fi
    if ! smi_forgets "$old"; then
        fail "restart $i" "nvidia-smi still lists stopped worker $old 5 s after SIG$sig"
        ok=0
    fi
    if ! start_worker "worker-$i"; then
        fail "restart $i" "fresh worker did not come up: $UP_ERR"
        return
    fi
    if [ "$DEVICE" != cpu ]; then
        local grown_kib=$(((BASELINE_USED - FIRST_BASELINE_USED) / 1024))
        if ((grown_kib > TOLERANCE_MIB * 1024)); then
            fail "restart $i" "fresh worker's baseline is $(mib "$grown_kib") MiB above the first worker's"
            ok=0
        fi
    fi
    if load_decode_cycle "restart-$i"; then
        RESTART_RUN_MS_SUM=$((RESTART_RUN_MS_SUM + RUN_MS))
        RESTART_RUNS=$((RESTART_RUNS + 1))
        echo "restart $i/$RESTARTS: load+decode $(secs "$RUN_MS") s, released in $RELEASE_MS ms"
    else
        fail "restart $i" "$CYCLE_ERR"
        ok=0
    fi
    RESTARTS_OK=$((RESTARTS_OK + ok))
}

run_restarts() {
    local i
    RESTARTS_OK=0 RESTARTS_DONE=0 RESTART_RUN_MS_SUM=0 RESTART_RUNS=0
    for ((i = 1; i <= RESTARTS; i++)); do
        out_of_time && break
        RESTARTS_DONE=$i
        restart_once "$i"
    done
}

# ---------------------------------------------------------------------------------------
# Set-up, the three phases, the table.

preflight() {
    local bin
    for bin in "$TETHER" "$TETHERCTL"; do
        [ -x "$bin" ] || { echo "gpu_memory.sh: $bin is not an executable; set TETHER/TETHERCTL" >&2; exit 2; }
    done
    command -v python3 >/dev/null || { echo "gpu_memory.sh: python3 is needed to read status JSON" >&2; exit 2; }
    mkdir -p "$LOGS"
    : >"$LOGS/results.tsv"
    if [ ! -f "$MODEL" ]; then
        if [ "$MODEL" != "$DEFAULT_MODEL" ]; then
            echo "gpu_memory.sh: MODEL=$MODEL does not exist" >&2
            exit 2
        fi
        echo "gpu_memory.sh: synthesizing $MODEL (llama3-8b, q4_0)"
        mkdir -p "$(dirname "$MODEL")"
        "$TETHER" gguf synth "$MODEL" --shape llama3-8b --type q4_0 >"$LOGS/synth.log" 2>&1 ||
            { echo "gpu_memory.sh: synth failed; see $LOGS/synth.log" >&2; exit 2; }
    fi
    if [ "$DEVICE" != cpu ]; then
        # shellcheck source=scripts/lib/nvrtc.sh
        . "$(dirname "$0")/lib/nvrtc.sh"
        setup_nvrtc gpu_memory.sh
    fi
    export TETHERCTL DEVICE TOLERANCE_MIB
    export WORKER_ADDR=127.0.0.1:${PORT:-$(free_port)}
}

# "OK/DONE", plus what DEADLINE_S left out.
tally() { # OK DONE PLANNED
    if (($2 < $3)); then echo "$1/$2 ($(($3 - $2)) skipped: DEADLINE_S)"; else echo "$1/$2"; fi
}

print_table() {
    local mean=-
    ((RESTART_RUNS > 0)) && mean="$(secs $((RESTART_RUN_MS_SUM / RESTART_RUNS))) s"
    echo
    echo "== tether memory release: $DEVICE, $(basename "$MODEL"), lease TTL ${LEASE_TTL_S} s, tolerance ${TOLERANCE_MIB} MiB =="
    printf '%-9s %-9s %s\n' check ok/total result
    printf '%-9s %-9s %s\n' cycles "$(tally "$CYCLES_OK" "$CYCLES_DONE" "$CYCLES")" \
        "worst release $CYCLES_WORST_MS ms (limit $RELEASE_LIMIT_MS), worst residual $(mib "$CYCLES_WORST_KIB") MiB"
    printf '%-9s %-9s %s\n' kills "$(tally "$KILLS_OK" "$KILLS_DONE" "$KILLS")" \
        "worst release $KILLS_WORST_MS ms (limit $KILL_LIMIT_MS)"
    printf '%-9s %-9s %s\n' restarts "$(tally "$RESTARTS_OK" "$RESTARTS_DONE" "$RESTARTS")" \
        "mean load+decode $mean"
    printf '%-9s %-9s %s\n' memory "" \
        "baseline used $(mib $((FIRST_BASELINE_USED / 1024))) MiB / device total $(mib $((DEVICE_TOTAL / 1024))) MiB"
    echo "logs: $LOGS (results.tsv: name, client rc, run ms, release ms, residual MiB, nvidia-smi MiB)"
}

main() {
    preflight
    echo "gpu_memory.sh: $TETHER on $DEVICE at $WORKER_ADDR, model $MODEL, logs in $LOGS"
    if ! start_worker worker-0; then
        echo "FAIL start: worker did not come up: $UP_ERR" >&2
        exit 1
    fi
    FIRST_BASELINE_USED=$BASELINE_USED
    run_cycles
    run_kills
    run_restarts
    print_table
    if ((${#FAILURES[@]} > 0)); then
        echo
        echo "FAILED (${#FAILURES[@]}):"
        printf '  %s\n' "${FAILURES[@]}"
        exit 1
    fi
    echo "all checks passed"
}

main "$@"
