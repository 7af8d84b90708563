"""TensorRT backend: one deserialized plan per segment, execution contexts bound to optimization profiles.

Written against the ``tensorrt`` runtime API (``Runtime.deserialize_cuda_engine``, ``IExecutionContext``
``set_optimization_profile_async`` / ``set_input_shape`` / ``set_tensor_address`` / ``execute_async_v3``);
TensorRT-RTX exposes the same calls. Device memory and the stream go through :class:`CudaDriver`, a small
cuda-python helper that tests replace with a double (no machine of this project can execute a plan).

Invariant 2 (DESIGN.md), ``profile_pinning``:

* ``per_context`` (default): every segment gets one ``IExecutionContext`` per profile (PREFILL = 0,
  DECODE = 1). Each context is bound to its profile once at load -- ``set_optimization_profile_async``, then
  its own device buffers, sized to the profile's max tokens, bound with ``set_tensor_address`` -- and is
  never switched while serving; :attr:`TrtEngine.profile_switches` stays 0.
* ``single_context``: one context per segment, buffers sized to the larger (PREFILL) profile. A batch of the
  other phase switches it: ``set_optimization_profile_async``, synchronize the stream, then rebind every
  input shape and every input and output address before the next enqueue. Switches are counted.

Invariant 3: before every ``execute_async_v3`` the context's ``active_optimization_profile`` must be the
bound one and every input shape must lie within ``engine.get_tensor_profile_shape(name, profile)``
min..max; otherwise :class:`ShapeError` is raised and nothing is enqueued.

Invariant 4: at load a plan built by another TensorRT flavour/version, or for another compute capability,
than the running one is refused with a :class:`BundleError` naming both.

Two ways to run a segment:

* host (:meth:`TrtEngine.run`, the default when no ``bindings`` are given): each context owns device buffers
  for its inputs and outputs; ``run`` copies the host inputs up, enqueues, copies the outputs back and
  synchronizes the stream after every segment. :class:`~hybrid_runtime.backend.HostBackend` uses it for a
  TensorRT bundle on the host path (``device="cpu"`` or ``trt_path="host"``; the host-mode tests' double).
* device-resident (:meth:`TrtEngine.run_bound`, with ``bindings``): every input and output of every context is
  bound once, with ``set_tensor_address``, to a device buffer the *runtime* owns (the step upload's token ids and
  positions, the activation banks and operator outputs of
  :class:`~hybrid_runtime.cuda.trt_backend.TrtDeviceBackend`); ``run_bound(segment, phase, n)`` checks the
  shapes, sets them and enqueues on the runtime's stream: no copy and no synchronize. The engine allocates no
  buffer of its own then.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .. import trt_compat
from ..config import BundleError, Manifest, ProfileSpec, SegmentSpec
from .base import PINNING_MODES, Engine, ExecutionContext, Phase, ShapeError

log = logging.getLogger("hybrid_runtime.engine")


class CudaApi(Protocol):
    """What the backend needs from CUDA: the device's compute capability, one stream, device buffers, copies."""

    def compute_capability(self) -> tuple[int, int]: ...
    def stream_create(self) -> int: ...
    def stream_synchronize(self, stream: int) -> None: ...
    def malloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def htod_async(self, dst: int, src: np.ndarray, stream: int) -> None: ...
    def dtoh_async(self, dst: np.ndarray, src: int, stream: int) -> None: ...


