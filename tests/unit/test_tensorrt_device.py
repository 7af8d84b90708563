"""The device-resident TensorRT path on any machine, against the recording double (``tests/trt_double.py``).

What runs for real here: the buffer plan (:class:`SegmentBuffers`), :class:`TrtEngine` in bound mode (every
context bound once to the runtime's buffers, ``run_bound``: shape checks, ``set_input_shape``,
``execute_async_v3``, nothing else), the runner's pipeline and the conversion of a TensorRT bundle's state weights
to the runtime weights the device kernels read. The double's ``execute_async_v3`` executes each segment's ONNX on
the bound buffers of its host-backed "device" memory, so a whole model runs through the bound contexts: the
stateful operators between them are the CPU ones (:class:`BoundHostBackend`), reading the banks the contexts wrote
and writing their results into the buffers the next context is bound to, as the device kernels do in
:class:`~hybrid_runtime.cuda.trt_backend.TrtDeviceBackend` (that class itself needs a GPU:
``tests/gpu/test_trt_device_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from builder.checkpoint import Checkpoint, load_weights
from hybrid_runtime.backend import HostBackend, HostCtx
from hybrid_runtime.config import BundleError, ConfigError, Manifest
from hybrid_runtime.cuda.trt_backend import operator_weights, segment_mismatch
from hybrid_runtime.engine import Phase, ShapeError
from hybrid_runtime.engine.tensorrt import TrtEngine
from hybrid_runtime.engine.trt_buffers import SegmentBuffers
from hybrid_runtime.pipeline import SegmentPlan, plan_segments
from hybrid_runtime.program import moe_layers, runtime_weights
from hybrid_runtime.runner import ModelRunner, resolve_device
from tests.trt_double import (
    MAX_BATCH,
    MAX_TOKENS,
    FakeCuda,
    FakeTrt,
    Recorder,
    cpu_and_trt_bundles,
    drive,
    make_double,
)


@pytest.fixture(scope="module")
def bundles(default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(CPU bundle, the same bundle as a TensorRT bundle whose plans are the double's JSON plans)."""
    return cpu_and_trt_bundles(default_checkpoint, tmp_path_factory.mktemp("trt_device"))


# ---- the device-resident flow over the double's host-backed device ----------------------------------------
class BoundHostBackend(HostBackend):
    """A TensorRT bundle's segments as bound contexts over buffers in the double's device memory: the runtime side
    of the device path with the CPU operators standing in for the device kernels. ``inputs`` writes the step's
    int64 ids / positions into the step buffers (the upload); ``segment`` writes what the operators produced
    (``mix_core`` / ``mix_attn`` / ``ffn_out``) into the buffers the context is bound to, checks that the
    pipeline's other inputs are the bank views the previous segment returned, then ``run_bound`` (no arrays),
    and returns views read from the output banks; ``head`` gathers the rows that need logits into ``head.x``."""

    def __init__(self, trt_dir: Path, m: Manifest, fake: FakeTrt, cuda: FakeCuda, pinning: str) -> None:
        lim = m.limits
        self.T, self.R = max(lim.max_num_tokens, lim.max_batch_size), lim.max_batch_size
        self.sb = sb = SegmentBuffers(plan_segments(m.model), self.T, self.R)
        self.cuda = cuda
        step = {"step.input_ids": cuda.malloc(8 * self.T), "step.positions": cuda.malloc(8 * self.T)}
        self.addr = sb.allocate(lambda b: cuda.malloc(b.nbytes), step)
        engine = TrtEngine(trt_dir, m, pinning, trt=fake, cuda=cuda, bindings=lambda si, _s: sb.bindings(si, self.addr))
        super().__init__(trt_dir, m, engine=engine, device="cpu")
        self._views: dict[str, np.ndarray] = {}  # buffer key -> the array last read from it

    def _read(self, key: str, n: int) -> np.ndarray:
        b = self.sb.buffers[key]
        shape = (n,) if b.width == 0 else (n, b.width)
        arr = np.frombuffer(self.cuda.read(self.addr[key], int(np.prod(shape)) * np.dtype(b.dtype).itemsize),
                            b.dtype).reshape(shape)
        self._views[key] = arr
        return arr

    def inputs(self, ctx: HostCtx) -> dict[str, np.ndarray]:
        n, r = len(ctx.ids), sum(bool(s.need_logits) for s in ctx.steps)
        self.engine.check_rows(ctx.phase, [n] * self.head_index + [r])  # the whole step, before anything runs
        self.cuda.write(self.addr["step.input_ids"], ctx.ids.astype(np.int64))
        self.cuda.write(self.addr["step.positions"], ctx.positions.astype(np.int64))
        return {"input_ids": ctx.ids, "positions": ctx.positions}

    def segment(self, index: int, ctx: HostCtx, env: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        spec = self.engine.segments[index]
        n = len(ctx.ids)
        for name, _, _ in spec.inputs:
            key = self.sb.key(index, name)
            if key in ("core", "attn", "ffn_out"):  # an operator's result: it writes the bound buffer
                self.cuda.write(self.addr[key], np.ascontiguousarray(env[name], np.float32))
            elif not key.startswith("step."):
                assert env[name] is self._views[key], f"{spec.name} {name}: the pipeline's tensor is not {key}"
        self.engine.run_bound(index, ctx.phase, n)
        return {name: self._read(self.sb.key(index, name), n) for name, _, _ in spec.outputs}

    def head(self, ctx: HostCtx, x: np.ndarray) -> np.ndarray:
        rows = [int(ctx.bounds[i + 1]) - 1 for i, s in enumerate(ctx.steps) if s.need_logits]
        if not rows:
            return np.zeros((0, self.cfg.vocab_size), np.float32)
        self.cuda.write(self.addr["head.x"], np.ascontiguousarray(x[rows]))
        self.engine.run_bound(self.head_index, ctx.phase, len(rows))
        return self._read("head.logits", len(rows)).copy()


def bound_runner(trt_dir: Path, pinning: str = "per_context") -> tuple[ModelRunner, BoundHostBackend, FakeTrt,
                                                                       Recorder]:
    fake, cuda, rec = make_double()
    m = Manifest.load(trt_dir)
    assert isinstance(cuda, FakeCuda)
    be = BoundHostBackend(trt_dir, m, fake, cuda, pinning)
    return ModelRunner(trt_dir, m, backend=be, device="cpu"), be, fake, rec


def _prompts(n: int = 16) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(3, 2000, int(rng.integers(3, 41)))] for _ in range(n)]


