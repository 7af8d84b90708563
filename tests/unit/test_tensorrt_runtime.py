"""The TensorRT runtime backend's control logic (host mode: each segment's outputs copied back), against the
recording test double of TensorRT and CUDA in ``tests/trt_double.py`` (its docstring says what it models). Its
``execute_async_v3`` runs each segment's ONNX with onnxruntime, so a whole model runs through
:class:`ModelRunner` and gives real tokens to compare with the CPU backend. The device-resident path:
``test_tensorrt_device.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hybrid_runtime import trt_compat
from hybrid_runtime.config import BundleError, Manifest
from hybrid_runtime.engine import Phase, ShapeError, load_engine
from hybrid_runtime.engine.tensorrt import TrtEngine
from hybrid_runtime.runner import ModelRunner
from tests.trt_double import (
    MAX_BATCH,
    MAX_TOKENS,
    FakeTrt,
    Recorder,
    cpu_and_trt_bundles,
    drive,
    make_double,
)


# ---- bundles -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bundles(default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(CPU bundle, the same bundle as a TensorRT bundle whose plans are the double's JSON plans)."""
    return cpu_and_trt_bundles(default_checkpoint, tmp_path_factory.mktemp("trt_runtime"))


def _prompts(n: int = 16) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(3, 2000, int(rng.integers(3, 41)))] for _ in range(n)]


def _trt_runner(trt_dir: Path, pinning: str, **double: Any) -> tuple[ModelRunner, FakeTrt, Recorder]:
    fake, cuda, rec = make_double(**double)
    m = Manifest.load(trt_dir)
    engine = TrtEngine(trt_dir, m, pinning, trt=fake, cuda=cuda)
    return ModelRunner(trt_dir, m, engine=engine, device="cpu", trt_path="host"), fake, rec


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
