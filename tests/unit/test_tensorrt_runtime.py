"""The TensorRT runtime backend's control logic, against a recording test double of TensorRT and CUDA.

A double is used because executing a TensorRT plan needs an NVIDIA GPU with full TensorRT (or an RTX GPU
with TensorRT-RTX), and no machine of this project -- developers' or CI's -- has one. The double stands in
for the ``tensorrt`` runtime API (``Runtime.deserialize_cuda_engine``, ``ICudaEngine``, ``IExecutionContext``)
and for :class:`hybrid_runtime.engine.tensorrt.CudaDriver`; it records every call. It models the TensorRT
rules the backend relies on: a context starts on profile 0, switching a profile drops the context's input
shapes and tensor addresses, ``set_input_shape`` refuses shapes outside the active profile, and an enqueue
needs every input shape and every input/output address bound. Its ``execute_async_v3`` reads the inputs
from the double's device memory at the bound addresses, runs the segment's ONNX with onnxruntime and writes
the outputs back, so a whole model runs through :class:`ModelRunner` and gives real tokens to compare with
the CPU backend. The "plans" are JSON files naming the segment's ONNX and its two profiles.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from builder.bundle import BuildOptions, build_bundle
from builder.tensorrt import expected_profiles
from hybrid_runtime import trt_compat
from hybrid_runtime.config import BundleError, Manifest, SegmentSpec
from hybrid_runtime.engine import Phase, ShapeError, load_engine
from hybrid_runtime.engine.ort_session import cpu_session, session_options
from hybrid_runtime.engine.tensorrt import TrtEngine
from hybrid_runtime.runner import ModelRunner
from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.scheduler import Scheduler, Sequence

TRT_VERSION = "10.13.0.35"
ARCH = "sm_89"
MAX_BATCH, MAX_TOKENS = 16, 64


# ---- the double --------------------------------------------------------------------------------------
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


# ---- bundles -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bundles(default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(CPU bundle, the same bundle as a TensorRT bundle whose plans are the double's JSON plans)."""
    root = tmp_path_factory.mktemp("trt_runtime")
    cpu = root / "cpu"
    build_bundle(default_checkpoint, cpu, BuildOptions(max_batch_size=MAX_BATCH, max_input_len=48, max_seq_len=96,
                                                       max_num_tokens=MAX_TOKENS), progress=lambda _m: None)
    trt = root / "trt"
    shutil.copytree(cpu, trt)
    m = Manifest.load(cpu)
    specs, profiles = [], {}
    for s in m.segments:
        profiles[s.name] = expected_profiles(s, m.limits)
        rel = f"segments/{s.name}.plan"
        (trt / rel).write_text(json.dumps({"segment": s.name, "onnx": str(trt / s.onnx), "profiles": profiles[s.name],
                                           "inputs": s.inputs, "outputs": s.outputs}))
        specs.append(SegmentSpec(s.name, s.onnx, s.inputs, s.outputs, plan=rel))
    dataclasses.replace(m, backend="tensorrt", dtype="float32", segments=tuple(specs), trt_profiles=profiles,
                        toolkit={"tensorrt_flavor": "tensorrt", "tensorrt_version": TRT_VERSION},
                        target={"device": "cuda", "arch": ARCH, "compute_capability": "8.9"}).save(trt)
    return cpu, trt


def drive(runner: ModelRunner, prompts: list[list[int]], max_new: int, every: int = 3, group: int = 4
          ) -> tuple[list[list[int]], list[Phase]]:
    """A continuously batched greedy workload: ``group`` requests arrive every ``every`` steps, so prefill
    and decode steps interleave; returns every request's tokens and the phase of every step."""
    lim = runner.manifest.limits
    sched = Scheduler(lim, lim.max_batch_size, lim.num_kv_pages, runner.state.reset)
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
        sched.advance(batch)
        need = [s for s, st in zip(batch.seqs, batch.steps) if st.need_logits]
        for s, row in zip(need, logits):
            s.output_ids.append(int(np.argmax(row)))
            if len(s.output_ids) >= max_new:
                sched.finish(s)
    return [s.output_ids for s in seqs], phases


def _prompts(n: int = 16) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(3, 2000, int(rng.integers(3, 41)))] for _ in range(n)]


def _trt_runner(trt_dir: Path, pinning: str, **double: Any) -> tuple[ModelRunner, FakeTrt, Recorder]:
    fake, cuda, rec = make_double(**double)
    m = Manifest.load(trt_dir)
    engine = TrtEngine(trt_dir, m, pinning, trt=fake, cuda=cuda)
    return ModelRunner(trt_dir, m, engine=engine), fake, rec


