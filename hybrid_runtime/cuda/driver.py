"""Thin, checked layer over ``cuda.bindings.driver``.

Every driver call goes through :func:`call`, which turns a non-success ``CUresult`` (or a missing
driver library) into a typed :class:`CudaError` carrying the call name and the CUDA error name, never
a process abort. One :class:`CudaDevice` per GPU owns that GPU's primary context and a stream; all of
its operations make the context current first, so one thread can drive several GPUs.

Device memory is handed around as :class:`DeviceArray` (pointer + shape + dtype name), which is what
the decode-attention dispatcher and the GDN launchers take. It speaks ``__cuda_array_interface__``, so
tests and benchmarks can view it from PyTorch or CuPy without a copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ops.dispatcher import DeviceLimits, limits_for


class CudaError(RuntimeError):
    """A CUDA driver call failed. ``code`` is the ``CUresult`` value (None when the driver itself is
    missing), ``name`` its symbolic name, e.g. ``CUDA_ERROR_INVALID_VALUE``."""

    def __init__(self, call_name: str, code: int | None, name: str, detail: str = "") -> None:
        super().__init__(f"{call_name} failed: {name}" + (f" ({detail})" if detail else ""))
        self.call = call_name
        self.code = code
        self.name = name


# CUresult codes after which the context is unusable: every later call of the process on it fails the same
# way, so the model instance must be restarted (a new process, a new context). CUDA's documentation calls
# these "sticky"; 999 (unknown) is treated the same, to be safe.
STICKY_CODES = frozenset({
    214,  # CUDA_ERROR_ECC_UNCORRECTABLE
    700,  # CUDA_ERROR_ILLEGAL_ADDRESS
    702,  # CUDA_ERROR_LAUNCH_TIMEOUT
    710,  # CUDA_ERROR_ASSERT
    714,  # CUDA_ERROR_HARDWARE_STACK_ERROR
    715,  # CUDA_ERROR_ILLEGAL_INSTRUCTION
    716,  # CUDA_ERROR_MISALIGNED_ADDRESS
    717,  # CUDA_ERROR_INVALID_ADDRESS_SPACE
    718,  # CUDA_ERROR_INVALID_PC
    719,  # CUDA_ERROR_LAUNCH_FAILED
    999,  # CUDA_ERROR_UNKNOWN
})


def is_sticky(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a CudaError with a sticky code."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, CudaError) and e.code in STICKY_CODES:
            return True
        e = e.__cause__ or e.__context__
    return False


_driver: list[Any] = []  # the imported cuda.bindings.driver module (bindings() is called before every driver call)


def bindings() -> Any:
    """The ``cuda.bindings.driver`` module, or CudaError if cuda-bindings is not installed."""
    if _driver:
        return _driver[0]
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise CudaError("import cuda.bindings", None, "CUDA_BINDINGS_MISSING", str(e)) from e
    _driver.append(driver)
    return driver


def error_name(code: int) -> str:
    drv = bindings()
    try:
        err, name = drv.cuGetErrorName(drv.CUresult(code))
        return name.decode() if int(err) == 0 and name else f"CUresult {code}"
    except Exception:  # an unknown code: keep the number
        return f"CUresult {code}"


def call(name: str, fn: Any, *args: Any) -> Any:
    """Run one driver function and check its CUresult. Returns the remaining value(s) of the tuple
    cuda-python returns: None, one value, or a tuple."""
    try:
        res = fn(*args)
    except CudaError:
        raise
    except Exception as e:  # missing libcuda, bad argument types: typed, never an abort
        raise CudaError(name, None, type(e).__name__, str(e)) from e
    err, vals = (res[0], res[1:]) if isinstance(res, tuple) else (res, ())
    code = int(err)
    if code != 0:
        raise CudaError(name, code, error_name(code))
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


_init_lock = threading.Lock()
_initialised = False


def init() -> None:
    """``cuInit(0)`` once per process (CudaError when there is no driver or no device)."""
    global _initialised
    with _init_lock:
        if not _initialised:
            drv = bindings()
            call("cuInit", drv.cuInit, 0)
            _initialised = True


def device_count() -> int:
    """Number of CUDA devices; 0 when cuda-bindings, the driver or a GPU is missing."""
    try:
        init()
        return int(call("cuDeviceGetCount", bindings().cuDeviceGetCount))
    except CudaError:
        return 0


# ---------------------------------------------------------------------------------------- dtypes


@dataclass(frozen=True)
class DType:
    """Element type of device memory. ``name`` matches numpy's names (and ``bfloat16``)."""

    name: str
    itemsize: int
    typestr: str  # __cuda_array_interface__ (bfloat16 is exposed as raw 16-bit words)

    def __str__(self) -> str:
        return self.name