# ---- tests -------------------------------------------------------------------------------------------
def test_segment_buffers_alternate_banks_and_chain_the_pipeline(bundles: tuple[Path, Path]) -> None:
    cfg = Manifest.load(bundles[0]).model
    plans = plan_segments(cfg)
    sb = SegmentBuffers(plans, MAX_TOKENS, MAX_BATCH)
    head = len(plans) - 1
    for si, p in enumerate(plans):
        ins = {sb.key(si, n) for n, _, _ in p.inputs}
        outs = {sb.key(si, n) for n, _, _ in p.outputs}
        assert not ins & outs, f"{p.name} reads and writes one buffer: {ins & outs}"
        if si < head:
            assert all(k.startswith(f"bank{si % 2}.") for k in outs)
        if 0 < si < head:  # x is the previous segment's x_next, z / gate its projections for this mixer
            assert sb.key(si, "x") == sb.key(si - 1, "x_next")
            for mine, theirs in (("mix_z", "z"), ("mix_gate", "gate")):
                if mine in {n for n, _, _ in p.inputs}:
                    assert sb.key(si, mine) == sb.key(si - 1, theirs)
    assert sb.key(head, "x") == "head.x" and sb.key(head, "logits") == "head.logits"
    assert sb.buffers["head.logits"].rows == MAX_BATCH and sb.buffers["bank0.x_next"].rows == MAX_TOKENS
    assert sb.buffers["head.logits"].width == cfg.vocab_size
    # every buffer is as wide as its widest tensor (a bank holds u of one layer and q of another alike)
    for si, p in enumerate(plans):
        for n, dt, w in (*p.inputs, *p.outputs):
            b = sb.buffers[sb.key(si, n)]
            assert b.dtype == dt and b.width >= w
    # the step's inputs must come from the upload; bindings give each segment the fewest rows of its buffers
    with pytest.raises(ValueError, match=r"step\.input_ids"):
        sb.allocate(lambda b: 1, {})
    addr = sb.allocate(lambda b: 4096 + 64 * len(b.key), {"step.input_ids": 1, "step.positions": 2})
    assert sb.bindings(head, addr).rows == MAX_BATCH and sb.bindings(0, addr).rows == MAX_TOKENS
    # a pipeline whose segments do not chain (an input nobody produces) is refused
    broken = [*plans[:2], SegmentPlan("odd", ("mixer", 0), ("final", -1), (("mystery", "float32", 4),),
                                      (("x_next", "float32", 4),)), plans[-1]]
    with pytest.raises(BundleError, match="odd input mystery"):
        SegmentBuffers(broken, MAX_TOKENS, MAX_BATCH)


