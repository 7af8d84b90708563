"""Memory of the server through a soak: samples of the process tree, a growth slope, and its verdict.

* :func:`process_tree`, :func:`rss_mib` — the tritonserver process and its descendants (the Python-backend
  stubs) from /proc, and their summed resident set.
* :class:`MemorySampler` — a thread that records, every ``period_s``, the RSS of every process of the tree
  and (when the model runs with ``heap_debug_dir``) each stub's traced Python heap and tracemalloc's own
  memory from the metrics port.
* :func:`anon_by_kind` (heap debugging) — a stub's anonymous memory by who mapped it, from its smaps: glibc's
  main arena (``[heap]``), its per-thread arenas (64 MiB-aligned anonymous mappings) and all other anonymous
  mappings (malloc's mmapped chunks, thread stacks, pymalloc arenas); with the model's ``malloc_info`` gauges
  and onnxruntime's arena extensions (:func:`ort_arena_series`, from the server log) it tells which allocator
  holds a growth (:func:`allocator_report`).
* :func:`theil_sen` — the growth slope of a series: the median of the pairwise slopes, which the transient
  peaks of long prompts in flight do not pull the way they pull a least-squares fit.
* :func:`growth_verdict` — the slope after the settle period against a budget in MiB per hour. The budget
  never asks for less than ``floor_mib`` of fitted growth over the window: a 60 s run cannot resolve
  1 MiB/h (RSS moves by pages and allocator arenas), so its budget is ``floor_mib`` per window.
* :class:`Allowance` — what the tree's budget adds for a known upstream leak the run provoked on purpose
  (Triton 2.51's late-cancel leak: at most ``LATE_CANCEL_LEAK_KIB`` per late cancel); the stubs' own
  slopes get no allowance.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.heap_debug import SNAPSHOT_COMM

HOUR = 3600.0


# ---- /proc --------------------------------------------------------------------------------------------

def proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of ``pid`` or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def process_comm(pid: int) -> str:
    """/proc/<pid>/comm ("" when the process is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def process_tree(root: int) -> dict[int, int]:
    """pid -> start time of ``root`` and all its descendants (live ones), without the model's forked heap-snapshot
    children (``SNAPSHOT_COMM``: they live for seconds and share the stub's pages, which they would count twice;
    they die with their stub)."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        st = proc_stat(int(entry.name))
        if st is None or st[1] == "Z":
            continue
        parents.setdefault(st[0], []).append(int(entry.name))
        starts[int(entry.name)] = st[2]
    if root not in starts:
        return {}
    out, todo = {}, [root]
    while todo and len(out) < 10_000:
        pid = todo.pop()
        if pid in out:
            continue
        if pid != root and process_comm(pid) == SNAPSHOT_COMM:
            continue
        out[pid] = starts[pid]
        todo.extend(parents.get(pid, []))
    return out


def status_kib(pid: int, keys: Sequence[str] = ("VmRSS",)) -> dict[str, int]:
    """Fields of /proc/<pid>/status in KiB (empty when the process is gone)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in keys:
                out[key] = int(rest.split()[0])
    return out


def rss_mib(pids: Sequence[int] | dict[int, int]) -> float:
    return sum(status_kib(pid).get("VmRSS", 0) for pid in pids) / 1024.0


def process_name(pid: int) -> str:
    """``tritonserver`` / ``stub`` (a Python-backend stub) / the command's base name."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except (OSError, IndexError):
        return "?"
    name = argv0.rsplit("/", 1)[-1]
    return "stub" if name == "triton_python_backend_stub" else name


# ---- sampling -----------------------------------------------------------------------------------------

@dataclass(slots=True)
class Sample:
    """One reading: seconds since the sampler's start, RSS (MiB) of the whole tree and per process
    (``"<name>:<pid>"``), and the traced Python heap (MiB) per stub pid when the model exports it."""

    t_s: float
    total_mib: float
    rss_mib: dict[str, float]
    heap_mib: dict[str, float] = field(default_factory=dict)
    # "<name>:<pid>" -> (RssAnon, RssShmem) in MiB: malloc'd memory vs the Python backend's shm region
    split_mib: dict[str, tuple[float, float]] = field(default_factory=dict)
    # stub -> tracemalloc's own memory (MiB; heap debugging): in the stub's RSS, outside its traced heap
    tracemalloc_mib: dict[str, float] = field(default_factory=dict)
    # stub -> allocator figure -> MiB (heap debugging): anon_by_kind and the model's malloc_info gauges
    alloc_mib: dict[str, dict[str, float]] = field(default_factory=dict)


# stub -> traced heap MiB, or (traced heap, tracemalloc's own memory or None) in MiB
HeapReader = Callable[[], dict[str, float | tuple[float, float | None]]]
# stub -> allocator figure -> MiB (the model's malloc_info gauges)
AllocReader = Callable[[], dict[str, dict[str, float]]]

GLIBC_HEAP_MAX = 64 << 20  # a glibc thread arena's heap: a mapping of up to 64 MiB aligned to 64 MiB (64-bit)


def anon_by_kind(pid: int) -> dict[str, float]:
    """Anonymous memory (MiB) of ``pid`` by the kind of mapping that holds it, from /proc/<pid>/smaps:
    ``smaps_main_heap`` (``[heap]``: glibc's main arena), ``smaps_thread_heaps`` (writable anonymous mappings at a
    64 MiB-aligned address and at most 64 MiB long: glibc's per-thread arenas), ``smaps_other_anon`` (every other
    anonymous mapping: malloc's mmapped chunks, thread stacks, pymalloc's arenas, other mmap users), and
    ``thread_heaps`` (their count). Empty when the process is gone."""
    kinds = {"smaps_main_heap": 0, "smaps_thread_heaps": 0, "smaps_other_anon": 0}
    heaps = 0
    current: str | None = None
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return {}
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            path = head[5] if len(head) == 6 else ""
            if path == "[heap]":
                current = "smaps_main_heap"
            elif not path:
                if lo % GLIBC_HEAP_MAX == 0 and hi - lo <= GLIBC_HEAP_MAX and head[1].startswith("rw"):
                    current = "smaps_thread_heaps"
                    heaps += 1
                else:
                    current = "smaps_other_anon"
            else:
                current = None
        elif current is not None and line.startswith("Anonymous:"):
            kinds[current] += int(line.split()[1])
    return {**{k: round(v / 1024.0, 2) for k, v in kinds.items()}, "thread_heaps": float(heaps)}


_ORT_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(\.\d+)? "
                           r"\[I:onnxruntime:[^\]]*bfc_arena\.cc:\d+ Extend\] Extended allocation by (\d+) bytes")


def ort_arena_series(log_path: Path, t0_wall: float) -> list[tuple[float, float]]:
    """(seconds after ``t0_wall``, MiB) of every onnxruntime BFC arena extension in a server log written with
    heap debugging (deploy.heap_debug.log_onnxruntime_arena): the arenas' total size after each one (all the
    arenas of the log's processes together; onnxruntime's arenas never shrink unless configured to). Times are
    the log's local wall-clock times; extensions before ``t0_wall`` get negative times."""
    out: list[tuple[float, float]] = []
    total = 0
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        m = _ORT_LOG_TIME.match(line)
        if m is None:
            continue
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + float(m.group(2) or 0.0)
        total += int(m.group(3))
        out.append((round(t - t0_wall, 3), total / 2**20))
    return out