# ---- tests -------------------------------------------------------------------------------------------
def test_per_context_mixed_workload_never_switches_and_matches_cpu(bundles: tuple[Path, Path]) -> None:
    cpu_dir, trt_dir = bundles
    prompts = _prompts(16)
    want, _ = drive(ModelRunner(cpu_dir, Manifest.load(cpu_dir)), prompts, max_new=6)
    runner, fake, rec = _trt_runner(trt_dir, "per_context")
    n_seg = len(runner.plans)
    loaded = len(rec.events)
    got, phases = drive(runner, prompts, max_new=6)

    assert got == want, "tokens through the TensorRT backend (double) differ from the CPU backend"
    first_decode = phases.index(Phase.DECODE)
    assert Phase.PREFILL in phases[first_decode:], "prefill and decode steps did not interleave"
    assert max(len(t) for t in got) == 6 and len(got) == 16
    # One context per (segment, profile), each bound once at load; none switched while serving.
    assert runner.engine.profile_switches == 0 and runner.engine.num_contexts() == 2 * n_seg
    assert len(fake.engines) == n_seg and all(len(e.contexts) == 2 for e in fake.engines)
    for e in fake.engines:
        assert [c.active_optimization_profile for c in e.contexts] == [Phase.PREFILL, Phase.DECODE]
    assert [e for e in rec.events[loaded:] if e[1] in ("set_profile", "set_tensor_address", "create_context",
                                                        "deserialize")] == []
    assert len(rec.ops("set_profile")) == 2 * n_seg
    # Every enqueue ran on the context bound to its step's phase.
    executes = rec.ops("execute")
    assert executes and all(e[2] == int(e[0].split("#")[1]) for e in executes)


@pytest.mark.skipif(trt_compat.current_compute_capability() is None, reason="no CUDA GPU (or no cuda-python)")
def test_per_context_workload_through_cuda_python_on_a_gpu(bundles: tuple[Path, Path]) -> None:
    """The same workload with the real CudaDriver moving every tensor through device memory (TensorRT is
    still the double: its kernels read the bound device buffers and write the outputs back)."""
    cpu_dir, trt_dir = bundles
    prompts = _prompts(16)
    want, _ = drive(ModelRunner(cpu_dir, Manifest.load(cpu_dir)), prompts, max_new=6)
    runner, _, rec = _trt_runner(trt_dir, "per_context", cc=(8, 9), gpu=True)  # fake plans say sm_89
    got, _ = drive(runner, prompts, max_new=6)
    assert got == want and runner.engine.profile_switches == 0
    assert rec.ops("htod") and rec.ops("dtoh")
    runner.engine.close()


def test_single_context_rebinds_every_tensor_after_each_switch(bundles: tuple[Path, Path]) -> None:
    cpu_dir, trt_dir = bundles
    prompts = _prompts(8)
    want, _ = drive(ModelRunner(cpu_dir, Manifest.load(cpu_dir)), prompts, max_new=4, group=2)
    runner, fake, rec = _trt_runner(trt_dir, "single_context")
    loaded = len(rec.events)
    got, _ = drive(runner, prompts, max_new=4, group=2)
    assert got == want
    assert runner.engine.num_contexts() == len(runner.plans) and all(len(e.contexts) == 1 for e in fake.engines)
    switches = [e for e in rec.events[loaded:] if e[1] == "set_profile"]
    assert runner.engine.profile_switches == len(switches) > 0

    io = {e.plan["segment"]: ({n for n, _, _ in e.plan["inputs"]},
                              {n for n, _, _ in (*e.plan["inputs"], *e.plan["outputs"])}) for e in fake.engines}
    checked = 0
    for i, (who, op, _) in enumerate(rec.events):
        if i < loaded or op != "set_profile":
            continue
        inputs, tensors = io[who.split("#")[0]]
        shapes, addresses, synced = set(), set(), False
        for who2, op2, detail in rec.events[i + 1:]:
            if who2 == "cuda" and op2 == "sync" and not addresses:
                synced = True
            if who2 != who:
                continue
            if op2 == "set_input_shape":
                shapes.add(detail[0])
            elif op2 == "set_tensor_address":
                addresses.add(detail)
            elif op2 in ("execute", "set_profile"):
                assert op2 == "execute", f"{who}: switched twice without an enqueue in between"
                break
        assert synced, f"{who}: no stream synchronize between the switch and the rebinding"
        assert shapes == inputs, f"{who}: inputs {inputs - shapes} not rebound before the enqueue"
        assert addresses == tensors, f"{who}: tensors {tensors - addresses} not rebound before the enqueue"
        checked += 1
    assert checked == len(switches)


