"""Host buffers that are resident from the start.

``np.zeros`` of a large array is ``calloc``: the kernel maps zero pages lazily, and a page enters the
process's resident set only when it is first written. A KV page pool handed out lowest index first is
then touched a little further every time the number of pages in use reaches a new high, and the
serving process's RSS creeps up for hours (a 4-user soak kept finding new highs after 2 hours) until
the whole pool is resident. :func:`resident_zeros` writes every page once at allocation, so the pool's
memory is committed at load — what ``kv_cache_bytes`` asks for is what RSS shows from the first
request on, and growth after warm-up means a leak, not a pool filling up.

``resident_rows`` leaves the rows after the first ``resident_rows`` lazily mapped: for buffers whose last
rows are only touched by code that this process may never run (the state pool's padding-sink row, written
only by padded decode rows of the CUDA kernels, 1 MiB per GDN layer of the 334M benchmark model).
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def resident_zeros(shape: tuple[int, ...] | int, dtype: Any = np.float32,
                   resident_rows: int | None = None) -> np.ndarray:
    """A zero-filled array whose pages are all resident (written once here, not on first use); with
    ``resident_rows``, only those first rows (along axis 0) are, and the rest are zero pages mapped lazily."""
    if resident_rows is None:
        out = np.empty(shape, dtype)
        out.fill(0)
        return out
    out = np.zeros(shape, dtype)  # calloc: untouched pages stay out of the resident set
    out[:resident_rows].fill(0)
    return out


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None. The C library is opened by glibc's soname first: ``ctypes.util`` is
    imported only where that fails, since it imports ``subprocess``, ``shutil``, ``tempfile`` (1.2 MiB of the
    serving process's RSS) and ``find_library`` runs ``ldconfig`` in a child of the serving process."""
    try:
        libc = ctypes.CDLL(_GLIBC)
    except OSError:
        from ctypes.util import find_library

        name = find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
        except OSError:
            libc = None
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_GLIBC = "libc.so.6"


def release_free_heap() -> bool:
    """Return malloc's free memory to the system: glibc's ``malloc_trim(0)``, which walks EVERY arena (the main one
    and the per-thread ones) and gives back the whole free pages inside them, not only the tops. Called without the
    GIL (a ctypes ``CDLL`` function). False where there is no glibc (nothing done)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HeapTrimmer:
    """Calls ``trim`` (default :func:`release_free_heap`) at most once every ``interval_s`` seconds of ``clock``.

    Why (issue 21, docs/soak_2h.md): glibc keeps the memory a thread frees in that thread's arena. After the longest
    request so far, the engine thread's arena held ~5 MiB more free memory than before, resident for the rest of the
    soak: the working set of a past request, not a leak, but indistinguishable from one for a memory-slope verdict
    and for an orchestrator's memory limit. The serving engine's thread calls :meth:`maybe_trim` between steps.
    ``interval_s`` <= 0: never trims. ``trims`` / ``seconds``: how many calls were made and the time they took."""

    def __init__(self, interval_s: float, trim: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = float(interval_s)
        self._trim = trim or release_free_heap
        self._clock = clock
        self._next = clock() + self.interval_s
        self.trims = 0
        self.seconds = 0.0

    def maybe_trim(self) -> bool:
        """Trim when the interval has passed since the last trim (or since construction); True if it trimmed."""
        if self.interval_s <= 0:
            return False
        now = self._clock()
        if now < self._next:
            return False
        t0 = time.perf_counter()
        done = self._trim()
        self.seconds += time.perf_counter() - t0
        self._next = self._clock() + self.interval_s
        if done:
            self.trims += 1
        return done
