"""onnxruntime plumbing shared by the CPU backend's sessions (engine segments and the CPU operators).

* One intra-op thread pool for the whole process. A bundle is dozens of sessions (one per segment, plus
  the operators' own), run one after the other; with a pool per session every session's workers spin on
  the same two cores after its run, and a decode step of the 334M benchmark model took 295 ms of segment
  time instead of 24 ms (measured on the 2-core CI machine); per-session pools that stop spinning after
  each run (``session.force_spinning_stop``) pay a wake-up on every run instead (a b1 decode step 48-82 ms
  vs 38-42 ms with the shared pool, prefill 2.5x slower). The pool is sized by the first
  :func:`session_options` call of the process; later calls that ask for another size get the existing
  pool (logged), since onnxruntime cannot resize it. onnxruntime then refuses sessions of the same
  process that ask for threads of their own (``use_per_session_threads must be false``): every session
  of a process that hosts this runtime has to come from :func:`session_options`.
* One memory arena for the whole process (``session.use_env_allocators``). A session's own arena keeps
  the peak of its intermediate tensors forever; with dozens of sessions that is every segment's
  prefill-sized intermediates at once, so they share one arena that grows to the largest single run.
  It extends by doubling regions (:func:`arena_extend_strategy`: exact-size regions piled up one per new
  tensor size).
* :class:`Binding`: IOBinding that rebinds an input or output only when its buffer, shape or dtype
  changed. Arrays are bound by address, zero-copy (onnxruntime reads and writes their memory at run
  time) and without keeping them alive, so a decode step that reuses the same buffers binds nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Protocol

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as _C

log = logging.getLogger("hybrid_runtime.engine")

_lock = threading.Lock()
_pool_threads: int | None = None  # the size the process-wide pool was created with (0 = onnxruntime's default)


def session_options(intra_op_threads: int | None = 0) -> ort.SessionOptions:
    """Options for a CPU session on the process-wide intra-op pool (``0`` = onnxruntime's default size,
    one thread per physical core; ``None`` = the pool as it is, or the default size if none exists yet).
    Graph optimisation level: extended (workaround ort-cpu-extended-graph-opt)."""
    global _pool_threads
    with _lock:
        if _pool_threads is None:
            _pool_threads = intra_op_threads or 0
            _C.set_global_thread_pool_sizes(_pool_threads, 1)
            try:
                ort.create_and_register_allocator(
                    ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT),
                    ort.OrtArenaCfg(0, arena_extend_strategy(), -1, -1))
            except Exception as e:  # the process registered a CPU allocator of its own: sessions use that one
                log.warning("onnxruntime: shared CPU arena not registered (%s)", e)
        elif intra_op_threads is not None and intra_op_threads != _pool_threads:
            log.warning("onnxruntime: this process's thread pool has %s intra-op threads; a session asked for %s "
                        "(one pool per process, sized by its first session)", _pool_threads or "default",
                        intra_op_threads or "default")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.use_per_session_threads = False
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.use_env_allocators", "1")
    # Memory patterns allocate one block per session and input shape for all of a run's intermediates;
    # dozens of sessions with blocks of different sizes fragmented the shared arena (+67 MB resident after a
    # 16 x 128 prefill of the 334M model). Without them intermediates come from the arena one by one.
    opts.enable_mem_pattern = False
    return opts


# onnxruntime's BFC arena extend strategies
ARENA_NEXT_POWER_OF_TWO, ARENA_SAME_AS_REQUESTED = 0, 1


def arena_extend_strategy() -> int:
    """The shared arena's extend strategy: kNextPowerOfTwo, unless ``HYBRID_LLM_ORT_ARENA_EXTEND=same`` (a diagnostic).

    kSameAsRequested adds a region of exactly the size a run could not fit, and a region never merges with another
    or goes away. Tensors that grow with the sequence (one size larger per step or per longer prompt) then add a new
    region at every new high: a run of Relu/Neg over 550k..774k floats in 8 steps left 40 MiB of regions for a
    6 MiB peak, and the CPU soak's stub grew in bursts of 8-18 MiB of such regions whenever a longer request
    arrived (issue 21: 9.2 -> 21.7 MiB of arena in 30 minutes, settling only after an hour). kNextPowerOfTwo doubles
    each new region, so the same run needs 3 regions (9 MiB) and the arena stops growing after a few
    extensions; regions are mapped lazily, so their untouched part is not resident."""
    return ARENA_SAME_AS_REQUESTED if os.environ.get("HYBRID_LLM_ORT_ARENA_EXTEND") == "same" \
        else ARENA_NEXT_POWER_OF_TWO


class FileMappings:
    """This process's mappings of the files in one folder (onnxruntime memory-maps the initializers it
    keeps as they are, such as an embedding table that Gather reads a row per token).

    :meth:`release` drops their resident pages from the process (``MADV_DONTNEED``; the pages stay in the
    page cache, the next read maps them again). A fault in a file mapping maps the cached folio around the
    row (up to 2 MB), so 1024 random tokens left 50 MB of the 131 MB embedding table of the 334M benchmark
    model resident where their rows are 4 MB. The engine now reads such tables with ``pread``
    (:mod:`.table_rows`) and releases what is still mapped once after loading, and after each run of the
    first segment only if a table stayed in its graph. Safe for read-only use: a private mapping that was
    never written reads back the file's bytes. Linux only; elsewhere it does nothing."""

    def __init__(self, folder: str | Path) -> None:
        self.ranges: list[tuple[int, int]] = []
        self._madvise = None
        try:
            lines = Path("/proc/self/maps").read_text().splitlines()
            self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return
        root = str(Path(folder).resolve()) + "/"
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(root):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if hi - lo >= _MIN_RELEASE:  # the tables; not the few-page leftovers of prepacked weights
                    self.ranges.append((lo, hi - lo))

    def release(self) -> None:
        if self._madvise is not None:
            for lo, n in self.ranges:
                self._madvise(ctypes.c_void_p(lo), ctypes.c_size_t(n), _MADV_DONTNEED)


