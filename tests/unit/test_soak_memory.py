"""The soak's memory verdict (loadtests.memory) and the model's heap debugging (deploy.heap_debug), no server."""

from __future__ import annotations

import os
import random
import tracemalloc
from pathlib import Path

import pytest

from deploy.heap_debug import HeapMonitor, compare, release_free_heap, snapshot_files
from loadtests import memory as mem


def _series(slope_mib_h: float, seconds: float = 7200, step: float = 10, noise: float = 0.0,
            spikes: bool = False) -> list[tuple[float, float]]:
    rng = random.Random(7)
    out = []
    t = 0.0
    while t <= seconds:
        v = 230.0 + slope_mib_h * t / 3600 + rng.uniform(-noise, noise)
        if spikes and rng.random() < 0.05:
            v += 20.0  # a long prompt in flight
        out.append((t, v))
        t += step
    return out


def test_theil_sen_ignores_transient_peaks_least_squares_does_not() -> None:
    pts = _series(0.0, noise=0.5, spikes=True)
    pts[-20:] = [(t, v + 20.0) for t, v in pts[-20:]]  # a burst of long prompts at the very end
    assert abs(mem.theil_sen(pts) * 3600) < 0.5
    assert mem.least_squares(pts) * 3600 > 1.0
    with pytest.raises(ValueError):
        mem.theil_sen([(1.0, 2.0), (1.0, 3.0)])


def test_growth_verdict_fails_slow_growth_the_end_value_check_would_pass() -> None:
    # The figure: ~24 MiB/h, i.e. 12 MiB over 30 min, well inside the old end-vs-start bound.
    leak = mem.growth_verdict("tree", _series(24.0, 1800, noise=3.0), settle_s=360, budget_mib_h=1.0, floor_mib=1.0)
    assert leak is not None and not leak.ok and 20 < leak.slope_mib_h < 28
    assert leak.points == len([p for p in _series(24.0, 1800) if p[0] >= 360])
    flat = mem.growth_verdict("tree", _series(0.2, noise=3.0), settle_s=600, budget_mib_h=1.0, floor_mib=1.0)
    assert flat is not None and flat.ok and flat.budget_mib_h == 1.0
    # What was there before the fit window does not count: a warm-up ramp of 40 MiB.
    ramp = [(t, v + (40.0 * (1 - t / 600) if t < 600 else 0.0)) for t, v in _series(0.0, noise=1.0)]
    assert mem.growth_verdict("tree", ramp, 600, 1.0, 1.0).ok  # type: ignore[union-attr]
    assert mem.growth_verdict("tree", _series(0.0, 60, step=20), 50, 1.0, 1.0) is None  # too few points


def test_short_runs_budget_is_the_floor_per_window() -> None:
    assert mem.effective_budget(1.0, 1.0, 3600) == 1.0
    assert mem.effective_budget(1.0, 2.0, 48) == pytest.approx(150.0)  # 2 MiB per 48 s window
    ci = mem.growth_verdict("tree", _series(0.0, 60, step=1, noise=1.0), 12, 1.0, 2.0)
    assert ci is not None and ci.ok and ci.budget_mib_h == pytest.approx(2.0 * 3600 / 48)
    leak = mem.growth_verdict("tree", _series(600.0, 60, step=1, noise=0.5), 12, 1.0, 2.0)  # 10 MiB a minute
    assert leak is not None and not leak.ok


def test_plan_defaults_follow_the_duration() -> None:
    ci = mem.Plan.for_duration(60)
    assert (ci.sample_s, ci.settle_s, ci.heap_snapshot_s) == (1.0, 12.0, 10)
    long = mem.Plan.for_duration(7200)
    assert (long.sample_s, long.settle_s, long.heap_snapshot_s, long.budget_mib_h) == (10.0, 600.0, 600, 1.0)
    assert mem.Plan.for_duration(7200, settle_s=0).settle_s == 0