@pytest.mark.parametrize("pinning", ["per_context", "single_context"])
def test_bound_contexts_run_the_model_on_runtime_buffers_like_the_cpu_backend(bundles: tuple[Path, Path],
                                                                               pinning: str) -> None:
    """A mixed workload through contexts bound to the runtime's buffers, every segment executed by the double on
    them: the same tokens as the CPU backend; the bound addresses are the runtime's and never change
    (per_context: bound once at load; single_context: the same addresses rebound after each switch); no segment
    copies or synchronizes (the engine makes no htod, dtoh or sync call while serving)."""
    cpu_dir, trt_dir = bundles
    prompts = _prompts(16 if pinning == "per_context" else 8)
    want, _ = drive(ModelRunner(cpu_dir, Manifest.load(cpu_dir)), prompts, max_new=5)
    runner, be, fake, rec = bound_runner(trt_dir, pinning)
    n_seg = len(runner.plans)
    loaded = len(rec.events)
    # at load: one context per (segment, profile) or one per segment, each bound to the runtime's buffers
    assert not rec.ops("htod") and not rec.ops("dtoh"), "device-resident contexts allocate and copy nothing"
    for si, eng in enumerate(fake.engines):
        assert len(eng.contexts) == (2 if pinning == "per_context" else 1)
        for c in eng.contexts:
            assert c.addresses == dict(be.sb.bindings(si, be.addr).addresses)
    per_step: list[dict[str, int]] = []
    mark = [loaded]

    def on_step(phase: Phase) -> None:
        ev = rec.events[mark[0]:]
        mark[0] = len(rec.events)
        per_step.append({op: sum(e[1] == op for e in ev) for op in ("htod", "dtoh", "sync", "execute", "set_profile",
                                                                    "set_tensor_address")})

    got, phases = drive(runner, prompts, max_new=5, on_step=on_step)
    assert got == want, "tokens through the bound TensorRT contexts (double) differ from the CPU backend"
    assert Phase.PREFILL in phases[phases.index(Phase.DECODE):], "prefill and decode steps did not interleave"
    assert all(s["htod"] == s["dtoh"] == 0 for s in per_step), per_step
    assert all(s["execute"] == n_seg for s in per_step), "one enqueue per segment and step"
    if pinning == "per_context":
        assert runner.profile_switches == 0
        assert all(s["sync"] == s["set_profile"] == s["set_tensor_address"] == 0 for s in per_step), per_step
        executes = rec.ops("execute")
        assert all(e[2] == int(e[0].split("#")[1]) for e in executes), "an enqueue on the other phase's context"
    else:
        switches = sum(s["set_profile"] for s in per_step)
        assert runner.profile_switches == switches > 0
        # a switch synchronizes once and rebinds the context's tensors; a step without switches never syncs
        assert all(s["sync"] == s["set_profile"] for s in per_step), per_step
        for si, eng in enumerate(fake.engines):  # rebound to the same runtime addresses every time
            assert eng.contexts[0].addresses == dict(be.sb.bindings(si, be.addr).addresses)
        n_tensors = sum(len(e.plan["inputs"]) + len(e.plan["outputs"]) for e in fake.engines)
        assert sum(s["set_tensor_address"] for s in per_step) == n_tensors * switches // n_seg


def test_bound_logits_equal_the_cpu_backend(bundles: tuple[Path, Path]) -> None:
    cpu_dir, trt_dir = bundles
    cpu = ModelRunner(cpu_dir, Manifest.load(cpu_dir))
    runner, _, _, _ = bound_runner(trt_dir)
    from hybrid_runtime.runner import SeqStep

    prompts = [p[:20] for p in _prompts(3)]  # one prefill step: 64 tokens at most
    for r in (cpu, runner):
        for slot in range(3):
            r.ops.reset_slot(slot)
    steps = [SeqStep(i, list(range(4 * i, 4 * i + 4)), 0, p) for i, p in enumerate(prompts)]
    a, b = cpu.run(Phase.PREFILL, steps), runner.run(Phase.PREFILL, steps)
    assert a.shape == b.shape == (3, cpu.cfg.vocab_size)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    dec = [SeqStep(i, list(range(4 * i, 4 * i + 4)), len(p), [int(np.argmax(a[i]))]) for i, p in enumerate(prompts)]
    np.testing.assert_allclose(runner.run(Phase.DECODE, dec), cpu.run(Phase.DECODE, dec), rtol=1e-5, atol=1e-5)


