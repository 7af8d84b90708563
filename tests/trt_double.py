"""The recording test double of the ``tensorrt`` runtime API and of the CUDA calls the TensorRT backend makes,
shared by the TensorRT runtime tests (``tests/unit/test_tensorrt_runtime.py``, ``test_tensorrt_device.py``) and
the GPU test of the device-resident path (``tests/gpu/test_trt_device_gpu.py``).

A double is used because executing a TensorRT plan needs an NVIDIA GPU with full TensorRT (or an RTX GPU
with TensorRT-RTX), and no machine of this project -- developers' or CI's -- has one. The double stands in
for the ``tensorrt`` runtime API (``Runtime.deserialize_cuda_engine``, ``ICudaEngine``, ``IExecutionContext``)
and for :class:`hybrid_runtime.engine.tensorrt.CudaDriver`; it records every call. It models the TensorRT
rules the backend relies on: a context starts on profile 0, switching a profile drops the context's input
shapes and tensor addresses, ``set_input_shape`` refuses shapes outside the active profile, and an enqueue
needs every input shape and every input/output address bound. Its ``execute_async_v3`` reads the inputs
from the double's device memory at the bound addresses, runs the segment's ONNX with onnxruntime and writes
the outputs back (the only copies it makes are its own, standing in for a plan's kernels). The "plans" are
JSON files naming the segment's ONNX and its two profiles (:func:`write_trt_bundle`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from builder.tensorrt import expected_profiles
from hybrid_runtime.config import Manifest, SegmentSpec
from hybrid_runtime.engine import Phase
from hybrid_runtime.engine.ort_session import cpu_session, session_options
from hybrid_runtime.runner import ModelRunner
from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.scheduler import Scheduler, Sequence

TRT_VERSION = "10.13.0.35"
ARCH = "sm_89"


class Recorder:
    """Every call the backend makes, in order: (who, op, detail)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any]] = []

    def __call__(self, who: str, op: str, detail: Any = None) -> None:
        self.events.append((who, op, detail))

    def ops(self, op: str) -> list[tuple[str, str, Any]]:
        return [e for e in self.events if e[1] == op]


class FakeCuda:
    """Device memory as byte arrays keyed by fake addresses; one stream."""

    def __init__(self, rec: Recorder, cc: tuple[int, int] = (8, 9)) -> None:
        self.rec, self.cc = rec, cc
        self.mem: dict[int, np.ndarray] = {}
        self._next = 0x10000

    def compute_capability(self) -> tuple[int, int]:
        return self.cc

    def stream_create(self) -> int:
        return 7

    def stream_synchronize(self, stream: int) -> None:
        assert stream == 7
        self.rec("cuda", "sync")

    def malloc(self, nbytes: int) -> int:
        ptr, self._next = self._next, self._next + nbytes + 256
        self.mem[ptr] = np.zeros(nbytes, np.uint8)
        return ptr

    def free(self, ptr: int) -> None:
        del self.mem[ptr]

    def htod_async(self, dst: int, src: np.ndarray, stream: int) -> None:
        buf = self.mem[dst]
        assert src.flags.c_contiguous and src.nbytes <= buf.nbytes, "host->device copy overflows the buffer"
        buf[:src.nbytes] = np.frombuffer(src.tobytes(), np.uint8)
        self.rec("cuda", "htod", dst)

    def dtoh_async(self, dst: np.ndarray, src: int, stream: int) -> None:
        buf = self.mem[src]
        assert dst.flags.c_contiguous and dst.nbytes <= buf.nbytes
        dst[...] = np.frombuffer(buf[:dst.nbytes].tobytes(), dst.dtype).reshape(dst.shape)
        self.rec("cuda", "dtoh", src)

    # what the fake TensorRT kernels use to reach "device" memory
    def read(self, ptr: int, nbytes: int) -> bytes:
        return self.mem[ptr][:nbytes].tobytes()

    def write(self, ptr: int, data: np.ndarray) -> None:
        buf = self.mem[ptr]
        assert data.nbytes <= buf.nbytes, "output overflows its device buffer"
        buf[:data.nbytes] = np.frombuffer(np.ascontiguousarray(data).tobytes(), np.uint8)


