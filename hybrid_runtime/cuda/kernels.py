"""CUDA C++ kernels: NVRTC compile at load, cached; guarded ``cuLaunchKernelEx`` launches.

* :func:`compile_cubin` compiles a source with NVRTC for one architecture (``sm_90`` on the H200) and
  caches the cubin in-process and on disk (``$HYBRID_LLM_CACHE`` or ``~/.cache/hybrid_llm/cubin``),
  keyed by a hash of the source, the options, the architecture and the NVRTC version. NVRTC needs no
  GPU, so compilation is tested on CPU machines too.
* :class:`Module` loads a cubin with ``cuLibraryLoadData`` (context-independent, so one load serves every
  GPU) and hands out :class:`Kernel` objects.
* :class:`Kernel` keeps, per device, the dynamic-shared-memory opt-in it set with
  ``cuKernelSetAttribute(..., dev)``: :meth:`Kernel.optin_bytes` is the record the owners turn into
  ``DeviceLimits.optin_set``. :meth:`Kernel.launch` re-checks the launch against the device's limits
  (:func:`launch_problems`) and raises :class:`LaunchRejected` before anything reaches the driver; a
  driver error becomes :class:`CudaError`.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ..ops.dispatcher import DeviceLimits
from .driver import CudaDevice, CudaError, bindings, call, init


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message holds the compiler log."""


class LaunchRejected(RuntimeError):
    """A launch failed the pre-launch check; ``reasons`` are stable codes (as in the dispatcher)."""

    def __init__(self, kernel: str, reasons: Sequence[str]) -> None:
        super().__init__(f"launch of {kernel} rejected: {', '.join(reasons)}")
        self.reasons = tuple(reasons)


_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"[ \t]*$', re.M)


def source(name: str, _seen: frozenset[str] = frozenset()) -> str:
    """Text of ``hybrid_runtime/ops/cuda/<name>``, with each ``#include "<file>"`` of a file beside it replaced
    by that file's text (once per file, recursively), so NVRTC gets one self-contained source and the compile
    cache key covers the headers too."""
    text = resources.files("hybrid_runtime.ops").joinpath("cuda", name).read_text(encoding="utf-8")
    seen = _seen | {name}

    def expand(m: re.Match[str]) -> str:
        inc = m.group(1)
        if inc in seen:
            return f"// {inc}: included above"
        return f"// ---- {inc}\n{source(inc, seen)}\n// ---- end of {inc}"

    return _INCLUDE.sub(expand, text)


# ---------------------------------------------------------------------------------------- NVRTC

_cubins: dict[str, bytes] = {}
_logs: dict[str, str] = {}
_compile_lock = threading.Lock()


def nvrtc_version() -> tuple[int, int]:
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:  # pragma: no cover
        raise CompileError(f"cuda-bindings (nvrtc) is not installed: {e}") from e
    err, major, minor = nvrtc.nvrtcVersion()
    if int(err):
        raise CompileError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


def _cache_dir() -> Path | None:
    d = os.environ.get("HYBRID_LLM_CACHE")
    path = Path(d) if d else Path.home() / ".cache" / "hybrid_llm" / "cubin"
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        return None


def _nvrtc_check(res: Any, what: str, prog: Any = None) -> Any:
    from cuda.bindings import nvrtc

    err, vals = (res[0], res[1:]) if isinstance(res, tuple) else (res, ())
    if int(err) != 0:
        log = program_log(prog) if prog is not None else ""
        raise CompileError(f"{what} failed: {err}\n{log}")
    _ = nvrtc
    return vals[0] if len(vals) == 1 else (vals or None)


def program_log(prog: Any) -> str:
    from cuda.bindings import nvrtc

    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    # NVRTC writes into the buffer: it must be a fresh mutable one. ``b" " * 1`` is CPython's shared
    # one-byte object, and writing the empty log's NUL into it turned every b" " of the process into b"\0".
    buf = bytearray(int(size))
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return bytes(buf).rstrip(b"\0 ").decode(errors="replace")