DTYPES = {d.name: d for d in (DType("float32", 4, "<f4"), DType("float16", 2, "<f2"),
                              DType("bfloat16", 2, "<i2"), DType("int32", 4, "<i4"),
                              DType("int64", 8, "<i8"), DType("uint8", 1, "|u1"))}


def dtype_of(x: Any) -> DType:
    """DType from a name, a numpy dtype, a torch dtype or a DType."""
    if isinstance(x, DType):
        return x
    name = str(x).replace("torch.", "")
    if name not in DTYPES:
        with contextlib.suppress(TypeError):
            name = np.dtype(x).name
    if name not in DTYPES:
        raise ValueError(f"unsupported device dtype {x!r}; supported: {sorted(DTYPES)}")
    return DTYPES[name]


# ---------------------------------------------------------------------------------------- memory


class DeviceBuffer:
    """One allocation on one device; freed by :meth:`free` or when garbage collected.

    ``stream_ordered`` buffers come from ``cuMemAllocAsync`` on the device's stream and go back with
    ``cuMemFreeAsync`` (cheap enough for per-call outputs); the others are plain ``cuMemAlloc``.
    """

    def __init__(self, device: CudaDevice, nbytes: int, stream_ordered: bool = False) -> None:
        drv = bindings()
        device.activate()
        size = max(1, int(nbytes))
        if stream_ordered:
            ptr = call("cuMemAllocAsync", drv.cuMemAllocAsync, size, device.stream)
        else:
            ptr = call("cuMemAlloc", drv.cuMemAlloc, size)
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.device = device
        self._finalizer = weakref.finalize(self, _free, device.ctx, device.stream, self.ptr, stream_ordered)

    def free(self) -> None:
        self._finalizer()


def _free(ctx: Any, stream: Any, ptr: int, stream_ordered: bool) -> None:
    """Finalizer: never raises (it may run during interpreter shutdown)."""
    try:
        drv = bindings()
        drv.cuCtxSetCurrent(ctx)
        if stream_ordered:
            drv.cuMemFreeAsync(drv.CUdeviceptr(ptr), stream)
        else:
            drv.cuMemFree(drv.CUdeviceptr(ptr))
    except Exception:  # pragma: no cover
        pass


class DeviceArray:
    """A C-contiguous array in device memory: ``ptr``, ``shape``, ``dtype`` (a :class:`DType`),
    ``device`` (ordinal). ``owner`` keeps the memory alive (a DeviceBuffer, a torch tensor, ...)."""

    def __init__(self, ptr: int, shape: Sequence[int], dtype: Any, device: int, owner: Any = None) -> None:
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype_of(dtype)
        self.device = int(device)
        self.owner = owner

    @classmethod
    def from_torch(cls, t: Any) -> DeviceArray:
        """Zero-copy view of a contiguous CUDA torch tensor (keeps the tensor alive)."""
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError("need a contiguous CUDA tensor")
        return cls(t.data_ptr(), tuple(t.shape), str(t.dtype), t.device.index, owner=t)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def view(self, shape: Sequence[int]) -> DeviceArray:
        """Same memory, another C-contiguous shape of the same size."""
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot view {self.shape} as {tuple(shape)}")
        return DeviceArray(self.ptr, shape, self.dtype, self.device, self.owner)

    def row_ptr(self, index: int) -> int:
        """Address of ``self[index]`` along axis 0 (bounds-checked)."""
        if not 0 <= index < self.shape[0]:
            raise IndexError(f"row {index} outside 0..{self.shape[0] - 1}")
        return self.ptr + index * (self.nbytes // self.shape[0])

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.typestr, "data": (self.ptr, False), "version": 2,
                "strides": None}

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype.name}, device={self.device}, ptr=0x{self.ptr:x})"


