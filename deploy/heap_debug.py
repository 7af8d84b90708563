"""Heap debugging inside the model's process (the Python-backend stub), for soaks that look for growth.

With config.pbtxt's ``heap_debug_dir`` set, the model starts :mod:`tracemalloc` at the top of
``initialize`` (so everything the model allocates is traced, numpy buffers included: numpy reports its
data allocations to tracemalloc), exports the traced size as a gauge and writes a snapshot to
``<dir>/heap-<pid>-<seq>.tracemalloc`` every ``period_s``. ``python -m loadtests.soak`` compares them
(:func:`compare`). Off by default: tracing costs CPU on every Python allocation and memory per block.

A snapshot copies every trace into Python objects (hundreds of MiB transiently in a soak's stub). Taken in the
stub itself, it left its mark on the stub's RSS even with :func:`release_free_heap` after it: 2-5 MiB at each
of the first snapshots (issue 21: the CPU soak's stub grew 23 MiB in its first hour, in steps within 30 s of
each snapshot, its traced heap flat; with ``MALLOC_ARENA_MAX=1`` the steps landed in glibc's main arena and in
pymalloc's 1 MiB arenas, i.e. memory the snapshot's objects left pinned). So the snapshot is taken in a forked
child (``fork=True``, the default where ``os.fork`` exists): the child has a copy of tracemalloc's tables, writes
the file and exits, and the stub's own heap never sees the snapshot's objects. The child is killed after
``child_timeout_s`` (a lock another thread held at the fork would hang it) and the snapshot skipped.

Which native allocator holds what tracemalloc cannot see (issue 21: the CPU stub's first-hour growth with its
Python heap flat): :func:`malloc_stats` reads glibc's ``malloc_info`` (each arena's size and free memory, the
mmapped chunks), exported beside the heap gauges; :func:`log_onnxruntime_arena` turns on onnxruntime's INFO log,
whose BFC arena prints every extension ("Extended allocation by N bytes") into the server log, where the soak
adds them up (``loadtests.memory.ort_arena_series``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import importlib.util
import logging
import os
import threading
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from hybrid_runtime.host_memory import release_free_heap

log = logging.getLogger("deploy.heap_debug")

SNAPSHOT_GLOB = "heap-*.tracemalloc"
SNAPSHOT_COMM = "hybrid-heapsnap"  # the forked snapshot child's name (/proc/<pid>/comm): the soak skips it
_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_info") or not hasattr(libc, "open_memstream"):
        return None
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.malloc_info.argtypes, libc.malloc_info.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int
    libc.fclose.argtypes, libc.free.argtypes = [ctypes.c_void_p], [ctypes.c_void_p]
    return libc


def malloc_info_xml() -> str | None:
    """glibc's ``malloc_info(0, ...)`` document for this process, or None where there is no glibc."""
    libc = _libc()
    if libc is None:
        return None
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return None
    try:
        libc.malloc_info(0, stream)
    finally:
        libc.fclose(stream)  # flushes: buf and size are valid after it
    try:
        return ctypes.string_at(buf, size.value).decode(errors="replace")
    finally:
        libc.free(buf)


def parse_malloc_info(xml: str) -> dict[str, float]:
    """Byte figures of a ``malloc_info`` document: ``malloc_arenas`` (count), ``malloc_main_arena_bytes`` (the
    main arena's heap), ``malloc_thread_arenas_bytes`` (the other arenas' heaps together; glibc gives a thread
    its own arena, carved from 64 MiB-reserved mappings), ``malloc_largest_thread_arena_bytes``,
    ``malloc_free_bytes`` (free chunks in all arenas: memory glibc holds but nothing uses),
    ``malloc_mmap_bytes`` / ``malloc_mmap_chunks`` (blocks above the mmap threshold, each its own mapping) and
    ``malloc_in_use_bytes`` (arenas plus mmapped minus free: what the program holds through malloc)."""
    root = ElementTree.fromstring(xml)
    heaps = [int(h.find("system[@type='current']").get("size", 0)) for h in root.findall("heap")]
    top = {(e.tag, e.get("type")): e for e in root if e.tag in ("total", "system")}

    def size(tag: str, kind: str, attr: str = "size") -> int:
        e = top.get((tag, kind))
        return int(e.get(attr, 0)) if e is not None else 0

    free = size("total", "fast") + size("total", "rest")
    arenas = sum(heaps)
    return {"malloc_arenas": float(len(heaps)), "malloc_main_arena_bytes": float(heaps[0] if heaps else 0),
            "malloc_thread_arenas_bytes": float(sum(heaps[1:])),
            "malloc_largest_thread_arena_bytes": float(max(heaps[1:], default=0)),
            "malloc_free_bytes": float(free), "malloc_mmap_bytes": float(size("total", "mmap")),
            "malloc_mmap_chunks": float(size("total", "mmap", "count")),
            "malloc_in_use_bytes": float(arenas + size("total", "mmap") - free)}