_MADV_DONTNEED = 4
_MIN_RELEASE = 1 << 20


class SerializableModel(Protocol):
    """An in-memory model: :class:`hybrid_runtime.onnx_proto.Model`, or an ``onnx.ModelProto`` (tests)."""

    def SerializeToString(self) -> bytes: ...


def cpu_session(model: str | Path | bytes | SerializableModel, opts: ort.SessionOptions) -> ort.InferenceSession:
    """An InferenceSession on the CPU execution provider from a path, serialised model bytes or an in-memory
    model."""
    if isinstance(model, str | Path):
        src: str | bytes = str(model)
    else:
        src = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(src, sess_options=opts, providers=["CPUExecutionProvider"])


class Binding:
    """An IOBinding of one session that remembers what is bound and rebinds only on a change.

    Arrays must be C-contiguous numpy arrays on the host; they are read (inputs) or written (outputs) in
    place when :meth:`run` is called; the binding holds them until the run is over, then only their
    addresses, so every run must bind every input and output again (free when unchanged; :meth:`run`
    refuses otherwise rather than read memory that may have been freed).
    """

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session
        self._b = session.io_binding()
        # name ("\0" + name for outputs) -> (weak reference to the array last bound, its address, shape, dtype)
        self._bound: dict[str, tuple[weakref.ref, int, tuple[int, ...], str]] = {}
        self._refs: dict[str, np.ndarray] = {}

    def clear(self) -> None:
        self._b.clear_binding_inputs()
        self._b.clear_binding_outputs()
        self._bound.clear()

    def _bind(self, key: str, arr: np.ndarray) -> bool:
        """Record ``arr`` for ``key``; True when it must be bound (not the very array, or not the same
        memory and shape, as last time). The same live array object is the same memory and shape."""
        self._refs[key] = arr  # alive until the run (a temporary of the caller's would be freed before it)
        last = self._bound.get(key)
        if last is not None and last[0]() is arr and last[2] == arr.shape:  # (an array's shape can be assigned)
            return False
        if not arr.flags.c_contiguous:
            raise ValueError("onnxruntime binding needs a C-contiguous array")
        ptr, shape, dt = arr.ctypes.data, arr.shape, arr.dtype.char
        self._bound[key] = (weakref.ref(arr), ptr, shape, dt)
        return last is None or last[1:] != (ptr, shape, dt)

    def input(self, name: str, arr: np.ndarray) -> None:
        if self._bind(name, arr):
            # By address, not bind_cpu_input: that one keeps a reference to the array until the name is
            # bound again, so each segment would hold on to the prefill-sized operator output it last read
            # (36 MB over the GDN layers of the 334M model).
            self._b.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)

    def output(self, name: str, arr: np.ndarray) -> None:
        if self._bind("\0" + name, arr):
            self._b.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)

    def run(self) -> None:
        if self._refs.keys() != self._bound.keys():  # an address from an earlier round may be freed memory by now
            raise RuntimeError(f"bind every input and output before each run; not this time: "
                               f"{sorted(k.lstrip(chr(0)) for k in self._bound.keys() - self._refs.keys())}")
        try:
            self.session.run_with_iobinding(self._b)
        finally:
            self._refs.clear()  # bindings keep addresses only: nothing is held past the run