def test_sampler_reads_this_process_tree_and_report_checks(tmp_path: Path) -> None:
    sampler = mem.MemorySampler(os.getpid(), 0.05, heap=lambda: {"stub:1": 12.5})
    first = sampler.sample()
    assert first is not None and first.total_mib > 10 and f"{mem.process_name(os.getpid())}:{os.getpid()}" in \
        first.rss_mib and first.heap_mib == {"stub:1": 12.5} and all(a > 0 for a, _ in first.split_mib.values())
    samples = [mem.Sample(t, 200.0 + 0.01 * t, {"tritonserver:1": 40.0, "stub:2": 160.0 + 0.01 * t},
                          {"stub:2": 50.0 + 0.0001 * t}, {"stub:2": (100.0 + 0.01 * t, 4.0)})
               for t in range(0, 3600, 10)]
    plan = mem.Plan.for_duration(3600)
    rep = mem.soak_report(samples, plan, 200.0, 236.0, 1.25, 64.0)
    checks = {name: ok for name, ok, _ in rep.checks}
    assert checks["memory: end RSS within bound"]  # 36 MiB more: the old check passes...
    assert not checks["memory: RSS growth slope within budget"]  # ...the slope (36 MiB/h) does not
    assert checks["memory: Python heap of stub:2 within budget"]  # 0.36 MiB/h
    assert not checks["memory: RSS growth slope of stub:2 within budget"]  # the model's process: 36 MiB/h
    assert "memory: RSS growth slope of tritonserver:1 within budget" not in checks  # only the stubs are judged
    assert rep.data["python_heap"]["stub:2"]["slope_mib_h"] == pytest.approx(0.36)
    assert rep.data["per_process"]["stub:2"]["slope_mib_h"] == pytest.approx(36.0)
    mem.write_csv(samples, tmp_path / "m.csv")
    head, row = (tmp_path / "m.csv").read_text().splitlines()[:2]
    assert head == ("t_s,total_rss_mib,rss_mib:stub:2,rss_mib:tritonserver:1,heap_mib:stub:2,anon_mib:stub:2,"
                    "shmem_mib:stub:2,anon_mib:tritonserver:1,shmem_mib:tritonserver:1")
    assert row == "0,200,160,40,50,100,4,,"
    # the stub's growth is in its anonymous memory, not in the shared-memory region
    assert rep.data["per_process"]["stub:2"]["anon_slope_mib_h"] == pytest.approx(36.0)
    assert rep.data["per_process"]["stub:2"]["shmem_slope_mib_h"] == pytest.approx(0.0)
    assert any("memory series" in line for line in rep.lines) and any("MiB/h" in line for line in rep.lines)


def test_tracemalloc_own_memory_is_sampled_and_shown_beside_the_heap_without_a_check(tmp_path: Path) -> None:
    sampler = mem.MemorySampler(os.getpid(), 0.05, heap=lambda: {"stub:1": (12.5, 3.25), "stub:2": (1.0, None)})
    first = sampler.sample()
    assert first is not None and first.heap_mib == {"stub:1": 12.5, "stub:2": 1.0}
    assert first.tracemalloc_mib == {"stub:1": 3.25}
    samples = [mem.Sample(t, 200.0, {"stub:2": 160.0}, {"stub:2": 50.0}, {"stub:2": (100.0, 4.0)},
                          {"stub:2": 3.0 + 0.0005 * t}) for t in range(0, 3600, 10)]
    rep = mem.soak_report(samples, mem.Plan.for_duration(3600), 200.0, 200.0, 1.25, 64.0)
    assert rep.data["python_heap"]["stub:2"]["tracemalloc_slope_mib_h"] == pytest.approx(1.8)
    assert not any("tracemalloc" in name for name, _, _ in rep.checks)  # debugging's own cost: shown, not judged
    assert any("tracemalloc's own memory +1.800 MiB/h" in line for line in rep.lines)
    mem.write_csv(samples, tmp_path / "m.csv")
    head, row = (tmp_path / "m.csv").read_text().splitlines()[:2]
    assert head.endswith(",tracemalloc_mib:stub:2") and row.endswith(",3")