def malloc_stats() -> dict[str, float]:
    """:func:`parse_malloc_info` of this process now (empty where there is no glibc). It walks every arena's
    free lists under that arena's lock: call it every few seconds, not per request."""
    xml = malloc_info_xml()
    if xml is None:
        return {}
    try:
        return parse_malloc_info(xml)
    except (ElementTree.ParseError, ValueError, TypeError):
        return {}


def log_onnxruntime_arena() -> bool:
    """onnxruntime's default logger at INFO (its BFC arena logs each extension to stderr, i.e. the server log);
    False where onnxruntime is not installed. Session loggers keep their own level (warnings only)."""
    if importlib.util.find_spec("onnxruntime") is None:
        return False
    import onnxruntime

    onnxruntime.set_default_logger_severity(1)
    return True


class HeapMonitor:
    """tracemalloc with ``frames`` frames per trace, a snapshot every ``period_s`` into ``directory``.

    :meth:`stats` is cheap (two counters) and safe from any thread; snapshots are taken on this monitor's
    own thread (each one holds the GIL for as long as it takes to copy the traces).
    """

    def __init__(self, directory: Path, period_s: float = 300.0, frames: int = 12, malloc_period_s: float = 10.0,
                 onnxruntime_arena_log: bool = False, fork: bool = hasattr(os, "fork"),
                 child_timeout_s: float = 300.0) -> None:
        if period_s <= 0:
            raise ValueError("period_s must be > 0")
        self.directory, self.period_s, self.frames = Path(directory), period_s, frames
        self.fork, self.child_timeout_s = fork, child_timeout_s
        self.malloc_period_s, self.onnxruntime_arena_log = malloc_period_s, onnxruntime_arena_log
        self._malloc: tuple[float, dict[str, float]] = (-float("inf"), {})
        self.snapshots = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HeapMonitor:
        self.directory.mkdir(parents=True, exist_ok=True)
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        if self.onnxruntime_arena_log and not log_onnxruntime_arena():
            log.warning("heap debugging: onnxruntime is not installed, its arena is not logged")
        self._thread = threading.Thread(target=self._run, name="hybrid-heap-debug", daemon=True)
        self._thread.start()
        log.warning("heap debugging on: tracemalloc (%d frames), snapshots every %.0f s into %s",
                    self.frames, self.period_s, self.directory)
        return self

    def stats(self) -> dict[str, float]:
        """Bytes traced now, their peak, tracemalloc's own memory (not part of the traced size), and glibc's
        figures (:func:`malloc_stats`, read at most every ``malloc_period_s``)."""
        if not tracemalloc.is_tracing():
            return {}
        current, peak = tracemalloc.get_traced_memory()
        now = time.monotonic()
        if now - self._malloc[0] >= self.malloc_period_s:
            self._malloc = (now, malloc_stats())
        return {"python_heap_bytes": float(current), "python_heap_peak_bytes": float(peak),
                "tracemalloc_overhead_bytes": float(tracemalloc.get_tracemalloc_memory()), **self._malloc[1]}

    def snapshot(self) -> Path:
        """Write one snapshot now (atomically: a reader never sees half a file); returns its path. With ``fork``
        it is taken in a child process (see the module's docstring); TimeoutError / RuntimeError when that child
        hangs or fails (no file is written then)."""
        self.snapshots += 1
        path = self.directory / f"heap-{os.getpid()}-{self.snapshots:05d}.tracemalloc"
        tmp = path.with_suffix(".partial")
        t0 = time.perf_counter()
        if self.fork:
            self._snapshot_in_child(tmp)
            tmp.replace(path)
            log.info("heap snapshot %s (forked child): %.1f MiB in %.2f s", path.name, path.stat().st_size / 2**20,
                     time.perf_counter() - t0)
            return path
        snap = tracemalloc.take_snapshot()
        snap.dump(str(tmp))
        tmp.replace(path)
        n = len(snap.traces)
        del snap
        gc.collect()
        release_free_heap()  # the snapshot's transient objects must not stay in the stub's RSS
        log.info("heap snapshot %s: %d traces in %.2f s", path.name, n, time.perf_counter() - t0)
        return path

    def _snapshot_in_child(self, tmp: Path) -> None:
        """Fork; the child (only this thread) writes the snapshot to ``tmp`` and leaves with ``os._exit``, never
        returning into the stub's code (no atexit handler, no destructor of the parent's objects runs in it)."""
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with contextlib.suppress(OSError, AttributeError):
                    libc = ctypes.CDLL(None)
                    libc.prctl(_PR_SET_PDEATHSIG, 9)  # SIGKILL: never outlive the stub
                    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(SNAPSHOT_COMM.encode()))
                tracemalloc.take_snapshot().dump(str(tmp))
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + self.child_timeout_s
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                tmp.unlink(missing_ok=True)
                raise TimeoutError(f"heap snapshot child {pid} still running after {self.child_timeout_s:.0f} s: "
                                   f"killed, snapshot skipped")
            time.sleep(0.05)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or not tmp.exists():
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"heap snapshot child {pid} exited with {code}")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.snapshot()
            except Exception as e:  # debugging must never take the model down
                log.warning("heap snapshot failed: %s", e)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        tracemalloc.stop()