class CudaDriver:
    """:class:`CudaApi` through cuda-python's driver API (``cuda.bindings.driver``) on device ``device``.

    Retains the device's primary context (the one the CUDA runtime, and so TensorRT, uses) and makes it
    current on every thread that calls it: the engine is loaded on one thread and served from the engine
    thread (invariant 1), and a driver-API context is current per thread.
    """

    def __init__(self, device: int = 0) -> None:
        self.drv = d = trt_compat.cuda_driver_module()
        self._check(d.cuInit(0), "cuInit")
        self.device = self._check(d.cuDeviceGet(device), f"cuDeviceGet({device})")
        self.context = self._check(d.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self._threads: set[int] = set()
        self._current()

    def _current(self) -> None:
        tid = threading.get_ident()
        if tid not in self._threads:
            self._check(self.drv.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
            self._threads.add(tid)

    def _check(self, result: Any, what: str) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.drv.CUresult.CUDA_SUCCESS:
            _, name = self.drv.cuGetErrorName(err)
            raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
        return rest[0] if len(rest) == 1 else rest

    def compute_capability(self) -> tuple[int, int]:
        attr = self.drv.CUdevice_attribute
        major = self._check(self.drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                                          self.device), "cuDeviceGetAttribute")
        minor = self._check(self.drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                                          self.device), "cuDeviceGetAttribute")
        return int(major), int(minor)

    def stream_create(self) -> int:
        self._current()
        return int(self._check(self.drv.cuStreamCreate(0), "cuStreamCreate"))

    def stream_synchronize(self, stream: int) -> None:
        self._current()
        self._check(self.drv.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def malloc(self, nbytes: int) -> int:
        self._current()
        return int(self._check(self.drv.cuMemAlloc(max(1, nbytes)), f"cuMemAlloc({nbytes})"))

    def free(self, ptr: int) -> None:
        self._current()
        self._check(self.drv.cuMemFree(ptr), "cuMemFree")

    def htod_async(self, dst: int, src: np.ndarray, stream: int) -> None:
        self._current()
        self._check(self.drv.cuMemcpyHtoDAsync(dst, src.ctypes.data, src.nbytes, stream), "cuMemcpyHtoDAsync")

    def dtoh_async(self, dst: np.ndarray, src: int, stream: int) -> None:
        self._current()
        self._check(self.drv.cuMemcpyDtoHAsync(dst.ctypes.data, src, dst.nbytes, stream), "cuMemcpyDtoHAsync")


def _shape(width: int, tokens: int) -> tuple[int, ...]:
    return (tokens,) if width == 0 else (tokens, width)


@dataclass(frozen=True)
class Bindings:
    """A segment's runtime-owned device buffers (device-resident mode): ``addresses`` maps every input and output
    name to a device address whose buffer holds ``rows`` rows of ``[rows]`` / ``[rows, width]`` of the tensor's
    dtype (its row stride is the width). A step of more rows is refused before enqueue."""

    addresses: Mapping[str, int]
    rows: int


class TrtContext(ExecutionContext):
    """One segment's ``IExecutionContext`` bound to one profile, with device buffers for every input and output.

    Host mode (``bindings`` None): the context allocates device buffers of ``capacity`` rows
    (``[capacity]`` / ``[capacity, width]``) and host output buffers likewise; :meth:`run` returns views
    ``[num_tokens, width]`` of the host buffers, valid until this context runs again. Device-resident mode
    (``bindings``: every input and output name -> a runtime-owned device buffer of ``bindings.rows`` rows, which
    replaces ``capacity``): nothing is allocated, the addresses are bound once and :meth:`run_bound` enqueues on
    them.
    """

    def __init__(self, trt_engine: Any, context: Any, spec: SegmentSpec, profiles: tuple[ProfileSpec, ...],
                 phase: Phase, cuda: CudaApi, stream: int, capacity: int, bindings: Bindings | None = None) -> None:
        super().__init__(spec, profiles[phase])
        self.trt_engine, self.context, self.cuda, self.stream = trt_engine, context, cuda, stream
        self._profiles = profiles
        self.profile_index = int(phase)
        # rows every buffer holds: host mode >= the bound profile's max tokens; device-resident: the runtime's rows
        self.capacity = capacity if bindings is None else bindings.rows
        self._device: dict[str, int] = {}
        self._host_out: dict[str, np.ndarray] = {}
        self.bound = bindings is not None  # device-resident: the runtime owns every buffer
        names = [name for name, _, _ in (*spec.inputs, *spec.outputs)]
        if bindings is not None:
            missing = [n for n in names if not bindings.addresses.get(n)]
            if missing:
                raise BundleError(f"segment {spec.name}: no device buffer for {missing}")
            self._device = {n: int(bindings.addresses[n]) for n in names}
        else:
            for name, dt, width in (*spec.inputs, *spec.outputs):
                nbytes = capacity * max(width, 1) * np.dtype(dt).itemsize
                self._device[name] = cuda.malloc(nbytes)
            for name, dt, width in spec.outputs:
                self._host_out[name] = np.zeros(_shape(width, capacity), np.dtype(dt))
        self._limits: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.bind(self.profile_index)

    def bind(self, index: int) -> None:
        """Select profile ``index`` (``set_optimization_profile_async`` + stream sync), then bind every tensor
        address (inputs and outputs) and read the profile's min/max shapes of every input."""
        self.context.set_optimization_profile_async(index, self.stream)
        self.cuda.stream_synchronize(self.stream)
        self.profile_index = index
        self.profile = self._profiles[index]
        if not self.bound and self.profile.max_tokens > self.capacity:
            raise BundleError(f"segment {self.spec.name}: profile {self.profile.name} needs {self.profile.max_tokens} "
                              f"rows, buffers hold {self.capacity}")
        for name, _, _ in (*self.spec.inputs, *self.spec.outputs):
            if not self.context.set_tensor_address(name, self._device[name]):
                raise BundleError(f"segment {self.spec.name}: set_tensor_address({name}) refused")
        self._limits = {}
        for name, _, _ in self.spec.inputs:
            mn, _opt, mx = self.trt_engine.get_tensor_profile_shape(name, index)
            self._limits[name] = (tuple(mn), tuple(mx))

    def check_bound(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Invariant 3 at the TensorRT level: the active profile is the bound one and every shape fits it."""
        active = self.context.active_optimization_profile
        if active != self.profile_index:
            raise ShapeError(f"segment {self.spec.name}: context is on optimization profile {active}, bound to "
                             f"{self.profile_index} ({self.profile.name}); refusing to enqueue")
        for name, shape in shapes.items():
            mn, mx = self._limits[name]
            if len(shape) != len(mn) or any(s < a or s > b for s, a, b in zip(shape, mn, mx)):
                raise ShapeError(f"segment {self.spec.name} input {name}: shape {list(shape)} outside the "
                                 f"{self.profile.name} profile's {list(mn)}..{list(mx)}; refusing to enqueue")

    @property
    def addresses(self) -> dict[str, int]:
        """Tensor name -> the device address this context binds (its own buffers, or the runtime's)."""
        return dict(self._device)

    def run_bound(self, n: int) -> None:
        """Device-resident enqueue of ``n`` token rows: the inputs are already in the bound buffers (written by
        the runtime on its stream), the outputs stay there. Invariant 3 first (token count within the bound
        profile, active profile, every shape within ``get_tensor_profile_shape``), then ``set_input_shape`` and
        ``execute_async_v3``; no copy and no synchronize (the runtime's next kernels follow on the same stream)."""
        if not self.bound:
            raise RuntimeError(f"segment {self.spec.name}: run_bound on a context with its own buffers (use run)")
        p = self.profile
        if not p.min_tokens <= n <= p.max_tokens:
            raise ShapeError(f"segment {self.spec.name}: {n} tokens outside the {p.name} profile range "
                             f"{p.min_tokens}..{p.max_tokens}; refusing to enqueue")
        if n > self.capacity:
            raise ShapeError(f"segment {self.spec.name}: {n} tokens exceed the bound buffers' {self.capacity} rows")
        shapes = {name: _shape(width, n) for name, _, width in self.spec.inputs}
        self.check_bound(shapes)
        ctx = self.context
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, shape):
                raise ShapeError(f"segment {self.spec.name}: TensorRT refused input shape {name}{list(shape)}")
        if not ctx.execute_async_v3(self.stream):
            raise RuntimeError(f"segment {self.spec.name}: execute_async_v3 failed")
        for name, _, width in self.spec.outputs:
            got = tuple(ctx.get_tensor_shape(name))
            if got != _shape(width, n):
                raise RuntimeError(f"segment {self.spec.name} output {name}: TensorRT shape {list(got)}, expected "
                                   f"{list(_shape(width, n))}")

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.bound:
            raise RuntimeError(f"segment {self.spec.name}: its buffers are the runtime's device buffers; "
                               "host arrays cannot be run on it (use run_bound)")
        n = self.check(inputs)
        shapes = {name: tuple(inputs[name].shape) for name, _, _ in self.spec.inputs}
        self.check_bound(shapes)
        ctx, cuda, stream = self.context, self.cuda, self.stream
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, shape):
                raise ShapeError(f"segment {self.spec.name}: TensorRT refused input shape {name}{list(shape)}")
        keep = []  # host inputs must outlive their asynchronous copies
        for name in shapes:
            arr = np.ascontiguousarray(inputs[name])
            keep.append(arr)
            cuda.htod_async(self._device[name], arr, stream)
        if not ctx.execute_async_v3(stream):
            raise RuntimeError(f"segment {self.spec.name}: execute_async_v3 failed")
        outs = {}
        for name, _, width in self.spec.outputs:
            got = tuple(ctx.get_tensor_shape(name))
            if got != _shape(width, n):
                raise RuntimeError(f"segment {self.spec.name} output {name}: TensorRT shape {list(got)}, expected "
                                   f"{list(_shape(width, n))}")
            view = self._host_out[name][:n]
            cuda.dtoh_async(view, self._device[name], stream)
            outs[name] = view
        cuda.stream_synchronize(stream)
        del keep
        return outs

    def close(self) -> None:
        if not self.bound:  # the runtime's buffers are the runtime's to free
            for ptr in self._device.values():
                self.cuda.free(ptr)
        self._device.clear()


class TrtEngine(Engine):
    """All segments of a TensorRT bundle (``manifest.backend == "tensorrt"``).

    ``trt`` and ``cuda`` default to the installed TensorRT (see :mod:`hybrid_runtime.trt_compat`) and
    :class:`CudaDriver`; tests pass doubles. ``bindings`` (device-resident mode): segment index and spec ->
    that segment's :class:`Bindings` (the device address of every input and output, and how many rows the
    buffers hold); every context binds them once, and only :meth:`run_bound` runs segments. Without it every
    context allocates its own buffers and :meth:`run` copies host arrays through them.
    """

    def __init__(self, bundle_dir: str | Path, manifest: Manifest, pinning: str = "per_context", *,
                 trt: Any = None, cuda: CudaApi | None = None,
                 bindings: Callable[[int, SegmentSpec], Bindings] | None = None) -> None:
        if pinning not in PINNING_MODES:
            raise ValueError(f"profile_pinning={pinning!r}: choose one of {', '.join(PINNING_MODES)}")
        if manifest.backend != "tensorrt":
            raise BundleError(f"bundle backend is {manifest.backend!r}, not 'tensorrt'")
        if trt is None:
            try:
                trt = trt_compat.load().trt
            except trt_compat.TensorRTUnavailable as e:
                raise BundleError(f"{bundle_dir}: this TensorRT bundle needs TensorRT: {e}") from e
        self.trt = trt
        self._check_toolkit(manifest)
        if cuda is None:
            try:
                cuda = CudaDriver()
            except Exception as e:  # no cuda-python, no driver, no device: all mean "not here"
                raise BundleError(f"{bundle_dir}: the TensorRT backend needs an NVIDIA GPU and cuda-python: {e}") from e
        self.cuda: CudaApi = cuda
        self._check_arch(manifest)
        self.pinning = pinning
        self.profile_switches = 0
        self._specs = manifest.segments
        self._profiles = manifest.profiles
        for wa in manifest.workarounds:
            log.info("tensorrt bundle workaround %s: %s", wa["id"], wa["action"])
        self.stream = self.cuda.stream_create()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._engines: list[Any] = []
        self._contexts: list[list[TrtContext]] = []
        # per segment, per profile: input name -> (min shape, max shape) from the plan (check_rows)
        self._plan_limits: list[list[dict[str, Any]]] = []
        self.bound = bindings is not None
        for si, spec in enumerate(self._specs):
            eng = self._deserialize(Path(bundle_dir), spec)
            self._check_profiles(eng, spec, manifest)
            self._engines.append(eng)
            self._plan_limits.append([{name: tuple(tuple(d) for d in eng.get_tensor_profile_shape(name, int(ph))[::2])
                                       for name, _, _ in spec.inputs} for ph in Phase])
            bound = bindings(si, spec) if bindings is not None else None
            if pinning == "per_context":
                ctxs = [self._new_context(eng, spec, phase, self._profiles[phase].max_tokens, bound)
                        for phase in Phase]
            else:
                cap = max(p.max_tokens for p in self._profiles)
                ctxs = [self._new_context(eng, spec, Phase.PREFILL, cap, bound)]
            self._contexts.append(ctxs)
        log.info("tensorrt engine (%s %s, %s): %d segments, %d contexts (%s)", manifest.toolkit.get("tensorrt_flavor"),
                 manifest.toolkit.get("tensorrt_version"), manifest.target.get("arch"), len(self._specs),
                 self.num_contexts(), pinning)

    # ---- load --------------------------------------------------------------------------------------
    def _check_toolkit(self, m: Manifest) -> None:
        """Refuse plans built by another TensorRT flavour or version (plans are not portable across them)."""
        flavor, version = trt_compat.flavor_of(self.trt), str(self.trt.__version__)
        built = (m.toolkit.get("tensorrt_flavor"), m.toolkit.get("tensorrt_version"))
        if built != (flavor, version):
            raise BundleError(f"bundle plans were built with {built[0]} {built[1]}, but this runtime has {flavor} "
                              f"{version}; rebuild the bundle with this TensorRT "
                              "(python -m builder build --backend tensorrt ...)")

    def _check_arch(self, m: Manifest) -> None:
        """Refuse plans built for another compute capability than the current device's."""
        running = trt_compat.arch_name(*self.cuda.compute_capability())
        if m.target.get("arch") != running:
            raise BundleError(f"bundle plans were built for {m.target.get('arch')}, but this GPU is {running}; "
                              f"rebuild the bundle with --target-arch {running} (or on this GPU)")

    def _deserialize(self, bundle_dir: Path, spec: SegmentSpec) -> Any:
        if not spec.plan:
            raise BundleError(f"segment {spec.name} has no TensorRT plan in the manifest")
        path = bundle_dir / spec.plan
        if not path.is_file():
            raise BundleError(f"segment {spec.name}: plan {path} is missing")
        eng = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if eng is None:
            raise BundleError(f"segment {spec.name}: TensorRT could not deserialize {path} (see its log above)")
        return eng

    def _check_profiles(self, eng: Any, spec: SegmentSpec, m: Manifest) -> None:
        """The plan's two profiles must be the manifest's (``trt_profiles``), input by input."""
        if eng.num_optimization_profiles != 2:
            raise BundleError(f"segment {spec.name}: plan has {eng.num_optimization_profiles} optimization "
                              "profiles, expected 2 (PREFILL, DECODE)")
        recorded = m.trt_profiles.get(spec.name)
        if recorded is None or len(recorded) != 2:
            raise BundleError(f"segment {spec.name}: manifest records no trt_profiles for it")
        for rec in recorded:
            for name, s in rec["inputs"].items():
                got = [list(d) for d in eng.get_tensor_profile_shape(name, rec["index"])]
                if got != [s["min"], s["opt"], s["max"]]:
                    raise BundleError(f"segment {spec.name} input {name}: plan profile {rec['index']} is "
                                      f"{got}, the manifest records {[s['min'], s['opt'], s['max']]}")

    def _new_context(self, eng: Any, spec: SegmentSpec, phase: Phase, capacity: int,
                     bindings: Bindings | None = None) -> TrtContext:
        ctx = eng.create_execution_context()
        if ctx is None:
            raise BundleError(f"segment {spec.name}: create_execution_context failed (device memory?)")
        return TrtContext(eng, ctx, spec, self._profiles, phase, self.cuda, self.stream, capacity, bindings)

    # ---- serving ---------------------------------------------------------------------------------
    @property
    def segments(self) -> tuple[SegmentSpec, ...]:
        return self._specs

    def num_contexts(self) -> int:
        return sum(len(c) for c in self._contexts)

    def context(self, segment: int, phase: Phase) -> TrtContext:
        ctxs = self._contexts[segment]
        if self.pinning == "per_context":
            return ctxs[phase]
        ctx = ctxs[0]
        if ctx.profile_index != int(phase):
            ctx.bind(int(phase))  # switch, sync, rebind every address; shapes are set before the enqueue
            self.profile_switches += 1
        return ctx

    def run(self, segment: int, phase: Phase, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run segment ``segment`` on the ``phase`` context; returns host arrays ``[num_tokens, width]``."""
        return self.context(segment, phase).run(inputs)

    def check_rows(self, phase: Phase, rows: Sequence[int]) -> None:
        """Invariant 3 for a whole step, host-side, before anything of it is launched: ``rows[i]`` token rows for
        segment ``i`` (0: not run) within the ``phase`` profile's token range, the plan's
        ``get_tensor_profile_shape`` for that profile (read at load) and the bound buffers' rows. ``run_bound``
        checks each enqueue again (with the context's active profile)."""
        if len(rows) != len(self._specs):
            raise ValueError(f"{len(rows)} row counts for {len(self._specs)} segments")
        p = self._profiles[phase]
        for si, n in enumerate(rows):
            if n == 0:
                continue
            spec = self._specs[si]
            if not p.min_tokens <= n <= p.max_tokens:
                raise ShapeError(f"segment {spec.name}: {n} tokens outside the {p.name} profile range "
                                 f"{p.min_tokens}..{p.max_tokens}; refusing the step")
            cap = min(c.capacity for c in self._contexts[si])
            if n > cap:
                raise ShapeError(f"segment {spec.name}: {n} tokens exceed the bound buffers' {cap} rows; refusing "
                                 "the step")
            for name, _, width in spec.inputs:
                mn, mx = self._plan_limits[si][int(phase)][name]
                shape = _shape(width, n)
                if len(shape) != len(mn) or any(x < a or x > b for x, a, b in zip(shape, mn, mx)):
                    raise ShapeError(f"segment {spec.name} input {name}: shape {list(shape)} outside the {p.name} "
                                     f"profile's {list(mn)}..{list(mx)}; refusing the step")

    def run_bound(self, segment: int, phase: Phase, n: int) -> None:
        """Device-resident: enqueue segment ``segment`` on the ``phase`` context over ``n`` token rows of the
        bound runtime buffers (:meth:`TrtContext.run_bound`; a ``single_context`` switch rebinds first)."""
        self.context(segment, phase).run_bound(n)

    def close(self) -> None:
        """Free every device buffer (contexts and engines are released with the object)."""
        for ctxs in self._contexts:
            for c in ctxs:
                c.close()