def test_shapes_outside_the_bound_profile_are_refused_before_enqueue(bundles: tuple[Path, Path]) -> None:
    _, trt_dir = bundles
    fake, cuda, rec = make_double()
    m = Manifest.load(trt_dir)
    engine = TrtEngine(trt_dir, m, "per_context", trt=fake, cuda=cuda)
    hidden = m.model.hidden_size
    head = len(m.segments) - 1
    before = len(rec.events)

    too_many = {"x": np.zeros((MAX_BATCH + 1, hidden), np.float32)}  # DECODE allows 1..16 tokens
    with pytest.raises(ShapeError, match="decode"):
        engine.run(head, Phase.DECODE, too_many)
    with pytest.raises(ShapeError, match="x"):
        engine.run(head, Phase.PREFILL, {"x": np.zeros((4, hidden + 1), np.float32)})
    with pytest.raises(ShapeError, match="tokens"):
        engine.run(head, Phase.PREFILL, {"x": np.zeros((MAX_TOKENS + 1, hidden), np.float32)})
    # A context that is not on its bound profile is refused too (TensorRT-level check).
    ctx = engine.context(head, Phase.DECODE)
    ctx.context.set_optimization_profile_async(0, 7)
    with pytest.raises(ShapeError, match="optimization profile 0"):
        engine.run(head, Phase.DECODE, {"x": np.zeros((2, hidden), np.float32)})
    # Shapes are checked against engine.get_tensor_profile_shape, not only against the manifest.
    ctx = engine.context(head, Phase.PREFILL)
    ctx._limits["x"] = ((1, hidden), (8, hidden))
    with pytest.raises(ShapeError, match=r"outside the prefill profile's \[1, 128\]..\[8, 128\]"):
        engine.run(head, Phase.PREFILL, {"x": np.zeros((9, hidden), np.float32)})
    refused = rec.events[before:]
    assert not [e for e in refused if e[1] in ("execute", "htod", "dtoh", "set_input_shape")], refused
    out = engine.run(head, Phase.PREFILL, {"x": np.ones((3, hidden), np.float32)})  # within range: runs
    assert out["logits"].shape == (3, m.model.vocab_size) and rec.ops("execute")


@pytest.mark.parametrize("double, message", [
    ({"version": "10.14.1.48"}, r"built with tensorrt 10\.13\.0\.35, but this runtime has tensorrt 10\.14\.1\.48"),
    ({"name": "tensorrt_rtx_bindings"}, r"built with tensorrt 10\.13\.0\.35, but this runtime has tensorrt_rtx"),
    ({"cc": (8, 6)}, r"built for sm_89, but this GPU is sm_86"),
    ({"cc": (9, 0)}, r"built for sm_89, but this GPU is sm_90"),
])
def test_other_toolkit_or_architecture_is_refused_at_load(bundles: tuple[Path, Path], double: dict,
                                                          message: str) -> None:
    _, trt_dir = bundles
    fake, cuda, rec = make_double(**double)
    with pytest.raises(BundleError, match=message):
        TrtEngine(trt_dir, Manifest.load(trt_dir), trt=fake, cuda=cuda)
    assert not rec.ops("deserialize") and not rec.ops("create_context")


def test_plan_profiles_must_match_the_manifest(bundles: tuple[Path, Path], tmp_path: Path) -> None:
    _, trt_dir = bundles
    bad = tmp_path / "bad"
    shutil.copytree(trt_dir, bad)
    plan_path = bad / "segments" / "head.plan"
    plan = json.loads(plan_path.read_text())
    plan["profiles"][1]["inputs"]["x"]["max"][0] = 8
    plan_path.write_text(json.dumps(plan))
    fake, cuda, _ = make_double()
    with pytest.raises(BundleError, match="head input x: plan profile 1"):
        TrtEngine(bad, Manifest.load(bad), trt=fake, cuda=cuda)
    plan["profiles"] = plan["profiles"][:1]
    plan_path.write_text(json.dumps(plan))
    with pytest.raises(BundleError, match="1 optimization profiles, expected 2"):
        TrtEngine(bad, Manifest.load(bad), trt=fake, cuda=cuda)


def test_load_engine_picks_the_tensorrt_backend(bundles: tuple[Path, Path]) -> None:
    """Without a GPU and full TensorRT the real backend refuses the bundle at load with a BundleError (which
    one depends on what is installed: no TensorRT, TensorRT-RTX instead of TensorRT 10.13, no cuda-python)."""
    _, trt_dir = bundles
    with pytest.raises(BundleError, match=r"TensorRT|tensorrt|cuda"):
        load_engine(trt_dir, Manifest.load(trt_dir))