# ---- reading snapshots (the soak runner) -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SnapshotFile:
    path: Path
    pid: int
    seq: int
    mtime: float


def snapshot_files(directory: Path) -> list[SnapshotFile]:
    """The snapshots in ``directory``, by pid then sequence number."""
    out = []
    for p in Path(directory).glob(SNAPSHOT_GLOB):
        _, pid, seq = p.stem.split("-")
        out.append(SnapshotFile(p, int(pid), int(seq), p.stat().st_mtime))
    return sorted(out, key=lambda f: (f.pid, f.seq))


def _load(path: Path) -> tracemalloc.Snapshot:
    # tracemalloc's own bookkeeping and the snapshot machinery are not the model's heap
    return tracemalloc.Snapshot.load(str(path)).filter_traces(
        (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")))


@dataclass(frozen=True, slots=True)
class Grower:
    """One allocation site whose traced size changed between two snapshots."""

    where: str  # "file:line" of the allocating frame, or the traceback's frames joined by " <- "
    size_diff: int
    count_diff: int
    size: int
    count: int


def compare(old: Path, new: Path, top: int = 10, key: str = "lineno") -> tuple[int, list[Grower]]:
    """(total traced-size difference in bytes, the ``top`` sites by size growth) between two snapshots.

    ``key`` is tracemalloc's grouping: ``lineno`` (the allocating line) or ``traceback`` (the whole stack).
    """
    a, b = _load(old), _load(new)
    stats = b.compare_to(a, key)
    total = sum(s.size_diff for s in stats)
    growers = []
    for s in sorted(stats, key=lambda s: s.size_diff, reverse=True)[:top]:
        # tracemalloc orders a traceback oldest frame first; the allocating frame is the last
        frames = [f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno}" for f in reversed(s.traceback)]
        where = frames[0] if key == "lineno" else " <- ".join(frames[:6])
        growers.append(Grower(where, s.size_diff, s.count_diff, s.size, s.count))
    return total, growers
