"""Shared by the GPU benchmarks: device-to-device copy bandwidth and queue-filled event timing.

Timing method: every call goes on the legacy default stream (shared with PyTorch). A spin kernel is
queued first so that the host enqueues all timed calls while the GPU is still busy; CUDA events around
the calls then measure back-to-back GPU time, free of Python launch overhead. Each call may use a
different input set (``fn(i)``), so repeated calls do not re-read data from L2. Reported: the median of
``reps`` such measurements of the mean time per call.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any


def measure_copy_bandwidth(torch: Any, dev: Any, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes read + written per second of a large ``cuMemcpyDtoDAsync`` (what "copy bandwidth" means here)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    dev.copy_dtod(dst.data_ptr(), src.data_ptr(), nbytes)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        dev.copy_dtod(dst.data_ptr(), src.data_ptr(), nbytes)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def time_calls(torch: Any, fn: Callable[[int], Any], reps: int = 3, target_s: float = 4e-3, max_calls: int = 200,
               host_us_per_call: float = 120.0) -> float:
    """Median over ``reps`` of the mean GPU time (seconds) of one ``fn(i)`` call, queue-filled."""
    fn(0)
    fn(1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn(2)
    torch.cuda.synchronize()
    probe = time.perf_counter() - t  # an upper bound of one call (host + GPU)
    n = int(max(3, min(max_calls, target_s / max(probe, 1e-6) * 4)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    clock_hz = 2.0e9
    results = []
    for _ in range(reps):
        sleep = min(int(n * host_us_per_call * 1e-6 * clock_hz), int(0.2 * clock_hz))
        torch.cuda._sleep(sleep)
        start.record()
        for i in range(n):
            fn(i)
        end.record()
        end.synchronize()
        results.append(start.elapsed_time(end) / 1e3 / n)
    return statistics.median(results)


def time_on_stream(dev: Any, fn: Callable[[int], Any], calls: int, runs: int = 3, warmup: Iterable[int] = (0,),
                   spin_cycles: int = int(2e7), offset_by_run: bool = False) -> float:
    """Median over ``runs`` of the mean time (seconds) per call of ``calls`` back-to-back ``fn(i)`` on the
    project device ``dev``'s stream, between ``dev``'s own events. A torch spin kernel of ``spin_cycles`` goes
    first on the legacy stream, which ``dev``'s blocking stream waits for, so the host enqueues the calls while
    the GPU is busy. ``warmup``: indices called once before (loads, opt-ins, first launches); ``offset_by_run``:
    run ``r`` calls ``fn(r * calls + i)`` (a fresh input set per run)."""
    import torch

    for i in warmup:
        fn(i)
    dev.synchronize()
    out = []
    for run in range(runs):
        e0, e1 = dev.event(), dev.event()
        torch.cuda._sleep(int(spin_cycles))
        dev.record(e0)
        base = run * calls if offset_by_run else 0
        for i in range(calls):
            fn(base + i)
        dev.record(e1)
        out.append(dev.elapsed_ms(e0, e1) / calls / 1e3)
    return statistics.median(out)


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def write_report(path: str, lines: list[str]) -> None:
    """Write a result table (one line per item) to ``path`` and print it."""
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    print(text)