def compile_cubin(src: str, name: str, options: Sequence[str] = (), arch: str = "sm_90",
                  verbose: bool = False) -> bytes:
    """NVRTC-compile ``src`` to a cubin for ``arch``. ``verbose`` asks ptxas for its resource report,
    which :func:`compile_log` then returns (used by tests to check for spills)."""
    opts = [f"-arch={arch}", "-std=c++17", "-lineinfo", *options] + (["--ptxas-options=-v"] if verbose else [])
    ver = nvrtc_version()
    key = hashlib.sha256("\0".join([src, name, *opts, str(ver)]).encode()).hexdigest()[:32]
    with _compile_lock:
        if key in _cubins:
            return _cubins[key]
        cache = _cache_dir()
        path = cache / f"{key}.cubin" if cache else None
        if path is not None and path.exists() and not verbose:
            _cubins[key] = path.read_bytes()
            return _cubins[key]
        from cuda.bindings import nvrtc

        prog = _nvrtc_check(nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
        try:
            _nvrtc_check(nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts]),
                         f"NVRTC compile of {name} {' '.join(options)}", prog)
            _logs[key] = program_log(prog)
            size = _nvrtc_check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            buf = bytearray(int(size))  # written by NVRTC: never an (immutable, possibly shared) bytes
            _nvrtc_check(nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            cubin = bytes(buf)
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        _cubins[key] = cubin
        if path is not None:
            try:
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(cubin)
                tmp.replace(path)
            except OSError:
                pass
        return cubin


def _compile_job(job: tuple[str, tuple[str, ...], str]) -> None:
    src_name, options, arch = job
    compile_cubin(source(src_name), src_name, options, arch)


def warm_cache(jobs: Sequence[tuple[str, Sequence[str], str]], workers: int | None = None) -> int:
    """Compile ``(src_name, options, arch)`` jobs (:func:`load_module`'s arguments) into the on-disk cubin cache in
    parallel worker processes (spawned; one process compiles one program at a time), so that the loads that follow
    only read files. A warm-up: nothing when there is no writable cache directory or no job; a job that fails is
    left to the load that needs it (which then raises). Returns the number of jobs run."""
    import concurrent.futures as cf
    import multiprocessing as mp

    todo = list(dict.fromkeys((name, tuple(opts), arch) for name, opts, arch in jobs))
    if not todo or _cache_dir() is None:
        return 0
    n = max(1, min(len(todo), workers or os.cpu_count() or 1))
    try:
        with cf.ProcessPoolExecutor(n, mp_context=mp.get_context("spawn")) as ex:
            for f in [ex.submit(_compile_job, j) for j in todo]:
                f.exception()  # wait; a job's error surfaces at its load
    except (OSError, RuntimeError):  # no worker processes here (BrokenProcessPool is a RuntimeError): loads compile
        return 0
    return len(todo)


def compile_log(src: str, name: str, options: Sequence[str] = (), arch: str = "sm_90") -> str:
    """The NVRTC/ptxas log (registers, spills, shared memory) of a verbose compile."""
    opts = [f"-arch={arch}", "-std=c++17", "-lineinfo", *options, "--ptxas-options=-v"]
    key = hashlib.sha256("\0".join([src, name, *opts, str(nvrtc_version())]).encode()).hexdigest()[:32]
    compile_cubin(src, name, options, arch, verbose=True)
    return _logs.get(key, "")


# ---------------------------------------------------------------------------------------- launch checks


def launch_problems(limits: DeviceLimits, grid: Sequence[int], block: Sequence[int], smem: int,
                    static_smem: int, optin_bytes: int | None) -> list[str]:
    """Reasons a launch would be invalid on a device with ``limits``; [] if none. ``optin_bytes`` is the
    dynamic-shared-memory limit this kernel was opted in to on that device (None: never set)."""
    r = []
    if len(grid) != 3 or len(block) != 3 or any(int(d) < 1 for d in (*grid, *block)):
        r.append("grid_zero")
    else:
        for i, cap in enumerate((limits.max_grid_x, limits.max_grid_y, limits.max_grid_z)):
            if grid[i] > cap:
                r.append("grid_" + "xyz"[i])
        if int(block[0]) * int(block[1]) * int(block[2]) > limits.max_threads_per_block:
            r.append("threads")
    if smem < 0 or smem + static_smem > limits.max_shared_mem_optin:
        r.append("smem_optin")
    elif smem + static_smem > limits.max_shared_mem_per_block and (optin_bytes is None or smem > optin_bytes):
        r.append("smem_attr_not_set")
    return r


# struct codes of the parameter kinds, each in its 8-byte slot (4-byte kinds padded): one pack_into for all parameters
_ARG_STRUCT = {"ptr": "Q", "u64": "Q", "i64": "q", "i32": "i4x", "u32": "I4x", "f32": "f4x"}
_ARG_FORMATS: dict[tuple[str, ...], str] = {}  # the struct format of each signature (kinds in order) seen


def pack_args(args: Sequence[tuple[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Kernel parameters as cuLaunchKernelEx wants them: a ``void**`` array (returned first, pass it as
    ``kernelParams``) pointing into an 8-byte-slot value buffer (returned second, keep it alive). One
    ``struct.pack_into`` (a numpy scalar per parameter cost ~10 us a launch of 18 parameters on a busy host), its
    format made once per signature. KeyError for a kind outside ``_ARG_STRUCT``."""
    n = len(args)
    vals = np.zeros(max(1, n), np.uint64)
    if n:
        kinds = tuple([a[0] for a in args])
        fmt = _ARG_FORMATS.get(kinds)
        if fmt is None:
            fmt = _ARG_FORMATS[kinds] = "<" + "".join([_ARG_STRUCT[k] for k in kinds])
        struct.pack_into(fmt, vals, 0, *[a[1] for a in args])
        base = vals.ctypes.data
        ptrs = np.arange(base, base + 8 * n, 8, dtype=np.uint64)
    else:
        ptrs = np.zeros(1, np.uint64)
    return ptrs, vals


# Launch configurations a kernel keeps (validated geometry -> its CUlaunchConfig) before it starts over: prefill
# grids follow the step's token count, so the set of keys is open-ended; a step repeats each per layer.
CONFIG_CACHE_MAX = 256
_pdl_attrs: list[Any] = []  # [the CUlaunchAttribute of programmatic stream serialization], made once


def launch_config(grid: Sequence[int], block: Sequence[int], smem: int, stream: Any, pdl: bool) -> Any:
    """A ``CUlaunchConfig`` for cuLaunchKernelEx (``pdl``: programmatic stream serialization allowed). The driver
    reads it during the call only, so one object serves any number of launches."""
    drv = bindings()
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(g) for g in grid)
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(b) for b in block)
    cfg.sharedMemBytes = int(smem)
    cfg.hStream = stream
    if pdl:
        if not _pdl_attrs:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            _pdl_attrs.append(attr)
        cfg.attrs = _pdl_attrs
        cfg.numAttrs = 1
    else:
        cfg.numAttrs = 0
    return cfg


@dataclass
class Launch:
    """One kernel launch, fully described (what the tests compare against a LaunchPlan)."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    args: list[tuple[str, Any]]
    # Programmatic dependent launch (sm_90+): may start before the previous kernel on the stream finishes;
    # the kernel itself waits (griddepcontrol.wait) before reading that kernel's results.
    pdl: bool = False


class Kernel:
    """One ``extern "C"`` kernel of a loaded library, usable on any device."""

    def __init__(self, module: Module, name: str, handle: Any) -> None:
        self.module = module
        self.name = name
        self.handle = handle  # CUkernel
        self._functions: dict[int, Any] = {}
        self._optin: dict[int, int] = {}
        self._static: dict[int, int] = {}
        # (ordinal, limits, stream, grid, block, smem, pdl) -> (the CUlaunchConfig of a launch the guard accepted, the
        # limits it was checked against); cleared when the kernel's shared-memory opt-in changes (the verdict depends
        # on it) and past CONFIG_CACHE_MAX
        self._configs: dict[tuple, Any] = {}

    def function(self, device: CudaDevice) -> Any:
        """CUfunction of this kernel in ``device``'s context (loads the library there on first use)."""
        f = self._functions.get(device.ordinal)
        if f is None:
            device.activate()
            f = call("cuKernelGetFunction", bindings().cuKernelGetFunction, self.handle)
            self._functions[device.ordinal] = f
        return f

    def attribute(self, device: CudaDevice, attr: str) -> int:
        drv = bindings()
        device.activate()
        return int(call("cuKernelGetAttribute", drv.cuKernelGetAttribute, getattr(drv.CUfunction_attribute, attr),
                        self.handle, device.dev))

    def static_smem(self, device: CudaDevice) -> int:
        if device.ordinal not in self._static:
            self._static[device.ordinal] = self.attribute(device, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES")
        return self._static[device.ordinal]

    def set_max_dynamic_smem(self, device: CudaDevice, nbytes: int | None = None) -> int:
        """Opt this kernel in to ``nbytes`` of dynamic shared memory on ``device`` (default: all the device
        allows). Recorded only after the driver accepted it."""
        drv = bindings()
        want = device.limits.max_shared_mem_optin - self.static_smem(device) if nbytes is None else int(nbytes)
        device.activate()
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        call("cuKernelSetAttribute", drv.cuKernelSetAttribute, attr, want, self.handle, device.dev)
        # The same limit on the CUfunction of this device's context (what cuLaunchKernelEx launches).
        call("cuFuncSetAttribute", drv.cuFuncSetAttribute, self.function(device), attr, want)
        self._optin[device.ordinal] = want
        self._configs.clear()  # verdicts given under the old limit
        return want

    def optin_bytes(self, device: CudaDevice) -> int | None:
        """The dynamic-shared-memory limit this process set for this kernel on ``device``; None if never."""
        return self._optin.get(device.ordinal)

    def problems(self, device: CudaDevice, grid: Sequence[int], block: Sequence[int], smem: int) -> list[str]:
        return launch_problems(device.limits, grid, block, smem, self.static_smem(device), self.optin_bytes(device))

    def launch_unchecked(self, device: CudaDevice, grid: Sequence[int], block: Sequence[int], smem: int,
                         args: Sequence[tuple[str, Any]], pdl: bool = False) -> int:
        """The raw ``cuLaunchKernelEx`` on the device's stream, with no pre-launch check; returns the
        CUresult code (tests use it to show the driver rejects what the guard rejects). ``pdl`` sets
        ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``."""
        return self._launch_with(device, launch_config(grid, block, smem, device.stream, pdl), args)

    def _launch_with(self, device: CudaDevice, cfg: Any, args: Sequence[tuple[str, Any]]) -> int:
        ptrs, _vals = pack_args(args)
        f = self.function(device)
        device.activate()
        res = bindings().cuLaunchKernelEx(cfg, f, ptrs, 0)
        return int(res[0] if isinstance(res, tuple) else res)

    def launch(self, device: CudaDevice, grid: Sequence[int], block: Sequence[int], smem: int,
               args: Sequence[tuple[str, Any]], pdl: bool = False) -> None:
        """Guarded launch: LaunchRejected if the configuration is invalid on this device, CudaError if the
        driver still refuses it. ``pdl`` is honoured on sm_90+ devices only. A geometry the guard accepted keeps
        its verdict and launch configuration (``_configs``), so a repeated launch skips both; what the verdict
        depends on is in the key (device, its limits, stream, grid, block, shared memory, pdl) or clears it (the
        kernel's shared-memory opt-in)."""
        # the limits object by identity (the entry holds it, so the id cannot be reused while the entry lives)
        key = (device.ordinal, id(device.limits), int(device.stream), tuple(grid), tuple(block), smem, pdl)
        hit = self._configs.get(key)
        if hit is None:
            if reasons := self.problems(device, grid, block, smem):
                raise LaunchRejected(f"{self.name} on {device.limits.name}", reasons)
            cfg = launch_config(grid, block, smem, device.stream, pdl and device.compute_capability >= (9, 0))
            if len(self._configs) >= CONFIG_CACHE_MAX:
                self._configs.clear()
            self._configs[key] = (cfg, device.limits)
        else:
            cfg = hit[0]
        code = self._launch_with(device, cfg, args)
        if code != 0:
            from .driver import error_name

            raise CudaError(f"cuLaunchKernelEx({self.name})", code, error_name(code))

    def run(self, device: CudaDevice, launch: Launch) -> None:
        self.launch(device, launch.grid, launch.block, launch.smem, launch.args, launch.pdl)


class Module:
    """A cubin loaded with ``cuLibraryLoadData``; kernels are looked up by name and cached."""

    def __init__(self, cubin: bytes, label: str = "") -> None:
        drv = bindings()
        init()
        self.label = label
        self._cubin = cubin  # the driver may read it lazily
        self.library = call("cuLibraryLoadData", drv.cuLibraryLoadData, cubin, None, None, 0, None, None, 0)
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, name: str) -> Kernel:
        k = self._kernels.get(name)
        if k is None:
            h = call("cuLibraryGetKernel", bindings().cuLibraryGetKernel, self.library, name.encode())
            k = self._kernels[name] = Kernel(self, name, h)
        return k


_modules: dict[tuple[str, str, tuple[str, ...], str], Module] = {}
_modules_lock = threading.Lock()


def load_module(src_name: str, options: Sequence[str], arch: str) -> Module:
    """Compile (cached) and load ``ops/cuda/<src_name>`` with ``options``; one Module per process and key.
    Opt-in attributes live on the kernels, so every owner sees the same per-device record."""
    key = (src_name, source(src_name), tuple(options), arch)
    with _modules_lock:
        m = _modules.get(key)
        if m is None:
            m = _modules[key] = Module(compile_cubin(key[1], src_name, options, arch), f"{src_name} {options}")
        return m
