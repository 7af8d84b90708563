"""The one import helper for TensorRT: full TensorRT (``tensorrt``) or TensorRT-RTX.

Everything in this project that touches TensorRT imports it through :func:`load` (or the lazy module
attributes ``trt``, ``flavor`` and ``version``), and every difference between the two toolkits is handled
here, in one place:

* module: full TensorRT is ``tensorrt`` (10.x / 11.x); TensorRT-RTX is ``tensorrt_rtx`` from NVIDIA's
  packages and ``tensorrt_rtx_bindings`` from the PyPI wheels ``tensorrt-rtx-cu13-libs/-bindings`` (1.7).
* typing: TensorRT 10 builds a strongly typed network when asked (``STRONGLY_TYPED`` flag); TensorRT 11
  and TensorRT-RTX only build strongly typed networks (:func:`network_flags`).
* reduced precision: casts in the network on both (the FP16/BF16 builder flags and ``ILayer.precision``
  are deprecated since TensorRT 10.12, removed in 11.x and absent from RTX, so they are not used).
* build target: full TensorRT builds for the GPU it runs on; TensorRT-RTX builds ahead of time, without a
  GPU, for any of ``ComputeCapability.SM75..SM121`` (:func:`set_target`, :func:`supported_arches`).
* execution: both tie a plan to the toolkit version and the compute capability it was built for.
* log noise: TensorRT-RTX logs "Thread context has not been set" at FATAL severity on every builder
  config; it is harmless and filtered (:func:`make_logger`).

Nothing is imported at module import: the libraries are large (about 240 MB for TensorRT-RTX) and most
of the project (the CPU backend, CI without the extra) never needs them.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger("hybrid_runtime.tensorrt")

FULL = "tensorrt"
RTX = "tensorrt_rtx"
# Tried in this order: full TensorRT first (the runtime backend's target), then TensorRT-RTX under the name of
# its standalone packages and under the name of its PyPI wheels.
MODULE_NAMES: tuple[str, ...] = ("tensorrt", "tensorrt_rtx", "tensorrt_rtx_bindings")

INSTALL_HINT = (
    "install TensorRT-RTX from PyPI (`pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings`, part of "
    "`pip install -e .[dev]`; builds plans on any machine, RTX GPUs run them) or, on a machine with an NVIDIA GPU, "
    "full TensorRT with cuda-python (`pip install tensorrt-cu12 cuda-python`, see the TensorRT install guide)"
)

# Log lines that are not problems: TensorRT-RTX prints the first at FATAL severity on every builder config;
# the second asks that int64 inputs be bound as int64, which the runtime does.
_BENIGN = ("Thread context has not been set", "has Int64 binding")

class TensorRTUnavailable(ImportError):
    """No TensorRT flavour could be imported; the message says how to install one."""


@dataclass(frozen=True, slots=True)
class Toolkit:
    """The imported TensorRT module, its flavour (``"tensorrt"`` | ``"tensorrt_rtx"``) and version string."""

    trt: ModuleType
    flavor: str
    version: str

    @property
    def display(self) -> str:
        return f"{'TensorRT-RTX' if self.flavor == RTX else 'TensorRT'} {self.version}"


_cache: dict[tuple[str, ...], Toolkit | str] = {}


def flavor_of(module: Any) -> str:
    """``"tensorrt_rtx"`` for the RTX bindings (either import name), else ``"tensorrt"``."""
    return RTX if getattr(module, "__name__", "").startswith("tensorrt_rtx") else FULL


def load(names: tuple[str, ...] | None = None) -> Toolkit:
    """Import the first available TensorRT flavour (cached); :class:`TensorRTUnavailable` names how to install."""
    names = names or MODULE_NAMES
    hit = _cache.get(names)
    if hit is None:
        errors = []
        for name in names:
            try:
                mod = importlib.import_module(name)
                ver = str(mod.__version__)
                mod.Builder  # noqa: B018  (the pypi "tensorrt" placeholder packages have no Builder)
            except (ImportError, OSError, AttributeError) as e:
                errors.append(f"{name}: {type(e).__name__}: {e}")
                continue
            hit = Toolkit(mod, flavor_of(mod), ver)
            break
        else:
            hit = "; ".join(errors)
        _cache[names] = hit
    if isinstance(hit, str):
        raise TensorRTUnavailable(f"TensorRT is not installed (tried {hit}); {INSTALL_HINT}")
    return hit


def available() -> bool:
    try:
        load()
    except TensorRTUnavailable:
        return False
    return True


def __getattr__(name: str) -> Any:  # PEP 562: trt_compat.trt / .flavor / .version import lazily
    if name in ("trt", "flavor", "version"):
        return getattr(load(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- architectures ----------------------------------------------------------------------------------
def arch_name(major: int, minor: int) -> str:
    """Compute capability (8, 9) -> ``"sm_89"``."""
    return f"sm_{major}{minor}"


def parse_arch(arch: str) -> tuple[int, int]:
    """``"sm_89"`` / ``"sm89"`` / ``"8.9"`` -> (8, 9); ValueError for anything else."""
    a = arch.strip().lower()
    if "." in a:
        major, minor = a.split(".", 1)
        if major.isdigit() and minor.isdigit():
            return int(major), int(minor)
    digits = a.removeprefix("sm_").removeprefix("sm")
    if digits.isdigit() and len(digits) >= 2:
        return int(digits[:-1]), int(digits[-1])
    raise ValueError(f"target architecture {arch!r}: expected sm_XY (e.g. sm_89) or X.Y (e.g. 8.9)")


def current_compute_capability(device: int = 0) -> tuple[int, int] | None:
    """The compute capability of CUDA device ``device`` through cuda-python, or None (no GPU / no cuda-python)."""
    try:
        driver = cuda_driver_module()
    except ImportError:
        return None
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        err, dev = driver.cuDeviceGet(device)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        attr = driver.CUdevice_attribute
        err1, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        err2, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    except Exception:  # a driver library that cannot even load: treat as "no GPU"
        return None
    if err1 != driver.CUresult.CUDA_SUCCESS or err2 != driver.CUresult.CUDA_SUCCESS:
        return None
    return int(major), int(minor)


def cuda_driver_module() -> ModuleType:
    """cuda-python's driver API module (``cuda.bindings.driver``, or ``cuda.cuda`` before cuda-python 12.6)."""
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError:
        try:
            return importlib.import_module("cuda.cuda")
        except ImportError as e:
            raise ImportError("cuda-python is not installed (`pip install cuda-python`); the TensorRT backend "
                              "allocates device buffers and streams through it") from e


