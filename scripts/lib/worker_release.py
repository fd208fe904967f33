#!/usr/bin/env python3
"""How fast workers give back a session's memory, from `tetherctl --worker ADDR status --json`.

    worker_release.py used DEVICE ADDR...
        once each worker holds no session (waiting up to 30 s for sessions that an earlier
        client is still closing), one line per worker: ADDR USED_BYTES (the baseline to hand
        to `wait`); exits 1 if a worker did not answer or kept a session
    worker_release.py wait DEVICE START_NS LIMIT_MS TOLERANCE_MIB ADDR=USED_BYTES...
        polls every worker (each in its own thread, every 10 ms) until it holds no session
        and no session bytes and its used bytes are within TOLERANCE_MIB of the baseline;
        one line per worker: ADDR ok|fail MS RESIDUAL_KIB [why], MS counted from START_NS
        (a time.time_ns() value: when the session's end began); exits 1 if any failed

USED_BYTES is the device's used memory (total - free) on a GPU; on the cpu device, where
those numbers are system-wide, the worker's own `unaccounted_bytes` (as gpu_memory.sh
does). TETHERCTL names the tetherctl binary.
"""
import json
import os
import subprocess
import sys
import threading
import time

MIB = 1 << 20
CTL = os.environ.get("TETHERCTL", "tetherctl")


def status(addr):
    try:
        r = subprocess.run([CTL, "--worker", addr, "status", "--json"],
                           capture_output=True, timeout=2)
    except subprocess.TimeoutExpired:
        return None
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout)
    except ValueError:
        return None


def used(device, s):
    if device == "cpu":
        return s["unaccounted_bytes"]
    return s["device_total_bytes"] - s["device_free_bytes"]


def print_used(device, *addrs):
    failed = 0
    for addr in addrs:
        deadline = time.time() + 30
        s = status(addr)
        while (s is None or s["sessions"] or s["session_bytes"]) and time.time() < deadline:
            time.sleep(0.05)
            s = status(addr)
        if s is None or s["sessions"] or s["session_bytes"]:
            print("%s -" % addr)
            failed = 1
        else:
            print("%s %d" % (addr, used(device, s)))
    return failed


def wait_one(device, addr, baseline, start_ns, limit_ms, tol, out):
    last = None
    while True:
        s = status(addr)
        ms = (time.time_ns() - start_ns) // 1_000_000
        if s is not None:
            last = s
            residual = used(device, s) - baseline
            if s["sessions"] == 0 and s["session_bytes"] == 0 and abs(residual) <= tol:
                out[addr] = "%s ok %d %d" % (addr, ms, residual // 1024)
                return
        if ms > limit_ms:
            if last is None:
                out[addr] = "%s fail %d 0 status did not answer" % (addr, ms)
            else:
                residual = used(device, last) - baseline
                out[addr] = "%s fail %d %d sessions=%d session_bytes=%d residual=%.1fMiB" % (
                    addr, ms, residual // 1024, last["sessions"], last["session_bytes"],
                    residual / MIB)
            return
        time.sleep(0.010)


def wait(device, start_ns, limit_ms, tol_mib, *workers):
    start_ns, limit_ms, tol = int(start_ns), int(limit_ms), int(tol_mib) * MIB
    out = {}
    threads = []
    for w in workers:
        addr, baseline = w.rsplit("=", 1)
        t = threading.Thread(target=wait_one,
                             args=(device, addr, int(baseline), start_ns, limit_ms, tol, out))
        t.start()
        threads.append((addr, t))
    for addr, t in threads:
        t.join()
        print(out[addr])
    return 0 if all(out[a].split()[1] == "ok" for a, _ in threads) else 1


def main():
    a = sys.argv
    if len(a) >= 4 and a[1] == "used":
        sys.exit(print_used(a[2], *a[3:]))
    if len(a) >= 7 and a[1] == "wait":
        sys.exit(wait(*a[2:]))
    print(__doc__, file=sys.stderr)
    sys.exit(64)


if __name__ == "__main__":
    main()