class DeviceCuda:
    """The real :class:`CudaDriver` (cuda-python on a GPU), recorded; the fake kernels copy through it."""

    def __init__(self, rec: Recorder, cc: tuple[int, int] | None = None) -> None:
        from hybrid_runtime.engine.tensorrt import CudaDriver

        self.rec, self.drv = rec, CudaDriver()
        self.cc = cc or self.drv.compute_capability()
        self.sizes: dict[int, int] = {}
        self._stream = self.drv.stream_create()

    def compute_capability(self) -> tuple[int, int]:
        return self.cc

    def stream_create(self) -> int:
        return self._stream

    def stream_synchronize(self, stream: int) -> None:
        self.drv.stream_synchronize(stream)
        self.rec("cuda", "sync")

    def malloc(self, nbytes: int) -> int:
        ptr = self.drv.malloc(nbytes)
        self.sizes[ptr] = nbytes
        return ptr

    def free(self, ptr: int) -> None:
        self.drv.free(ptr)

    def htod_async(self, dst: int, src: np.ndarray, stream: int) -> None:
        assert src.nbytes <= self.sizes[dst]
        self.drv.htod_async(dst, src, stream)
        self.rec("cuda", "htod", dst)

    def dtoh_async(self, dst: np.ndarray, src: int, stream: int) -> None:
        assert dst.nbytes <= self.sizes[src]
        self.drv.dtoh_async(dst, src, stream)
        self.rec("cuda", "dtoh", src)

    def read(self, ptr: int, nbytes: int) -> bytes:
        out = np.empty(nbytes, np.uint8)
        self.drv.dtoh_async(out, ptr, self._stream)
        self.drv.stream_synchronize(self._stream)
        return out.tobytes()

    def write(self, ptr: int, data: np.ndarray) -> None:
        assert data.nbytes <= self.sizes[ptr], "output overflows its device buffer"
        self.drv.htod_async(ptr, np.ascontiguousarray(data), self._stream)
        self.drv.stream_synchronize(self._stream)


class FakeContext:
    """IExecutionContext: profile, shapes and addresses as TensorRT keeps them; execution through onnxruntime."""

    def __init__(self, engine: FakeEngine, ident: str) -> None:
        self.engine, self.id, self.rec = engine, ident, engine.rec
        self._active = 0  # TensorRT: a new context starts on profile 0
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    @property
    def active_optimization_profile(self) -> int:
        return self._active

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.rec(self.id, "set_profile", index)
        self._active = index
        self.shapes.clear()  # switching drops the bindings: the caller must set them again
        self.addresses.clear()
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.rec(self.id, "set_input_shape", (name, tuple(shape)))
        mn, _, mx = self.engine.get_tensor_profile_shape(name, self._active)
        if len(shape) != len(mn) or any(s < a or s > b for s, a, b in zip(shape, mn, mx)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.rec(self.id, "set_tensor_address", name)
        self.addresses[name] = ptr
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        n = next(iter(self.shapes.values()))[0]
        width = self.engine.widths[name]
        return (n,) if width == 0 else (n, width)

    def execute_async_v3(self, stream: int) -> bool:
        self.rec(self.id, "execute", self._active)
        eng = self.engine
        missing = [n for n, _, _ in eng.plan["inputs"] if n not in self.shapes or n not in self.addresses]
        missing += [n for n, _, _ in eng.plan["outputs"] if n not in self.addresses]
        assert not missing, f"{self.id}: enqueue with unbound tensors {missing}"
        feeds = {}
        for name, dt, _ in eng.plan["inputs"]:
            shape = self.shapes[name]
            nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
            feeds[name] = np.frombuffer(eng.cuda.read(self.addresses[name], nbytes), dt).reshape(shape)
        outs = eng.session.run(None, feeds)
        for (name, _, _), arr in zip(eng.plan["outputs"], outs):
            eng.cuda.write(self.addresses[name], arr)
        return True


class FakeEngine:
    """ICudaEngine of one fake plan."""

    def __init__(self, plan: dict[str, Any], rec: Recorder, cuda: FakeCuda | DeviceCuda) -> None:
        self.plan, self.rec, self.cuda = plan, rec, cuda
        self.contexts: list[FakeContext] = []
        self.widths = {n: w for n, _, w in (*plan["inputs"], *plan["outputs"])}
        self.session = cpu_session(plan["onnx"], session_options())  # the process-wide pool, as the runtime
        self.session.get_outputs()  # output order == plan["outputs"] order (checked below)
        assert [o.name for o in self.session.get_outputs()] == [n for n, _, _ in plan["outputs"]]

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.plan["profiles"])

    def get_tensor_profile_shape(self, name: str, index: int) -> list[tuple[int, ...]]:
        s = self.plan["profiles"][index]["inputs"][name]
        return [tuple(s["min"]), tuple(s["opt"]), tuple(s["max"])]

    def create_execution_context(self) -> FakeContext:
        ctx = FakeContext(self, f"{self.plan['segment']}#{len(self.contexts)}")
        self.contexts.append(ctx)
        self.rec(ctx.id, "create_context")
        return ctx