class MemorySampler(threading.Thread):
    """Samples the tree of ``root`` every ``period_s`` until :meth:`stop`; ``heap()`` (optional) returns
    pid -> traced Python heap in MiB (read from the model's ``hybrid_llm_python_heap_bytes`` gauge), or
    pid -> (that, tracemalloc's own memory from ``hybrid_llm_tracemalloc_overhead_bytes``)."""

    def __init__(self, root: int, period_s: float, heap: HeapReader | None = None,
                 alloc: AllocReader | None = None, smaps: bool = False) -> None:
        super().__init__(name="soak-memory", daemon=True)
        self.root, self.period_s, self.heap = root, period_s, heap
        self.alloc, self.smaps = alloc, smaps  # heap debugging: allocator figures per stub
        self.samples: list[Sample] = []
        self.t0, self.t0_wall = time.monotonic(), time.time()
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def sample(self) -> Sample | None:
        tree = process_tree(self.root)
        if not tree:
            return None
        status = {f"{process_name(p)}:{p}": status_kib(p, ("VmRSS", "RssAnon", "RssShmem")) for p in sorted(tree)}
        per = {k: round(v.get("VmRSS", 0) / 1024.0, 2) for k, v in status.items()}
        split = {k: (round(v.get("RssAnon", 0) / 1024.0, 2), round(v.get("RssShmem", 0) / 1024.0, 2))
                 for k, v in status.items()}
        heap: dict[str, float] = {}
        overhead: dict[str, float] = {}
        if self.heap is not None:
            with contextlib.suppress(Exception):  # a late or unanswered scrape only loses this reading
                for k, v in self.heap().items():
                    traced, own = v if isinstance(v, tuple) else (v, None)
                    heap[k] = round(traced, 3)
                    if own is not None:
                        overhead[k] = round(own, 3)
        alloc: dict[str, dict[str, float]] = {}
        if self.smaps:
            for k in per:
                if k.startswith("stub:"):
                    alloc[k] = anon_by_kind(int(k.partition(":")[2]))
        if self.alloc is not None:
            with contextlib.suppress(Exception):
                for k, v in self.alloc().items():
                    alloc.setdefault(k, {}).update(v)
        s = Sample(round(time.monotonic() - self.t0, 1), round(sum(per.values()), 2), per, heap, split, overhead,
                   {k: v for k, v in alloc.items() if v})
        with self._lock:
            self.samples.append(s)
        return s

    def run(self) -> None:
        while not self._halt.is_set():
            t = time.monotonic()
            self.sample()
            self._halt.wait(max(0.0, self.period_s - (time.monotonic() - t)))

    def stop(self) -> list[Sample]:
        self._halt.set()
        if self.is_alive():
            self.join(self.period_s + 10)
        with self._lock:
            return list(self.samples)