def test_bound_shapes_outside_the_profile_or_buffers_are_refused_before_enqueue(bundles: tuple[Path, Path]) -> None:
    _, trt_dir = bundles
    runner, _, _, rec = bound_runner(trt_dir)
    engine = runner.engine
    head = len(runner.plans) - 1
    before = len(rec.events)
    with pytest.raises(ShapeError, match=r"decode profile range 1\.\.16"):
        engine.run_bound(head, Phase.DECODE, MAX_BATCH + 1)
    with pytest.raises(ShapeError, match=r"prefill profile range 1\.\.64"):
        engine.run_bound(0, Phase.PREFILL, MAX_TOKENS + 1)
    with pytest.raises(ShapeError, match="profile range"):
        engine.run_bound(0, Phase.PREFILL, 0)
    # the head's buffers hold max_batch_size rows (logit rows), though its PREFILL profile allows 64
    with pytest.raises(ShapeError, match="exceed the bound buffers' 16 rows"):
        engine.run_bound(head, Phase.PREFILL, MAX_BATCH + 1)
    ctx = engine.context(head, Phase.DECODE)
    ctx.context.set_optimization_profile_async(0, 7)  # a context moved off its bound profile behind our back
    with pytest.raises(ShapeError, match="optimization profile 0"):
        engine.run_bound(head, Phase.DECODE, 2)
    ctx.context.set_optimization_profile_async(1, 7)
    pctx = engine.context(0, Phase.PREFILL)
    pctx._limits["input_ids"] = ((1,), (8,))  # the plan's own profile says 8: it wins over the manifest
    with pytest.raises(ShapeError, match=r"input_ids: shape \[9\] outside the prefill profile's \[1\]..\[8\]"):
        engine.run_bound(0, Phase.PREFILL, 9)
    # the whole step at once, host-side (what TrtDeviceBackend.prepare does before its upload)
    n_seg = len(runner.plans)
    with pytest.raises(ShapeError, match=r"decode profile range 1\.\.16; refusing the step"):
        engine.check_rows(Phase.DECODE, [MAX_BATCH + 1] * n_seg)
    with pytest.raises(ShapeError, match="head: 17 tokens exceed the bound buffers' 16 rows"):
        engine.check_rows(Phase.PREFILL, [40] * (n_seg - 1) + [MAX_BATCH + 1])
    with pytest.raises(ShapeError, match=r"input_ids: shape \[9\] outside the prefill profile's \[1\]..\[8\]"):
        engine._plan_limits[0][Phase.PREFILL]["input_ids"] = ((1,), (8,))
        engine.check_rows(Phase.PREFILL, [9] * (n_seg - 1) + [1])
    with pytest.raises(ValueError, match="row counts"):
        engine.check_rows(Phase.PREFILL, [1])
    engine.check_rows(Phase.PREFILL, [8] * (n_seg - 1) + [0])  # a step with no logit rows: the head is skipped
    refused = rec.events[before:]
    assert not [e for e in refused if e[1] in ("execute", "set_input_shape", "htod", "dtoh", "sync")], refused
    # host arrays cannot be pushed through a bound context
    with pytest.raises(RuntimeError, match="runtime's device buffers"):
        engine.run(head, Phase.PREFILL, {"x": np.zeros((2, runner.cfg.hidden_size), np.float32)})
    engine.run_bound(0, Phase.PREFILL, 8)  # within every range: runs
    assert rec.ops("execute")


def test_bindings_must_name_every_tensor(bundles: tuple[Path, Path]) -> None:
    _, trt_dir = bundles
    fake, cuda, _ = make_double()
    m = Manifest.load(trt_dir)
    sb = SegmentBuffers(plan_segments(m.model), MAX_TOKENS, MAX_BATCH)
    addr = sb.allocate(lambda b: cuda.malloc(b.nbytes), {"step.input_ids": cuda.malloc(8 * MAX_TOKENS),
                                                          "step.positions": cuda.malloc(8 * MAX_TOKENS)})
    addr["bank0.x_next"] = 0
    with pytest.raises(BundleError, match=r"segment embed: no device buffer for \['x_next'\]"):
        TrtEngine(trt_dir, m, trt=fake, cuda=cuda, bindings=lambda si, _s: sb.bindings(si, addr))