class FakeTrt:
    """The ``tensorrt`` module as the backend uses it."""

    class Logger:
        WARNING = 2

        def __init__(self, severity: int) -> None:
            self.severity = severity

    def __init__(self, rec: Recorder, cuda: FakeCuda | DeviceCuda, version: str = TRT_VERSION,
                 name: str = "tensorrt") -> None:
        self.__name__, self.__version__ = name, version
        self.rec, self.cuda = rec, cuda
        self.engines: list[FakeEngine] = []

    def Runtime(self, logger: Any) -> Any:  # the TensorRT spelling
        double = self

        class _Runtime:
            def deserialize_cuda_engine(self, blob: bytes) -> FakeEngine:
                plan = json.loads(blob)
                double.rec(plan["segment"], "deserialize")
                eng = FakeEngine(plan, double.rec, double.cuda)
                double.engines.append(eng)
                return eng

        return _Runtime()


def make_double(version: str = TRT_VERSION, cc: tuple[int, int] = (8, 9), name: str = "tensorrt",
                gpu: bool = False) -> tuple[FakeTrt, FakeCuda | DeviceCuda, Recorder]:
    """The fake ``tensorrt`` module over fake device memory, or (``gpu``) over a real GPU via cuda-python."""
    rec = Recorder()
    cuda = DeviceCuda(rec, cc) if gpu else FakeCuda(rec, cc)
    return FakeTrt(rec, cuda, version, name), cuda, rec


def write_trt_bundle(cpu: Path, trt: Path, arch: str = ARCH) -> Path:
    """``trt``: a copy of the onnxruntime bundle ``cpu`` made a TensorRT bundle whose plans are the double's JSON
    plans (each naming the segment's ONNX, its two profiles and its inputs / outputs), built for ``arch``."""
    shutil.copytree(cpu, trt)
    m = Manifest.load(cpu)
    specs, profiles = [], {}
    for s in m.segments:
        profiles[s.name] = expected_profiles(s, m.limits)
        rel = f"segments/{s.name}.plan"
        (trt / rel).write_text(json.dumps({"segment": s.name, "onnx": str(trt / s.onnx), "profiles": profiles[s.name],
                                           "inputs": s.inputs, "outputs": s.outputs}))
        specs.append(SegmentSpec(s.name, s.onnx, s.inputs, s.outputs, plan=rel))
    major, minor = arch.removeprefix("sm_")[:-1], arch[-1]
    dataclasses.replace(m, backend="tensorrt", dtype="float32", segments=tuple(specs), trt_profiles=profiles,
                        toolkit={"tensorrt_flavor": "tensorrt", "tensorrt_version": TRT_VERSION},
                        target={"device": "cuda", "arch": arch, "compute_capability": f"{major}.{minor}"}).save(trt)
    return trt


def drive(runner: ModelRunner, prompts: list[list[int]], max_new: int, every: int = 3, group: int = 4,
          on_step: Any = None) -> tuple[list[list[int]], list[Phase]]:
    """A continuously batched greedy workload (prefill and decode steps interleave); ``on_step(phase)`` after each
    step. Returns every request's tokens and the phase of every step."""
    lim = runner.manifest.limits
    sched = Scheduler(lim, lim.max_batch_size, lim.num_kv_pages, runner.ops.reset_slot)
    seqs = [Sequence(str(i), p, SamplingParams(max_tokens=max_new), max_len=len(p) + max_new)
            for i, p in enumerate(prompts)]
    pending, phases, step = list(seqs), [], 0
    while pending or sched.running or sched.waiting:
        if step % every == 0:
            for s in pending[:group]:
                sched.add(s)
            pending = pending[group:]
        step += 1
        batch = sched.schedule()
        if batch is None:
            continue
        logits = runner.run(batch.phase, batch.steps)
        phases.append(batch.phase)
        if on_step is not None:
            on_step(batch.phase)
        sched.advance(batch)
        need = [s for s, st in zip(batch.seqs, batch.steps) if st.need_logits]
        for s, row in zip(need, logits):
            s.output_ids.append(int(np.argmax(row)))
            if len(s.output_ids) >= max_new:
                sched.finish(s)
    return [s.output_ids for s in seqs], phases


MAX_BATCH, MAX_TOKENS = 16, 64  # the limits of the test bundles below (DECODE 1..16 rows, PREFILL 1..64 tokens)


def cpu_and_trt_bundles(checkpoint: Path, root: Path) -> tuple[Path, Path]:
    """(an onnxruntime bundle of ``checkpoint`` at :data:`MAX_BATCH` / :data:`MAX_TOKENS`, the same bundle as a
    TensorRT bundle whose plans are the double's JSON plans), under ``root``."""
    from builder.bundle import BuildOptions, build_bundle

    cpu = root / "cpu"
    build_bundle(checkpoint, cpu, BuildOptions(max_batch_size=MAX_BATCH, max_input_len=48, max_seq_len=96,
                                               max_num_tokens=MAX_TOKENS), progress=lambda _m: None)
    return cpu, write_trt_bundle(cpu, root / "trt")
