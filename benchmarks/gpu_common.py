"""Shared by the GPU benchmarks: device-to-device copy bandwidth, queue-filled event timing and CUDA-graph timing.

Timing method: every call goes on the legacy default stream (shared with PyTorch). A spin kernel is
queued first so that the host enqueues all timed calls while the GPU is still busy; CUDA events around
the calls then measure back-to-back GPU time, free of Python launch overhead. Each call may use a
different input set (``fn(i)``), so repeated calls do not re-read data from L2. Reported: the median of
``reps`` such measurements of the mean time per call.

Queue-filled timing is only GPU time while the host enqueues the calls faster than the spin lasts: ``calls`` x the
host cost of one launch must stay under the spin (2e7 cycles, ~10 ms). A Python launch of a kernel with many
parameters costs tens of microseconds (``kernels.pack_args`` builds each parameter with numpy), so 200 calls of one
can outlast the spin and the figure becomes (host time - spin) / calls, whatever the kernel does.
:func:`time_graph` has no host cost in the figure (the calls are captured once in a CUDA graph and replayed, as a
decode step is served) and :func:`host_seconds_per_call` measures the host side alone.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
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


def time_graph(dev: Any, fn: Callable[[int], Any], calls: int, runs: int = 3, warmup: Iterable[int] = (0,),
               graph_cls: Any = None) -> float:
    """Median over ``runs`` of the mean GPU time (seconds) per call of ``calls`` back-to-back ``fn(i)``
    (i = 0 .. calls - 1), captured once in a CUDA graph (``graph_cls``: default ``cuda.driver.CudaGraph``) on
    ``dev``'s stream and replayed between ``dev``'s own events: no host launch cost in the figure. ``warmup``:
    indices called eagerly first (compiles, loads, checks every launch); one untimed replay before the runs."""
    if graph_cls is None:
        from hybrid_runtime.cuda.driver import CudaGraph as graph_cls
    for i in warmup:
        fn(i)
    dev.synchronize()

    def body() -> None:
        for i in range(calls):
            fn(i)

    g = graph_cls(dev, body)
    try:
        g.launch()
        out = []
        for _ in range(runs):
            e0, e1 = dev.event(), dev.event()
            dev.record(e0)
            g.launch()
            dev.record(e1)
            out.append(dev.elapsed_ms(e0, e1) / calls / 1e3)
        return statistics.median(out)
    finally:
        g.destroy()


def host_seconds_per_call(dev: Any, fn: Callable[[int], Any], calls: int, clock: Callable[[], float] = time.perf_counter
                          ) -> float:
    """Host seconds one ``fn(i)`` takes to enqueue (the Python launch path alone), the mean over ``calls`` calls
    after a synchronize; the GPU work is waited for afterwards, outside the figure."""
    dev.synchronize()
    t0 = clock()
    for i in range(calls):
        fn(i)
    t = (clock() - t0) / calls
    dev.synchronize()
    return t


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def write_report(path: str, lines: list[str]) -> None:
    """Write a result table (one line per item) to ``path`` and print it."""
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    print(text)


EVICT_SOURCE = "icache_evict.cu"


def cold_graph_seconds(device: Any, calls: Sequence[Any], reps: int) -> float:
    """GPU seconds per call of ``calls`` (callables that each launch one kernel) when each runs right after a kernel
    that evicts the SMs' instruction caches (``ops/cuda/icache_evict.cu``), as a decode step runs its kernels:
    there about ten others run between two launches of one layer's GEMM, so each launch fetches its code cold.
    The replay of [evict, call] pairs minus the replay of the evictions alone, both captured (no host time);
    never negative. ``device``: a CudaDevice. The evictor does not let its successor start early (no
    programmatic-dependent trigger), so a kernel whose cold code sits before its griddepcontrol.wait pays here what
    the step hides under the kernel before it (benchmarks/results/gpu_decode_step_notes.md, stop 43)."""
    from hybrid_runtime.cuda.driver import graph_replay_seconds
    from hybrid_runtime.cuda.kernels import load_module

    if not calls:
        return 0.0
    buf = device.zeros((1,), "float32")
    kern = load_module(EVICT_SOURCE, (), device.arch).kernel("icache_evict")
    grid = (2 * device.limits.sm_count, 1, 1)

    def evict() -> None:
        kern.launch(device, grid, (128, 1, 1), 0, [("ptr", buf.ptr)])

    def pairs() -> None:
        for c in calls:
            evict()
            c()

    def alone() -> None:
        for _ in calls:
            evict()

    evict()  # loads the module, checks the launch
    both = graph_replay_seconds(device, pairs, reps)
    base = graph_replay_seconds(device, alone, reps)
    return max(0.0, both - base) / len(calls)