# ---- fit and verdict ------------------------------------------------------------------------------------

def theil_sen(points: Sequence[tuple[float, float]], max_points: int = 800) -> float:
    """Median of the pairwise slopes (y per x) of ``points``; evenly thinned to ``max_points`` first."""
    if len(points) > max_points:
        step = len(points) / max_points
        points = [points[int(i * step)] for i in range(max_points)]
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 != x1]
    if not slopes:
        raise ValueError("a slope needs two points at different times")
    return statistics.median(slopes)


def least_squares(points: Sequence[tuple[float, float]]) -> float:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        raise ValueError("a slope needs two points at different times")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


@dataclass(frozen=True, slots=True)
class Growth:
    """The growth of one series after ``settle_s``: slopes in MiB/h and the verdict against the budget."""

    name: str
    points: int
    window_s: float
    first_mib: float  # median of the window's first tenth
    last_mib: float  # median of its last tenth
    peak_mib: float
    slope_mib_h: float  # Theil-Sen
    lsq_slope_mib_h: float
    budget_mib_h: float  # the stated budget, or floor_mib per window when the window is short
    ok: bool

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]

    def line(self) -> str:
        return (f"{self.name}: slope {self.slope_mib_h:+.2f} MiB/h (least squares {self.lsq_slope_mib_h:+.2f}) over "
                f"{self.window_s / 60:.1f} min after warm-up ({self.points} samples), {self.first_mib:.1f} -> "
                f"{self.last_mib:.1f} MiB, peak {self.peak_mib:.1f}; budget {self.budget_mib_h:.2f} MiB/h")