# ---------------------------------------------------------------------------------------- devices


_ATTRS = {
    "max_grid_x": "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X",
    "max_grid_y": "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y",
    "max_grid_z": "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z",
    "max_threads_per_block": "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK",
    "max_shared_mem_per_block": "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK",
    "max_shared_mem_optin": "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
    "max_shared_mem_per_sm": "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
    "sm_count": "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT",
}


def device_attribute(ordinal: int, attr: str) -> int:
    drv = bindings()
    init()
    dev = call("cuDeviceGet", drv.cuDeviceGet, ordinal)
    return int(call("cuDeviceGetAttribute", drv.cuDeviceGetAttribute, getattr(drv.CUdevice_attribute, attr), dev))


def _query_limits(ordinal: int) -> DeviceLimits:
    drv = bindings()
    init()
    dev = call("cuDeviceGet", drv.cuDeviceGet, ordinal)
    name = call("cuDeviceGetName", drv.cuDeviceGetName, 256, dev)
    name = name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(name, bytes) else str(name)
    vals = {k: device_attribute(ordinal, a) for k, a in _ATTRS.items()}
    return DeviceLimits(f"cuda:{ordinal} {name}", **vals)


def query_limits(ordinal: int) -> DeviceLimits:
    """Launch limits of device ``ordinal`` from ``cuDeviceGetAttribute``, queried once per device.
    ``optin_set`` is empty here: the kernel owner adds what it opted in (see kernels.py)."""
    return limits_for(("cuda", int(ordinal)), lambda: _query_limits(int(ordinal)))