def test_late_cancel_allowance_widens_only_the_trees_budget() -> None:
    assert mem.Allowance.late_cancels(0, 7200).mib_h == 0.0
    allow = mem.Allowance.late_cancels(600, 7200)  # 300 an hour x 6 KiB
    assert allow.mib_h == pytest.approx(300 * 6 / 1024, abs=1e-3) and "600 late cancels" in allow.reason
    # tritonserver grows 1.5 MiB/h (the upstream leak), the stub is flat
    samples = [mem.Sample(t, 200.0 + 1.5 * t / 3600, {"tritonserver:1": 40.0 + 1.5 * t / 3600, "stub:2": 160.0})
               for t in range(0, 7200, 10)]
    plan = mem.Plan.for_duration(7200)
    strict = {n: ok for n, ok, _ in mem.soak_report(samples, plan, 200.0, 203.0, 1.25, 64.0).checks}
    assert not strict["memory: RSS growth slope within budget"]
    rep = mem.soak_report(samples, plan, 200.0, 203.0, 1.25, 64.0, allowance=allow)
    checks = {n: (ok, detail) for n, ok, detail in rep.checks}
    assert checks["memory: RSS growth slope within budget"][0]
    assert "600 late cancels" in checks["memory: RSS growth slope within budget"][1]
    assert checks["memory: RSS growth slope of stub:2 within budget"][0]
    assert rep.data["growth"]["budget_mib_h"] == pytest.approx(1.0 + allow.mib_h, abs=1e-3)
    assert any("for Triton's late-cancel leak" in line for line in rep.lines)
    # the allowance is no cover for the model's own process
    grow = [mem.Sample(s.t_s, s.total_mib, {**s.rss_mib, "stub:2": 160.0 + 1.5 * s.t_s / 3600}) for s in samples]
    own = {n: ok for n, ok, _ in mem.soak_report(grow, plan, 200.0, 203.0, 1.25, 64.0, allowance=allow).checks}
    assert not own["memory: RSS growth slope of stub:2 within budget"]


def test_release_free_heap_returns_freed_small_blocks_to_the_system() -> None:
    def anon_mib() -> float:
        return mem.status_kib(os.getpid(), ("RssAnon",))["RssAnon"] / 1024.0

    if not release_free_heap():
        pytest.skip("no glibc malloc_trim here")
    blocks = [bytearray(4000) for _ in range(25_000)]  # ~95 MiB of malloc'd blocks (too large for pymalloc)
    keep = blocks[::64]  # a few stay alive all over the heap, so free() alone cannot shrink it
    del blocks
    before = anon_mib()
    assert release_free_heap()
    assert anon_mib() < before - 40.0 and len(keep) == 391


def test_heap_snapshot_leaves_no_transient_memory_in_the_rss(tmp_path: Path) -> None:
    """A snapshot's copies of the traces (~30 MiB here) are given back: measured without the trim, the RSS
    rose 63 -> 91 -> 99 MiB over three snapshots of this heap; with it, 63 -> 64.5."""
    was_tracing = tracemalloc.is_tracing()
    monitor = HeapMonitor(tmp_path, period_s=3600).start()
    try:
        kept = [str(i) * 3 for i in range(300_000)]
        release_free_heap()
        before = mem.status_kib(os.getpid(), ("RssAnon",))["RssAnon"] / 1024.0
        for _ in range(3):
            monitor.snapshot()
        after = mem.status_kib(os.getpid(), ("RssAnon",))["RssAnon"] / 1024.0
    finally:
        monitor.stop()
    assert not tracemalloc.is_tracing() or was_tracing
    assert len(kept) == 300_000 and len(snapshot_files(tmp_path)) == 3
    assert after - before < 8.0, f"RSS {before:.1f} -> {after:.1f} MiB over three snapshots"


def _keep(n: int) -> list[bytes]:
    return [bytes(1000) + str(i).encode() for i in range(n)]  # the allocating line the snapshots must name