def test_state_weights_become_the_runtime_weights_of_the_device_kernels(bundles: tuple[Path, Path],
                                                                        default_checkpoint: Path) -> None:
    """The conv and MoE weights the device path uploads, derived from the TensorRT bundle's state weights, are
    the runtime weights a cuda bundle derives from the checkpoint (same names, shapes, values)."""
    _, trt_dir = bundles
    m = Manifest.load(trt_dir)
    cfg = m.model
    assert moe_layers(cfg) and cfg.linear_layers and cfg.shared_expert_intermediate_size
    names = [f"layers.{i}.linear_attn.conv1d" for i in cfg.linear_layers]
    for i in moe_layers(cfg):
        names += [f"layers.{i}.mlp.{n}" for n in ("router", "experts.gate_up", "experts.down", "shared.gate_up",
                                                  "shared.down", "shared.gate")]
    ck = Checkpoint(default_checkpoint)
    want = runtime_weights(cfg, load_weights(ck), m.limits.max_seq_len, names)
    weight = operator_weights(trt_dir, m)
    for n in names:
        got = weight(n)
        assert got.dtype == np.float32 and got.shape == want[n].shape, n
        np.testing.assert_array_equal(got, want[n], err_msg=n)
    with pytest.raises(KeyError, match="not a runtime weight"):
        weight("layers.0.mlp.nonsense")


def test_state_weights_missing_or_misshapen_are_refused(bundles: tuple[Path, Path], tmp_path: Path) -> None:
    from hybrid_runtime.weights_io import SafetensorsFile, save_safetensors

    _, trt_dir = bundles
    bad = tmp_path / "bad"
    shutil.copytree(trt_dir, bad)
    m = Manifest.load(bad)
    sw = SafetensorsFile(bad / m.state_weights)
    arrays = {n: np.asarray(sw.get(n)) for n in sw.keys()}  # noqa: SIM118 (not a dict)
    i = moe_layers(m.model)[0]
    gate = arrays.pop(f"layers.{i}.mlp.gate")
    save_safetensors(bad / m.state_weights, arrays)
    with pytest.raises(BundleError, match=f"has no layers.{i}.mlp.gate: rebuild"):
        operator_weights(bad, m)(f"layers.{i}.mlp.router")
    arrays[f"layers.{i}.mlp.gate"] = gate[:, :-1]
    save_safetensors(bad / m.state_weights, arrays)
    with pytest.raises(BundleError, match=r"router the shape .* the runtime expects"):
        operator_weights(bad, m)(f"layers.{i}.mlp.router")
    (bad / m.state_weights).unlink()
    with pytest.raises(BundleError, match="is missing"):
        operator_weights(bad, m)


def test_runner_picks_the_device_path_for_tensorrt_bundles_on_a_gpu(bundles: tuple[Path, Path],
                                                                    tmp_path: Path) -> None:
    cpu_dir, trt_dir = bundles
    m = Manifest.load(trt_dir)
    assert resolve_device("auto", m) == "cuda" and resolve_device(None, Manifest.load(cpu_dir)) == "cpu"
    fake, cuda, _ = make_double()
    engine = TrtEngine(trt_dir, m, trt=fake, cuda=cuda)
    # device="cpu" or an explicit host engine: the host path (segments copied back, host operators)
    r = ModelRunner(trt_dir, m, engine=engine, device="cpu")
    assert type(r.backend) is HostBackend and r.engine is engine
    with pytest.raises(ConfigError, match="trt_path='device' needs a tensorrt bundle on device 'cuda'"):
        ModelRunner(trt_dir, m, engine=engine, device="cpu", trt_path="device")
    with pytest.raises(ConfigError, match="trt_path='fast'"):
        ModelRunner(trt_dir, m, device="cpu", trt_path="fast")
    # a bundle whose segments are not this runtime's pipeline is refused before anything is loaded
    plans = plan_segments(m.model)
    assert segment_mismatch(m.segments[1], plans[1]) is None
    odd = dataclasses.replace(m.segments[1], outputs=m.segments[1].outputs[:-1])
    assert "bundle I/O" in (segment_mismatch(odd, plans[1]) or "")
    # on this machine the device path is what auto picks: it needs a GPU (and TensorRT) and says so
    from hybrid_runtime import trt_compat

    if trt_compat.current_compute_capability() is None:
        with pytest.raises((ConfigError, BundleError), match=r"CUDA|cuda|GPU|TensorRT"):
            ModelRunner(trt_dir, m)
