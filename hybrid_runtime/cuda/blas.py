"""GEMMs of the ``cuda`` backend through cuBLASLt, via NVIDIA's maintained binding (``nvmath-python``'s
``nvmath.bindings.cublasLt``, raw device pointers, beside cuda-python).

The one product shape the runtime needs, in row-major terms::

    y[M, N] = x[M, K] @ W[N, K].T  (+ bias[N])  (+ c[M, N])      # W as nn.Linear stores it

with x, W in the weight dtype (bfloat16 / float16 / float32), y and c in the weight dtype or float32, float32
accumulation (``CUBLAS_COMPUTE_32F``: true float32 for float32 operands, never TF32). Rows may be strided
(``ldx`` / ``ldy`` elements between rows), so a GEMM can read or write columns of a wider buffer. In
cuBLASLt's column-major terms that is ``D[N, M] = op(A)[N, K] @ B[K, M]`` with A = W (transposed), B = x.

A :class:`GemmPlan` (descriptors, the chosen algorithm, alpha/beta) is made once per shape and cached; its
:meth:`GemmPlan.run` is one ``cublasLtMatmul`` on the device's stream with a preallocated workspace, so it
can be captured into a CUDA graph. nvmath's high-level ``Matmul.execute`` costs tens of microseconds of
Python per call: it is not used.

``pin_m``: take the algorithm the heuristic picks for ``M = pin_m`` and use it for this (smaller) M too, if
``cublasLtMatmulAlgoCheck`` accepts it. For a fixed algorithm each output row is computed the same way
whatever M is, which is what makes decode steps of different batch sizes give identical rows.

Pinned products share ONE plan per class (``plans_by_class``, the default): the plan of ``M = pin_m``, whose
two M-dependent layouts (x's and y's column count) are set to the call's M before each call that changes it.
The kernel cuBLASLt runs is then the one a plan made for that M with the pinned algorithm would run (same
descriptors but M, same algorithm), so the bits are those of the per-M plans, but a prefill step's new M creates
no descriptors and queries nothing: a served process no longer allocates (and frees) descriptors for nearly
every step. Whether the pinned algorithm accepts an M is asked once per M (``cublasLtMatmulAlgoCheck``) and
remembered in a byte per M; an M it refuses gets a plan of its own from the heuristic, through the LRU cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from .driver import CudaDevice, CudaError

CUDA_R = {"float32": 0, "float16": 2, "bfloat16": 14}
COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F
OP_N, OP_T = 0, 1
EPILOGUE_DEFAULT, EPILOGUE_BIAS = 1, 4


class BlasError(CudaError):
    """A cuBLASLt call failed or no algorithm fits a shape."""


def _lt() -> Any:
    try:
        import nvmath.bindings.cublasLt as lt
    except ImportError as e:  # pragma: no cover - depends on the environment
        import sys

        raise BlasError("import nvmath.bindings.cublasLt", None, "NVMATH_MISSING",
                        f"{e}; install nvmath-python (pip install 'hybrid-llm-serving[cuda]'); this Python "
                        f"({sys.executable}) searched {sys.path}") from e
    return lt


def _call(name: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # cuBLASLtError, or a driver/library problem: typed
        raise BlasError(name, None, type(e).__name__, str(e)) from e


@dataclass(frozen=True)
class GemmShape:
    """What a plan is keyed by."""

    m: int
    n: int
    k: int
    dtype: str  # of x and W
    out_dtype: str  # of y (and c)
    ldx: int
    ldy: int
    accumulate: bool  # y = ... + c
    bias: bool

    def problems(self) -> list[str]:
        r = []
        if min(self.m, self.n, self.k) < 1:
            r.append("empty")
        if self.ldx < self.k or self.ldy < self.n:
            r.append("leading_dim")
        if self.dtype not in CUDA_R or self.out_dtype not in CUDA_R:
            r.append("dtype")
        if self.dtype == "float32" and self.out_dtype != "float32":
            r.append("dtype")
        return r


class GemmPlan:
    """Descriptors and algorithm of one :class:`GemmShape` (see the module docstring)."""

    def __init__(self, blas: Blas, shape: GemmShape, pin_m: int = 0, by_class: bool = False) -> None:
        lt = _lt()
        self.blas, self.shape = blas, shape
        # a class plan (``by_class``, shape.m == the class's pin_m) runs any M <= shape.m: its current M and, per
        # M, 0 = not checked, 1 = the algorithm accepts it, 2 = refused (see the module docstring)
        self.cur_m = shape.m
        self.m_ok = bytearray(shape.m + 1) if by_class else None
        s = shape
        if reasons := s.problems():
            raise BlasError("GemmPlan", None, "CUBLAS_STATUS_INVALID_VALUE", f"{s}: {', '.join(reasons)}")
        self._keep: list[np.ndarray] = []
        self.desc = _call("cublasLtMatmulDescCreate", lt.matmul_desc_create, COMPUTE_32F, CUDA_R["float32"])
        self._set_desc(lt.MatmulDescAttribute.TRANSA, np.int32(OP_T))
        self._set_desc(lt.MatmulDescAttribute.TRANSB, np.int32(OP_N))
        if s.bias:
            self._set_desc(lt.MatmulDescAttribute.EPILOGUE, np.uint32(EPILOGUE_BIAS))
            self._set_desc(lt.MatmulDescAttribute.BIAS_DATA_TYPE, np.int32(CUDA_R[s.out_dtype]))
        wt, ot = CUDA_R[s.dtype], CUDA_R[s.out_dtype]
        self.a = _call("cublasLtMatrixLayoutCreate", lt.matrix_layout_create, wt, s.k, s.n, s.k)
        self.b = self._layout(wt, s.k, s.m, s.ldx)
        self.c = self._layout(ot, s.n, s.m, s.ldy)
        self.alpha = np.ones(1, np.float32)
        self.beta = np.array([1.0 if s.accumulate else 0.0], np.float32)
        self.heuristic = lt.MatmulHeuristicResult(1)
        self.algo_ptr = self.heuristic.ptr  # the algorithm is the first field of the heuristic result
        self.pinned = False
        if pin_m and pin_m != s.m:
            self._ref = ref = blas.plan(GemmShape(pin_m, s.n, s.k, s.dtype, s.out_dtype, max(s.ldx, s.k), s.ldy,
                                                  s.accumulate, s.bias))[0]
            try:
                lt.matmul_algo_check(blas.handle, self.desc, self.a, self.b, self.c, self.c, ref.algo_ptr,
                                     self.heuristic.ptr)
                ok = int(self.heuristic.state) == 0 and int(self.heuristic.workspace_size) <= blas.workspace_bytes
            except Exception:
                ok = False
            if ok:
                self.algo_ptr, self.pinned = ref.algo_ptr, True
                return
            blas.note_pin_failure(s.m, s.n, s.k, pin_m)
        count = np.zeros(1, np.int32)
        _call("cublasLtMatmulAlgoGetHeuristic", lt.matmul_algo_get_heuristic, blas.handle, self.desc, self.a, self.b,
              self.c, self.c, blas.preference, 1, self.heuristic.ptr, count.ctypes.data)
        if int(count[0]) < 1 or int(self.heuristic.state) != 0:
            raise BlasError("cublasLtMatmulAlgoGetHeuristic", None, "CUBLAS_STATUS_NOT_SUPPORTED",
                            f"no algorithm for {s}")

    def _set_desc(self, attr: Any, value: np.generic) -> None:
        buf = np.array([value])
        self._keep.append(buf)
        _call("cublasLtMatmulDescSetAttribute", _lt().matmul_desc_set_attribute, self.desc, attr, buf.ctypes.data,
              buf.nbytes)

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> int:
        return _call("cublasLtMatrixLayoutCreate", _lt().matrix_layout_create, dtype, rows, cols, ld)

    @property
    def workspace_size(self) -> int:
        return int(self.heuristic.workspace_size)

    def _set_m(self, m: int) -> None:
        """Point the M-dependent layouts (x: K x M, y and c: N x M, column-major) at ``m`` rows."""
        if m != self.cur_m:
            lt = _lt()
            buf = np.array([m], np.uint64)
            for lay in (self.b, self.c):
                _call("cublasLtMatrixLayoutSetAttribute", lt.matrix_layout_set_attribute, lay,
                      lt.MatrixLayoutAttribute.COLS, buf.ctypes.data, 8)
            self.cur_m = m

    def accepts(self, m: int) -> bool:
        """Whether this class plan runs ``m`` rows with its algorithm (checked once per M, then remembered)."""
        assert self.m_ok is not None and 1 <= m <= self.shape.m
        if not self.m_ok[m]:
            if m == self.shape.m:
                self.m_ok[m] = 1
            else:
                lt = _lt()
                self._set_m(m)
                probe = lt.MatmulHeuristicResult(1)
                try:
                    lt.matmul_algo_check(self.blas.handle, self.desc, self.a, self.b, self.c, self.c, self.algo_ptr,
                                         probe.ptr)
                    ok = int(probe.state) == 0 and int(probe.workspace_size) <= self.blas.workspace_bytes
                except Exception:
                    ok = False
                self.m_ok[m] = 1 if ok else 2
        return self.m_ok[m] == 1

    def run(self, x: int, w: int, y: int, c: int = 0, bias: int = 0, m: int = 0) -> None:
        """Enqueue ``y = x @ W.T (+ bias) (+ c)`` on the device's stream (pointers are device addresses;
        ``c`` may equal ``y``). ``m``: the rows of this call, for a class plan (default: the plan's M)."""
        lt = _lt()
        s, blas = self.shape, self.blas
        if m and m != s.m and self.m_ok is None:
            raise ValueError(f"{s}: a plan of M = {s.m} cannot run {m} rows (not a class plan)")
        if s.bias:
            if not bias:
                raise ValueError("this plan adds a bias: pass its pointer")
            buf = np.array([bias], np.int64)
            _call("cublasLtMatmulDescSetAttribute", lt.matmul_desc_set_attribute, self.desc,
                  lt.MatmulDescAttribute.BIAS_POINTER, buf.ctypes.data, 8)
        if s.accumulate and not c:
            raise ValueError("this plan accumulates into c: pass its pointer")
        if self.destroyed:
            raise BlasError("GemmPlan.run", None, "CUBLAS_STATUS_NOT_INITIALIZED", f"{s}: plan was evicted")
        blas.device.activate()
        if self.m_ok is not None:
            self._set_m(m or s.m)
        _call("cublasLtMatmul", lt.matmul, blas.handle, self.desc, self.alpha.ctypes.data, w, self.a, x, self.b,
              self.beta.ctypes.data, c or y, self.c, y, self.c, self.algo_ptr, blas.workspace.ptr,
              blas.workspace_bytes, blas.stream_handle)
        blas.calls += 1

    destroyed = False

    def destroy(self) -> None:
        """Free the descriptors (once); the heuristic result (``algo_ptr``) stays valid for borrowers."""
        if self.destroyed:
            return
        self.destroyed = True
        lt = _lt()
        for lay in (self.a, self.b, self.c):
            lt.matrix_layout_destroy(lay)
        lt.matmul_desc_destroy(self.desc)


K = TypeVar("K")
V = TypeVar("V")

MAX_PLANS = 256  # GEMM plans a Blas keeps (least recently used dropped first): see Blas
PIN_FAILURES_KEPT = 64  # refused pins a Blas lists (all are counted)


class LruCache(Generic[K, V]):
    """At most ``capacity`` entries; a hit makes an entry the most recent; inserting past the capacity drops the
    least recently used one and passes it to ``on_evict``. ``evictions`` counts them."""

    def __init__(self, capacity: int, on_evict: Callable[[V], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.on_evict = capacity, on_evict
        self._d: OrderedDict[K, V] = OrderedDict()
        self.evictions = 0

    def get(self, key: K) -> V | None:
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
        return v

    def put(self, key: K, value: V) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.capacity:
            _, old = self._d.popitem(last=False)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(old)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return key in self._d


class Blas:
    """One cuBLASLt handle, workspace and plan cache for one :class:`CudaDevice` (engine thread only).

    Plans are keyed by shape, and prefill steps bring a new M (the step's token count) almost every time, so the
    cache keeps the ``max_plans`` most recently used ones and destroys the descriptors of the others (a served
    process would otherwise grow by every (M, N, K) it ever saw: ~15 KB of host memory per plan, measured as a
    memory slope in a GPU soak). Decode steps replay graphs, which hold no descriptors; a plan whose algorithm
    another plan borrows (``pin_m``) stays alive through that plan's reference to its heuristic result."""

    def __init__(self, device: CudaDevice, workspace_bytes: int = 32 << 20, max_plans: int = MAX_PLANS,
                 plans_by_class: bool = True) -> None:
        lt = _lt()
        self.device = device
        device.activate()
        self.handle = _call("cublasLtCreate", lt.create)
        self.workspace_bytes = int(workspace_bytes)
        self.workspace = device.alloc(self.workspace_bytes)
        self.preference = _call("cublasLtMatmulPreferenceCreate", lt.matmul_preference_create)
        ws = np.array([self.workspace_bytes], np.uint64)
        _call("cublasLtMatmulPreferenceSetAttribute", lt.matmul_preference_set_attribute, self.preference,
              lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, ws.ctypes.data, 8)
        self.stream_handle = int(device.stream)
        self._plans: LruCache[tuple[GemmShape, int], GemmPlan] = LruCache(max_plans, GemmPlan.destroy)
        self._lock = threading.Lock()
        self.calls = 0
        self.version = int(lt.get_version())
        self.plans_by_class = plans_by_class
        self._classes: dict[GemmShape, GemmPlan] = {}  # class plans by their pin_m shape (a few per model)
        # (m, n, k, pin_m) of the first PIN_FAILURES_KEPT products whose pinned algorithm cublasLtMatmulAlgoCheck
        # refused (the heuristic's plan used instead); pin_failure_count counts them all
        self.pin_failures: list[tuple[int, int, int, int]] = []
        self.pin_failure_count = 0

    def note_pin_failure(self, m: int, n: int, k: int, pin_m: int) -> None:
        self.pin_failure_count += 1
        if len(self.pin_failures) < PIN_FAILURES_KEPT:
            self.pin_failures.append((m, n, k, pin_m))

    def plan(self, shape: GemmShape, pin_m: int = 0) -> tuple[GemmPlan, int]:
        """The plan that runs ``shape`` and the ``m`` to pass to its :meth:`GemmPlan.run` (``pin_m``: see the
        module docstring)."""
        pin = pin_m if pin_m and pin_m != shape.m else 0
        if self.plans_by_class and pin_m and shape.m <= pin_m:
            cshape = GemmShape(pin_m, shape.n, shape.k, shape.dtype, shape.out_dtype, shape.ldx, shape.ldy,
                               shape.accumulate, shape.bias)
            cp = self._classes.get(cshape)
            if cp is None:
                cp = self._classes[cshape] = GemmPlan(self, cshape, 0, by_class=True)
            if cp.accepts(shape.m):
                return cp, shape.m
            self.note_pin_failure(shape.m, shape.n, shape.k, pin_m)
            pin = 0  # this M gets the heuristic's own plan
        key = (shape, pin)
        with self._lock:
            p = self._plans.get(key)
        if p is None:
            p = GemmPlan(self, shape, key[1])
            with self._lock:
                self._plans.put(key, p)
        return p, 0

    @property
    def num_plans(self) -> int:
        """Plans alive: the LRU cache's and the class plans."""
        return len(self._plans) + len(self._classes)

    @property
    def plan_evictions(self) -> int:
        return self._plans.evictions

    def gemm(self, m: int, n: int, k: int, x: int, w: int, y: int, *, dtype: str, out_dtype: str, ldx: int = 0,
             ldy: int = 0, c: int = 0, bias: int = 0, pin_m: int = 0) -> GemmPlan:
        """Plan (cached) and enqueue one product; returns the plan (tests read ``pinned``)."""
        p, rows = self.plan(GemmShape(m, n, k, dtype, out_dtype, ldx or k, ldy or n, bool(c), bool(bias)), pin_m)
        p.run(x, w, y, c, bias, m=rows)
        return p