def test_heap_monitor_snapshots_and_compare_name_the_growing_line(tmp_path: Path) -> None:
    was_tracing = tracemalloc.is_tracing()
    monitor = HeapMonitor(tmp_path, period_s=3600).start()
    try:
        stats = monitor.stats()
        assert {"python_heap_bytes", "python_heap_peak_bytes", "tracemalloc_overhead_bytes"} <= set(stats)
        first = monitor.snapshot()
        kept = _keep(3000)
        second = monitor.snapshot()
        assert monitor.stats()["python_heap_bytes"] > stats["python_heap_bytes"] + 2_500_000
    finally:
        monitor.stop()
    assert not tracemalloc.is_tracing() or was_tracing
    files = snapshot_files(tmp_path)
    assert [f.path for f in files] == [first, second] and files[0].pid == os.getpid() and files[1].seq == 2
    total, growers = compare(first, second, top=3)
    assert total > 2_500_000 and len(kept) == 3000
    top = growers[0]
    assert top.where.startswith("unit/test_soak_memory.py:") and top.count_diff >= 3000 and top.size_diff > 2_500_000
    report = mem.heap_report(tmp_path, t0_wall=files[0].mtime - 1, settle_s=0)
    entry = report[f"stub:{os.getpid()}"]
    assert entry["snapshots"] == 2 and entry["diff_bytes"] == total
    assert entry["top_by_line"][0]["where"] == top.where and len(entry["intervals"]) == 1


HANG_LOG = """\
I1201 09:40:47.567601 19854 server.cc:305] "Waiting for in-flight requests to complete."
I1201 09:40:47.567626 19854 server.cc:321] "Timeout 5: Found 0 model versions that have in-flight inferences"
I1201 09:40:47.567718 19854 server.cc:336] "All models are stopped, unloading models"
I1201 09:40:47.567726 19854 server.cc:345] "Timeout 5: Found 1 live models and 0 in-flight non-inference requests"
I1201 09:40:48.567818 19854 server.cc:345] "Timeout 4: Found 1 live models and 0 in-flight non-inference requests"
E1201 09:40:52.568489 19854 main.cc:535] "failed to stop server: Internal - Exit timeout expired. Exiting immediately."
"""


def test_unload_hang_is_recognised_only_in_its_upstream_shape() -> None:
    from loadtests.soak import unload_hang

    hang = unload_hang(HANG_LOG)
    assert hang == {"exit_timeout_expired": True, "no_inflight_inferences": True, "live_model_waits": 2}
    # requests still in flight at the timeout: the model's own fault, not the frontend's reference
    busy = HANG_LOG.replace("Found 0 model versions", "Found 1 model versions")
    assert not unload_hang(busy)["no_inflight_inferences"]
    clean = "\n".join(HANG_LOG.splitlines()[:3]) + '\nI1201 server.cc:345] "Timeout 5: Found 0 live models and 0 ..."'
    assert unload_hang(clean) == {"exit_timeout_expired": False, "no_inflight_inferences": True, "live_model_waits": 0}


def test_release_free_heap_returns_a_threads_arena_memory() -> None:
    """What the engine thread's periodic trim is for: memory a thread freed stays in ITS glibc arena (issue 21's
    47-minute soak: the engine thread's arena kept ~5 MiB more free memory after the longest request), and
    malloc_trim(0) gives the whole free pages of every arena back, not only the main one's."""
    import threading

    def anon_mib() -> float:
        return mem.status_kib(os.getpid(), ("RssAnon",))["RssAnon"] / 1024.0

    if not release_free_heap():
        pytest.skip("no glibc malloc_trim here")
    kept: list[list[bytearray]] = []

    def work() -> None:  # blocks below the mmap threshold, freed in this thread: they stay in its arena
        blocks = [bytearray(4000) for _ in range(20_000)]  # ~76 MiB
        kept.append(blocks[::64])
        del blocks

    t = threading.Thread(target=work)
    t.start()
    t.join()
    before = anon_mib()
    assert release_free_heap()
    assert anon_mib() < before - 30.0 and len(kept[0]) == 313


def test_heap_trimmer_calls_at_most_once_per_interval() -> None:
    from hybrid_runtime.host_memory import HeapTrimmer

    now = [0.0]
    calls: list[float] = []
    trimmer = HeapTrimmer(10.0, trim=lambda: calls.append(now[0]) or True, clock=lambda: now[0])
    for t in (0.0, 5.0, 9.99, 10.0, 10.5, 19.9, 20.0, 45.0, 46.0):
        now[0] = t
        trimmer.maybe_trim()
    assert calls == [10.0, 20.0, 45.0] and trimmer.trims == 3
    never = HeapTrimmer(0.0, trim=lambda: calls.append(-1.0) or True, clock=lambda: 1e9)
    assert not never.maybe_trim() and never.trims == 0 and calls[-1] == 45.0
