#!/usr/bin/env python3
"""Device memory as NVML (libnvidia-ml, what nvidia-smi reads) counts it, for the GPU scripts.

    gpu_mem.py procs                  # "pid bytes" for every compute process on every GPU
    gpu_mem.py used                   # used bytes of every GPU, one line each
    gpu_mem.py sample PID OUT [MS]    # every MS (10) ms until SIGTERM/SIGINT: the process's
                                      # bytes; writes JSON {n, first, min, max, last, ...}

A process that holds no device memory is absent from `procs` (and reads as 0 in `sample`).
Exits 2 when NVML cannot be loaded.
"""
import ctypes
import json
import signal
import sys
import time

NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_SIZE = 7
NOT_AVAILABLE = 2**64 - 1


class ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_v2_t, filled by nvmlDeviceGetComputeRunningProcesses_v3.
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("used", ctypes.c_ulonglong),
        ("gpu_instance", ctypes.c_uint),
        ("compute_instance", ctypes.c_uint),
    ]


class Memory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class Nvml:
    def __init__(self):
        lib = None
        for name in ("libnvidia-ml.so.1", "libnvidia-ml.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                pass
        if lib is None or lib.nvmlInit_v2() != NVML_SUCCESS:
            print("gpu_mem.py: NVML (libnvidia-ml) is not available", file=sys.stderr)
            sys.exit(2)
        self.lib = lib
        count = ctypes.c_uint(0)
        lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
        self.devices = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) == NVML_SUCCESS:
                self.devices.append(handle)

    def used(self):
        out = []
        for d in self.devices:
            m = Memory()
            self.lib.nvmlDeviceGetMemoryInfo(d, ctypes.byref(m))
            out.append(m.used)
        return out

    def procs(self):
        """{pid: bytes} summed over every GPU."""
        out = {}
        for d in self.devices:
            cap = 64
            while True:
                buf = (ProcessInfo * cap)()
                n = ctypes.c_uint(cap)
                r = self.lib.nvmlDeviceGetComputeRunningProcesses_v3(d, ctypes.byref(n), buf)
                if r == NVML_ERROR_INSUFFICIENT_SIZE and cap < 4096:
                    cap = max(cap * 2, n.value + 8)
                    continue
                if r == NVML_SUCCESS:
                    for p in buf[: min(n.value, cap)]:
                        used = 0 if p.used == NOT_AVAILABLE else p.used
                        out[p.pid] = out.get(p.pid, 0) + used
                break
        return out


def sample(nvml, pid, path, period_ms):
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    values, gaps, last_t = [], [], None
    while not stop:
        t = time.monotonic()
        values.append(nvml.procs().get(pid, 0))
        if last_t is not None:
            gaps.append(t - last_t)
        last_t = t
        time.sleep(max(0.0, period_ms / 1000 - (time.monotonic() - t)))
    result = {
        "n": len(values),
        "first": values[0] if values else 0,
        "min": min(values, default=0),
        "max": max(values, default=0),
        "last": values[-1] if values else 0,
        "max_gap_ms": round(max(gaps, default=0) * 1000, 1),
        "mean_gap_ms": round(sum(gaps) / len(gaps) * 1000, 2) if gaps else 0,
    }
    with open(path, "w") as f:
        json.dump(result, f)


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    nvml = Nvml()
    cmd = sys.argv[1]
    if cmd == "procs":
        for pid, used in sorted(nvml.procs().items()):
            print(pid, used)
    elif cmd == "used":
        for used in nvml.used():
            print(used)
    elif cmd == "sample" and len(sys.argv) >= 4:
        period = float(sys.argv[4]) if len(sys.argv) > 4 else 10.0
        sample(nvml, int(sys.argv[2]), sys.argv[3], period)
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(64)


if __name__ == "__main__":
    main()