# ---- builder-side differences ----------------------------------------------------------------------
class _Sink:
    """Where the process-wide logger appends error lines while :func:`collect_errors` is active."""

    lines: list[str] | None = None


_loggers: dict[str, Any] = {}


def make_logger(tk: Toolkit) -> Any:
    """The process-wide TensorRT logger for ``tk``: forwards to :mod:`logging`, drops the benign lines.

    TensorRT keeps the first logger handed to a builder or runtime for the whole process (it warns and
    ignores later ones), so there is exactly one per toolkit; :func:`collect_errors` captures its errors.
    """
    if tk.flavor in _loggers:
        return _loggers[tk.flavor]
    trt = tk.trt
    sev = trt.ILogger.Severity

    class _Logger(trt.ILogger):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            if any(b in msg for b in _BENIGN):
                log.debug("tensorrt: %s", msg)
            elif severity in (sev.INTERNAL_ERROR, sev.ERROR):
                log.error("tensorrt: %s", msg)
                if _Sink.lines is not None:
                    _Sink.lines.append(msg)
            elif severity == sev.WARNING:
                log.warning("tensorrt: %s", msg)
            else:
                log.debug("tensorrt: %s", msg)

    _loggers[tk.flavor] = _Logger()
    return _loggers[tk.flavor]


@contextmanager
def collect_errors() -> Iterator[list[str]]:
    """Collect the error lines TensorRT logs inside the ``with`` block (one build at a time, one thread)."""
    previous, _Sink.lines = _Sink.lines, []
    try:
        yield _Sink.lines
    finally:
        _Sink.lines = previous


def network_flags(tk: Toolkit) -> int:
    """Creation flags for a strongly typed network (the flag is required on 10.x, implied on 11.x and RTX)."""
    flag = getattr(tk.trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def supported_arches(tk: Toolkit) -> tuple[str, ...]:
    """Architectures the toolkit can build for from any machine (RTX); full TensorRT builds for its own GPU only."""
    if tk.flavor != RTX:
        return ()
    cc = tk.trt.ComputeCapability
    return tuple(arch_name(*parse_arch(n)) for n in cc.__members__ if n.startswith("SM"))


def set_target(tk: Toolkit, config: Any, arch: str) -> None:
    """Make ``config`` build for ``arch`` (RTX: one compute capability; full TensorRT: the current GPU, checked
    by the caller)."""
    if tk.flavor != RTX:
        return
    major, minor = parse_arch(arch)
    member = getattr(tk.trt.ComputeCapability, f"SM{major}{minor}", None)
    if member is None:
        raise ValueError(f"{tk.display} cannot target {arch}; it targets {', '.join(supported_arches(tk))}")
    config.num_compute_capabilities = 1
    if not config.set_compute_capability(member, 0):
        raise ValueError(f"{tk.display} refused target compute capability {arch}")


def half_type(tk: Toolkit, dtype: str) -> Any:
    """The TensorRT data type for ``"float16"`` / ``"bfloat16"``."""
    return {"float16": tk.trt.float16, "bfloat16": tk.trt.bfloat16}[dtype]