def effective_budget(budget_mib_h: float, floor_mib: float, window_s: float) -> float:
    """``budget_mib_h``, or the slope that gives ``floor_mib`` over the window when that is larger."""
    return max(budget_mib_h, floor_mib * HOUR / window_s) if window_s > 0 else float("inf")


def growth_verdict(name: str, series: Sequence[tuple[float, float]], settle_s: float, budget_mib_h: float,
                   floor_mib: float) -> Growth | None:
    """Fit ``series`` ((seconds, MiB) pairs) after ``settle_s``; None when fewer than 4 points remain."""
    pts = sorted((t, v) for t, v in series if t >= settle_s)
    if len(pts) < 4 or pts[-1][0] <= pts[0][0]:
        return None
    window = pts[-1][0] - pts[0][0]
    slope = theil_sen(pts) * HOUR
    budget = effective_budget(budget_mib_h, floor_mib, window)
    tenth = max(1, len(pts) // 10)
    return Growth(name, len(pts), round(window, 1), round(statistics.median(v for _, v in pts[:tenth]), 2),
                  round(statistics.median(v for _, v in pts[-tenth:]), 2), round(max(v for _, v in pts), 2),
                  round(slope, 3), round(least_squares(pts) * HOUR, 3), round(budget, 3), slope <= budget)


def series_of(samples: Sequence[Sample], key: str | None = None, heap: bool = False,
              part: int | None = None, tracemalloc: bool = False) -> list[tuple[float, float]]:
    """(t, MiB) of the tree total (``key`` None), of one process ``key``, with ``heap`` of one heap, with
    ``tracemalloc`` of tracemalloc's own memory in one stub, or with ``part`` (0 anonymous, 1 shared memory) of
    that part of one process's RSS."""
    out = []
    for s in samples:
        if tracemalloc:
            if key in s.tracemalloc_mib:
                out.append((s.t_s, s.tracemalloc_mib[key]))
        elif part is not None:
            if key in s.split_mib:
                out.append((s.t_s, s.split_mib[key][part]))
        elif heap:
            if key in s.heap_mib:
                out.append((s.t_s, s.heap_mib[key]))
        elif key is None:
            out.append((s.t_s, s.total_mib))
        elif key in s.rss_mib:
            out.append((s.t_s, s.rss_mib[key]))
    return out


def value_at(series: Sequence[tuple[float, float]], t_s: float, around: int = 2) -> float | None:
    """Median of the ``2 * around + 1`` points of ``series`` nearest to ``t_s`` in order (None when empty)."""
    if not series:
        return None
    i = min(range(len(series)), key=lambda j: abs(series[j][0] - t_s))
    return statistics.median(v for _, v in series[max(0, i - around):i + around + 1])


def step_at(series: Sequence[tuple[float, float]], t_s: float) -> float:
    """The last value of a step series (such as :func:`ort_arena_series`) at or before ``t_s`` (0 before any)."""
    out = 0.0
    for t, v in series:
        if t > t_s:
            break
        out = v
    return out


def allocator_report(samples: Sequence[Sample], settle_s: float,
                     ort_arena: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """Each stub's allocator figures (heap debugging: :func:`anon_by_kind`, the model's ``malloc_info`` gauges)
    at the first sample, at ``settle_s`` and at the end (medians of 5 samples) with their Theil-Sen slope after
    ``settle_s``; and onnxruntime's arena total from the server log at the same times, with its extensions
    after ``settle_s``. Empty without heap debugging."""
    out: dict[str, Any] = {}
    end = samples[-1].t_s if samples else 0.0
    start = samples[0].t_s if samples else 0.0
    for key in sorted({k for s in samples for k in s.alloc_mib}):
        figures: dict[str, Any] = {}
        for name in sorted({n for s in samples for n in s.alloc_mib.get(key, {})}):
            series = [(s.t_s, s.alloc_mib[key][name]) for s in samples if name in s.alloc_mib.get(key, {})]
            after = [(t, v) for t, v in series if t >= settle_s]
            slope = theil_sen(after) * HOUR if len(after) >= 4 and after[-1][0] > after[0][0] else None
            figures[name] = {"start": value_at(series, start), "settle": value_at(series, settle_s),
                             "end": value_at(series, end), "slope_mib_h": None if slope is None else round(slope, 3)}
        out[key] = figures
    if ort_arena:
        later = [(t, v) for t, v in ort_arena if t >= settle_s]
        out["onnxruntime_arena"] = {"start": round(step_at(ort_arena, start), 2),
                                    "settle": round(step_at(ort_arena, settle_s), 2),
                                    "end": round(step_at(ort_arena, end), 2), "extensions": len(ort_arena),
                                    "extensions_after_settle": len(later),
                                    "last_extension_t_s": ort_arena[-1][0]}
    return out


def summary_rows(samples: Sequence[Sample], rows: int = 12) -> list[Sample]:
    """About ``rows`` evenly spaced samples (first and last included) for a printed table."""
    if len(samples) <= rows:
        return list(samples)
    step = (len(samples) - 1) / (rows - 1)
    return [samples[round(i * step)] for i in range(rows)]


def write_csv(samples: Sequence[Sample], path: Path) -> None:
    """One row per sample: t_s, total_mib, then RSS per process, heap per stub, then the anonymous and shared
    parts of each process's RSS, then tracemalloc's own memory per stub (when exported; empty when absent), then
    each stub's allocator figures (``<figure>:<stub>``, heap debugging)."""
    procs = sorted({k for s in samples for k in s.rss_mib})
    heaps = sorted({k for s in samples for k in s.heap_mib})
    tms = sorted({k for s in samples for k in s.tracemalloc_mib})
    allocs = sorted({(k, n) for s in samples for k, v in s.alloc_mib.items() for n in v})
    lines = [",".join(["t_s", "total_rss_mib", *(f"rss_mib:{p}" for p in procs), *(f"heap_mib:{h}" for h in heaps),
                       *(f"{part}_mib:{p}" for p in procs for part in ("anon", "shmem")),
                       *(f"tracemalloc_mib:{t}" for t in tms), *(f"{n}:{k}" for k, n in allocs)])]
    for s in samples:
        split = [f"{s.split_mib[p][i]:g}" if p in s.split_mib else "" for p in procs for i in (0, 1)]
        lines.append(",".join([f"{s.t_s:g}", f"{s.total_mib:g}", *(f"{s.rss_mib[p]:g}" if p in s.rss_mib else ""
                                                                   for p in procs),
                               *(f"{s.heap_mib[h]:g}" if h in s.heap_mib else "" for h in heaps), *split,
                               *(f"{s.tracemalloc_mib[t]:g}" if t in s.tracemalloc_mib else "" for t in tms),
                               *(f"{s.alloc_mib[k][n]:g}" if n in s.alloc_mib.get(k, {}) else ""
                                 for k, n in allocs)]))
    path.write_text("\n".join(lines) + "\n")


# ---- the soak's memory checks -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Plan:
    """How a soak samples and judges memory (all times in seconds)."""

    sample_s: float  # sampling period
    settle_s: float  # the fit starts this long after warm-up
    budget_mib_h: float  # allowed growth slope
    floor_mib: float  # ... but never less than this much fitted growth over the window
    heap_snapshot_s: int  # heap snapshots period in the model (heap debugging)

    @classmethod
    def for_duration(cls, duration_s: float, sample_s: float = 0.0, settle_s: float = -1.0, budget_mib_h: float = 1.0,
                     floor_mib: float = 1.0, heap_snapshot_s: int = 0) -> Plan:
        """Defaults from the run's length: a sample every duration/360 s (1..10 s), the fit after the first
        20 % of the run (at most 10 minutes), a heap snapshot every duration/12 s (10..600 s)."""
        return cls(sample_s or min(10.0, max(1.0, duration_s / 360)),
                   settle_s if settle_s >= 0 else min(600.0, 0.2 * duration_s), budget_mib_h, floor_mib,
                   heap_snapshot_s or int(min(600, max(10, duration_s // 12))))

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]


@dataclass(slots=True)
class Report:
    """The memory part of a soak verdict: checks as (name, ok, detail), data for the JSON, text lines."""

    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)


def heap_report(directory: Path, t0_wall: float, settle_s: float, top: int = 10) -> dict[str, Any]:
    """Compare each stub's heap snapshots: the first one after ``settle_s`` with the last one (top sites by
    line and by traceback), and every interval's traced total. Snapshot times are seconds after ``t0_wall``."""
    from deploy.heap_debug import compare, snapshot_files

    out: dict[str, Any] = {}
    files = snapshot_files(directory)
    for pid in sorted({f.pid for f in files}):
        mine = [f for f in files if f.pid == pid]
        after = [f for f in mine if f.mtime - t0_wall >= settle_s] or mine[-1:]
        base, last = after[0], mine[-1]
        entry: dict[str, Any] = {"snapshots": len(mine), "base": base.path.name,
                                 "base_t_s": round(base.mtime - t0_wall, 1), "last": last.path.name,
                                 "last_t_s": round(last.mtime - t0_wall, 1)}
        if last.seq > base.seq:
            total, by_line = compare(base.path, last.path, top, "lineno")
            _, by_stack = compare(base.path, last.path, max(3, top // 2), "traceback")
            entry |= {"diff_bytes": total, "top_by_line": [_grower(g) for g in by_line],
                      "top_by_traceback": [_grower(g) for g in by_stack]}
            steps = []
            for a, b in itertools.pairwise(after):
                diff, grow = compare(a.path, b.path, 1, "lineno")
                steps.append({"t_s": round(b.mtime - t0_wall, 1), "diff_bytes": diff,
                              "top": _grower(grow[0]) if grow else None})
            entry["intervals"] = steps
        out[f"stub:{pid}"] = entry
    return out


def _grower(g: Any) -> dict[str, Any]:
    return {"where": g.where, "size_diff": g.size_diff, "count_diff": g.count_diff, "size": g.size, "count": g.count}


# Triton 2.51's gRPC frontend keeps ~5-6 KB (heaptrack: 5.7 KB) for a stream cancelled right after its final
# response when it loses the race described in deploy/README.md; not every late cancel loses it.
LATE_CANCEL_LEAK_KIB = 6.0


@dataclass(frozen=True, slots=True)
class Allowance:
    """Growth the tree's budget allows for a known upstream leak: ``mib_h`` MiB per hour, and why."""

    mib_h: float
    reason: str

    @classmethod
    def late_cancels(cls, count: int, duration_s: float) -> Allowance:
        """The bound of Triton 2.51's late-cancel leak for ``count`` late cancels sent over ``duration_s``."""
        if count <= 0 or duration_s <= 0:
            return cls(0.0, "")
        rate = count * LATE_CANCEL_LEAK_KIB / 1024.0 * HOUR / duration_s
        return cls(round(rate, 3), f"{count} late cancels x {LATE_CANCEL_LEAK_KIB:g} KiB (Triton 2.51's gRPC frontend "
                                   f"leak, deploy/README.md) = {rate:.2f} MiB/h")


def soak_report(samples: Sequence[Sample], plan: Plan, start_mib: float, end_mib: float, ratio: float,
                floor_jump_mib: float, heap_dir: Path | None = None, t0_wall: float = 0.0,
                allowance: Allowance | None = None, ort_arena: Sequence[tuple[float, float]] = ()) -> Report:
    """Every memory check of a soak: the end RSS within max(ratio x start, start + floor_jump_mib) (a jump),
    the RSS growth slope of the tree within the plan's budget plus ``allowance`` (the bound of a known upstream
    leak the run provoked, which only the tritonserver process can show), each stub's RSS slope within the
    plan's budget alone (the project's own process), and each stub's traced Python heap slope within it when
    the model exported it (heap debugging); with ``heap_dir``, the heap snapshots compared as well. Allocator
    figures (heap debugging; ``ort_arena``: :func:`ort_arena_series`) are reported, not checked."""
    rep = Report()
    allowance = allowance or Allowance(0.0, "")
    bound = max(start_mib * ratio, start_mib + floor_jump_mib)
    peak = max([end_mib, start_mib, *(s.total_mib for s in samples)])
    rep.checks.append(("memory: end RSS within bound", end_mib <= bound,
                       f"{start_mib:.1f} MiB after warm-up -> {end_mib:.1f} MiB at the end (peak {peak:.1f}); bound "
                       f"max(x{ratio}, +{floor_jump_mib:.0f} MiB) = {bound:.1f} MiB"))
    total = growth_verdict("RSS of the tritonserver tree", series_of(samples), plan.settle_s,
                           plan.budget_mib_h + allowance.mib_h, plan.floor_mib)
    budget_text = (f"budget {plan.budget_mib_h:g} MiB/h, at least {plan.floor_mib:g} MiB over the window; "
                   f"fit after the first {plan.settle_s:.0f} s")
    tree_text = budget_text + (f"; the tree's budget includes {allowance.reason}" if allowance.mib_h else "")
    if total is None:
        rep.checks.append(("memory: RSS growth slope within budget", False,
                           f"only {len(samples)} samples: too few after {plan.settle_s:.0f} s to fit a slope"))
    else:
        rep.checks.append(("memory: RSS growth slope within budget", total.ok, f"{total.line()} ({tree_text})"))
    per_process = {}
    for key in sorted({k for s in samples for k in s.rss_mib}):
        g = growth_verdict(f"RSS {key}", series_of(samples, key), plan.settle_s, plan.budget_mib_h, plan.floor_mib)
        if g is not None:
            per_process[key] = g.as_dict()
            if key.startswith("stub:"):  # the model's process: no allowance
                rep.checks.append((f"memory: RSS growth slope of {key} within budget", g.ok,
                                   f"{g.line()} ({budget_text})"))
            for part, label in ((0, "anon"), (1, "shmem")):
                gp = growth_verdict(f"{label} {key}", series_of(samples, key, part=part), plan.settle_s,
                                    plan.budget_mib_h, plan.floor_mib)
                if gp is not None:
                    per_process[key][f"{label}_slope_mib_h"] = gp.slope_mib_h
                    per_process[key][f"{label}_last_mib"] = gp.last_mib
    heaps = {}
    for key in sorted({k for s in samples for k in s.heap_mib}):
        g = growth_verdict(f"Python heap {key}", series_of(samples, key, heap=True), plan.settle_s,
                           plan.budget_mib_h, plan.floor_mib)
        if g is None:
            continue
        heaps[key] = g.as_dict()
        # tracemalloc's own memory: in the stub's RSS, not in its traced heap (a cost of heap debugging, no check)
        gt = growth_verdict(f"tracemalloc {key}", series_of(samples, key, tracemalloc=True), plan.settle_s,
                            plan.budget_mib_h, plan.floor_mib)
        if gt is not None:
            heaps[key]["tracemalloc_slope_mib_h"] = gt.slope_mib_h
            heaps[key]["tracemalloc_last_mib"] = gt.last_mib
        rep.checks.append((f"memory: Python heap of {key} within budget", g.ok, f"{g.line()} ({budget_text})"))
    rep.data = {"start_mib": round(start_mib, 1), "end_mib": round(end_mib, 1), "peak_mib": round(peak, 1),
                "bound_mib": round(bound, 1), "plan": plan.as_dict(),
                "allowance": {"mib_h": allowance.mib_h, "reason": allowance.reason},
                "growth": None if total is None else total.as_dict(), "per_process": per_process,
                "python_heap": heaps, "samples": len(samples),
                "series": [[s.t_s, s.total_mib, s.rss_mib, s.heap_mib] for s in summary_rows(samples, 24)],
                "allocators": allocator_report(samples, plan.settle_s, ort_arena)}
    if heap_dir is not None and heap_dir.is_dir():
        try:
            rep.data["heap_snapshots"] = heap_report(heap_dir, t0_wall, plan.settle_s)
        except Exception as e:  # a broken snapshot must not hide the other checks
            rep.data["heap_snapshots"] = {"error": f"{type(e).__name__}: {e}"}
    rep.lines = render(rep.data)
    return rep


def render(data: dict[str, Any]) -> list[str]:
    """The memory lines of the printed verdict: the series (about 12 rows), the slopes, heap growers."""
    lines = []
    series = data.get("series") or []
    if series:
        procs = sorted({k for row in series for k in row[2]})
        heaps = sorted({k for row in series for k in row[3]})
        head = f"  {'t (s)':>8s} {'tree':>8s} " + " ".join(f"{p:>18s}" for p in procs) + \
            "".join(f" {'heap ' + h:>18s}" for h in heaps)
        lines += ["memory series (RSS MiB; Python heap MiB with heap debugging; all samples in soak_memory.csv):",
                  head]
        step = max(1, len(series) // 12)
        for row in series[::step] + ([series[-1]] if (len(series) - 1) % step else []):
            lines.append(f"  {row[0]:8.0f} {row[1]:8.1f} " + " ".join(f"{row[2].get(p, float('nan')):18.1f}"
                                                                  for p in procs)
                         + "".join(f" {row[3].get(h, float('nan')):18.2f}" for h in heaps))
    g = data.get("growth")
    if g:
        allow = (data.get("allowance") or {}).get("mib_h") or 0.0
        lines.append(f"memory growth: tree {g['slope_mib_h']:+.2f} MiB/h (budget {g['budget_mib_h']:.2f}"
                     + (f", of which {allow:.2f} for Triton's late-cancel leak" if allow else "") + "); "
                     + "; ".join(f"{k} {v['slope_mib_h']:+.2f} (anon {v.get('anon_slope_mib_h', float('nan')):+.2f}, "
                                 f"shmem {v.get('shmem_slope_mib_h', float('nan')):+.2f})"
                                 for k, v in data.get("per_process", {}).items())
                     + "".join(f"; heap {k} {v['slope_mib_h']:+.3f} MiB/h" + (
                         f" (tracemalloc's own memory {v['tracemalloc_slope_mib_h']:+.3f} MiB/h, "
                         f"{v['tracemalloc_last_mib']:.1f} MiB at the end)" if "tracemalloc_slope_mib_h" in v else "")
                               for k, v in data.get("python_heap", {}).items()))
    allocators = data.get("allocators") or {}
    for key, figures in allocators.items():
        if key == "onnxruntime_arena":
            lines.append(f"onnxruntime arena (server log): {figures['start']:.1f} MiB at the first sample, "
                         f"{figures['settle']:.1f} after settling, {figures['end']:.1f} at the end; "
                         f"{figures['extensions_after_settle']} of {figures['extensions']} extensions after settling")
            continue
        lines.append(f"allocators of {key} (MiB: first sample / after settling / end, slope after settling):")
        for name, f in figures.items():
            slope = "" if f["slope_mib_h"] is None else f", {f['slope_mib_h']:+.2f} MiB/h"
            lines.append(f"    {name:34s} {f['start']:8.2f} {f['settle']:8.2f} {f['end']:8.2f}{slope}")
    for key, h in (data.get("heap_snapshots") or {}).items():
        if not isinstance(h, dict) or "diff_bytes" not in h:
            continue
        lines.append(f"heap snapshots of {key}: {h['base']} (t={h['base_t_s']} s) -> {h['last']} "
                     f"(t={h['last_t_s']} s): {h['diff_bytes'] / 1024:+.1f} KiB traced; top growth by line:")
        for gr in h["top_by_line"][:5]:
            lines.append(f"    {gr['size_diff'] / 1024:+9.1f} KiB {gr['count_diff']:+7d} blocks  {gr['where']}")
    return lines