def compute_capability(ordinal: int) -> tuple[int, int]:
    return (device_attribute(ordinal, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
            device_attribute(ordinal, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"))


class CudaDevice:
    """One GPU: its retained primary context (shared with PyTorch/CuPy in the same process), one stream
    and checked memory operations on that stream.

    ``stream``: an existing CUstream handle to use (0 = the legacy default stream, as PyTorch's default
    stream); by default a new blocking stream is created, which is ordered with the legacy default stream.
    """

    def __init__(self, ordinal: int = 0, stream: int | None = None) -> None:
        drv = bindings()
        init()
        count = int(call("cuDeviceGetCount", drv.cuDeviceGetCount))
        if not 0 <= ordinal < count:
            raise CudaError("cuDeviceGet", None, "CUDA_ERROR_INVALID_DEVICE", f"ordinal {ordinal} of {count}")
        self.ordinal = int(ordinal)
        self.dev = call("cuDeviceGet", drv.cuDeviceGet, ordinal)
        self.ctx = call("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain, self.dev)
        self.activate()
        if stream is None:
            self.stream = call("cuStreamCreate", drv.cuStreamCreate, 0)
            self.owns_stream = True
        else:
            self.stream = drv.CUstream(int(stream))
            self.owns_stream = False
        self.limits = query_limits(self.ordinal)
        # Host<->device copies issued through this object ("htod", "dtoh"): the GPU backend's tests count
        # them per step (one up, one down).
        self.copies: Counter[str] = Counter()
        cc = compute_capability(self.ordinal)
        self.compute_capability = cc
        self.arch = f"sm_{cc[0]}{cc[1]}"
        # Set while a thread blocks in :meth:`synchronize` (the GIL is released there): a serving adapter's
        # other Python threads do their GIL-bound work in that window instead of contending with the engine
        # thread's host work between launches (deploy.inflight.SendQueue).
        self.waiting = threading.Event()

    def activate(self) -> None:
        """Make this device's context current on the calling thread (cheap; done before every call)."""
        call("cuCtxSetCurrent", bindings().cuCtxSetCurrent, self.ctx)

    # -- memory
    def alloc(self, nbytes: int, stream_ordered: bool = False) -> DeviceBuffer:
        return DeviceBuffer(self, nbytes, stream_ordered)

    def empty(self, shape: Sequence[int], dtype: Any, stream_ordered: bool = False) -> DeviceArray:
        dt = dtype_of(dtype)
        buf = self.alloc(int(np.prod(shape, dtype=np.int64)) * dt.itemsize, stream_ordered)
        return DeviceArray(buf.ptr, shape, dt, self.ordinal, owner=buf)

    def zeros(self, shape: Sequence[int], dtype: Any, stream_ordered: bool = False) -> DeviceArray:
        a = self.empty(shape, dtype, stream_ordered)
        self.memset_d8(a.ptr, 0, a.nbytes)
        return a

    def upload(self, host: np.ndarray, out: DeviceArray | None = None, dtype: Any = None,
               stream_ordered: bool = False) -> DeviceArray:
        """Copy a host array to the device (a new array unless ``out`` is given). The host buffer may be
        reused as soon as this returns (pageable copies are staged by the driver). ``stream_ordered``: the
        new array is allocated and later freed in stream order (for per-call temporaries)."""
        h = np.ascontiguousarray(host)
        if out is None:
            out = self.empty(h.shape, dtype or h.dtype, stream_ordered)
        if out.nbytes != h.nbytes:
            raise ValueError(f"upload of {h.nbytes} bytes into a {out.nbytes}-byte array")
        self.copy_htod(out.ptr, h)
        return out

    def copy_htod(self, dst: int, host: np.ndarray) -> None:
        drv = bindings()
        h = np.ascontiguousarray(host)
        if h.nbytes:
            self.activate()
            self.copies["htod"] += 1
            call("cuMemcpyHtoDAsync", drv.cuMemcpyHtoDAsync, drv.CUdeviceptr(dst), h.ctypes.data, h.nbytes,
                 self.stream)

    def copy_dtoh(self, host_ptr: int, src: int, nbytes: int) -> None:
        """Queue a device-to-host copy into ``host_ptr`` (pinned memory: truly asynchronous)."""
        if nbytes:
            drv = bindings()
            self.activate()
            self.copies["dtoh"] += 1
            call("cuMemcpyDtoHAsync", drv.cuMemcpyDtoHAsync, host_ptr, drv.CUdeviceptr(src), int(nbytes), self.stream)

    def pinned(self, nbytes: int) -> PinnedBuffer:
        """Page-locked host memory (copies from and to it need no staging and overlap the host)."""
        self.activate()
        return PinnedBuffer(self, nbytes)

    def download(self, arr: DeviceArray) -> np.ndarray:
        """Device array -> host numpy (bfloat16 comes back as float32). Synchronises the stream."""
        drv = bindings()
        raw = np.empty(arr.nbytes, np.uint8)
        if arr.nbytes:
            self.activate()
            self.copies["dtoh"] += 1
            call("cuMemcpyDtoHAsync", drv.cuMemcpyDtoHAsync, raw.ctypes.data, drv.CUdeviceptr(arr.ptr), arr.nbytes,
                 self.stream)
        self.synchronize()
        if arr.dtype.name == "bfloat16":
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(arr.shape)
        return raw.view(np.dtype(arr.dtype.name)).reshape(arr.shape)

    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        drv = bindings()
        self.activate()
        call("cuMemcpyDtoDAsync", drv.cuMemcpyDtoDAsync, drv.CUdeviceptr(dst), drv.CUdeviceptr(src), int(nbytes),
             self.stream)

    def memset_d8(self, ptr: int, value: int, nbytes: int) -> None:
        drv = bindings()
        self.activate()
        call("cuMemsetD8Async", drv.cuMemsetD8Async, drv.CUdeviceptr(ptr), int(value) & 0xFF, int(nbytes),
             self.stream)

    def memset_d32(self, ptr: int, value: int, count: int) -> None:
        """Set ``count`` 32-bit words at ``ptr`` (which must be 4-byte aligned)."""
        if ptr % 4:
            raise ValueError(f"cuMemsetD32Async needs a 4-byte aligned address, got 0x{ptr:x}")
        drv = bindings()
        self.activate()
        call("cuMemsetD32Async", drv.cuMemsetD32Async, drv.CUdeviceptr(ptr), int(value) & 0xFFFFFFFF, int(count),
             self.stream)

    def synchronize(self) -> None:
        self.activate()
        self.waiting.set()
        try:
            call("cuStreamSynchronize", bindings().cuStreamSynchronize, self.stream)
        finally:
            self.waiting.clear()

    def health(self) -> CudaError | None:
        """None while the context works; else the error a context-wide synchronise returns (a sticky error
        of any earlier launch shows up here). Never raises."""
        try:
            self.activate()
            call("cuCtxSynchronize", bindings().cuCtxSynchronize)
        except CudaError as e:
            return e
        return None

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of this device's memory, as the driver reports them now."""
        self.activate()
        free, total = call("cuMemGetInfo", bindings().cuMemGetInfo)
        return int(free), int(total)

    # -- timing
    def event(self) -> Any:
        self.activate()
        return call("cuEventCreate", bindings().cuEventCreate, 0)

    def record(self, event: Any) -> None:
        call("cuEventRecord", bindings().cuEventRecord, event, self.stream)

    @staticmethod
    def elapsed_ms(start: Any, end: Any) -> float:
        drv = bindings()
        call("cuEventSynchronize", drv.cuEventSynchronize, end)
        return float(call("cuEventElapsedTime", drv.cuEventElapsedTime, start, end))

    def __repr__(self) -> str:
        return f"CudaDevice({self.ordinal}, {self.limits.name}, {self.arch})"


class PinnedBuffer:
    """Page-locked host memory from ``cuMemHostAlloc``; ``array`` is a uint8 numpy view of all of it."""

    def __init__(self, device: CudaDevice, nbytes: int) -> None:
        drv = bindings()
        self.nbytes = max(1, int(nbytes))
        self.ptr = int(call("cuMemHostAlloc", drv.cuMemHostAlloc, self.nbytes, 0))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.ptr))
        self._finalizer = weakref.finalize(self, _free_host, device.ctx, self.ptr)

    def free(self) -> None:
        self._finalizer()


def _free_host(ctx: Any, ptr: int) -> None:
    try:
        drv = bindings()
        drv.cuCtxSetCurrent(ctx)
        drv.cuMemFreeHost(ptr)
    except Exception:  # pragma: no cover
        pass


class GraphCaptureError(CudaError):
    """Stream capture failed; the stream is out of capture mode again and nothing was instantiated."""


class CudaGraph:
    """One instantiated CUDA graph captured from ``fn()`` on ``device``'s stream (thread-local capture mode:
    a forbidden call on this thread fails the capture instead of corrupting it).

    Python's cyclic garbage collector is paused during the capture: a collection there runs the finalizers of
    whatever unreachable device buffers it finds (``cuMemFree``, not allowed while this thread captures), which
    invalidated the capture of an unrelated launch (seen once in a GPU test: a decode graph refused with
    ``CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`` after an earlier case's backends became garbage)."""

    def __init__(self, device: CudaDevice, fn: Callable[[], Any]) -> None:
        drv = bindings()
        self.device = device
        device.activate()
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            call("cuStreamBeginCapture", drv.cuStreamBeginCapture, device.stream, mode)
            try:
                fn()
            except BaseException:
                with contextlib.suppress(Exception):
                    res = drv.cuStreamEndCapture(device.stream)
                    if isinstance(res, tuple) and len(res) > 1 and res[1] is not None:
                        drv.cuGraphDestroy(res[1])
                raise
            graph = call("cuStreamEndCapture", drv.cuStreamEndCapture, device.stream)
        finally:
            if gc_was_on:
                gc.enable()
        try:
            self.exec = call("cuGraphInstantiate", drv.cuGraphInstantiate, graph, 0)
            self.num_nodes = int(call("cuGraphGetNodes", drv.cuGraphGetNodes, graph, 0)[1])
        finally:
            call("cuGraphDestroy", drv.cuGraphDestroy, graph)
        self.launches = 0

    def launch(self) -> None:
        drv = bindings()
        self.device.activate()
        call("cuGraphLaunch", drv.cuGraphLaunch, self.exec, self.device.stream)
        self.launches += 1

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            bindings().cuGraphExecDestroy(self.exec)


def graph_replay_seconds(device: CudaDevice, fn: Callable[[], Any], reps: int) -> float:
    """GPU seconds of one replay of ``fn()``'s launches captured as a CUDA graph: one warm replay, then ``reps``
    back to back between two events (no host time in the figure). ``fn`` is captured, never run eagerly here."""
    g = CudaGraph(device, fn)
    try:
        g.launch()
        e0, e1 = device.event(), device.event()
        device.record(e0)
        for _ in range(reps):
            g.launch()
        device.record(e1)
        return device.elapsed_ms(e0, e1) / 1e3 / reps
    finally:
        g.destroy()
