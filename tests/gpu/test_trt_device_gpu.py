"""The device-resident TensorRT path (:class:`~hybrid_runtime.cuda.trt_backend.TrtDeviceBackend`) on a GPU, with
the TensorRT double of ``tests/trt_double.py`` (no machine of this project can run TensorRT itself on a GPU).

The double's ``execute_async_v3`` runs each segment's ONNX with onnxruntime on the bound DEVICE buffers (it copies
them down, runs, copies the outputs up, synchronizing: the only copies in the step that are not the runtime's, and
they stand in for a plan's kernels); everything else is the real thing: the runtime's buffers and its one upload,
``kv_write`` / GDN / decode attention / MoE / the add kernel / the sampler on the device, one download. Checked
against the CPU backend (onnxruntime segments, CPU operators) on the default model (GDN + attention layers, MoE
with a shared expert): logits of chunked prefill and decode steps within 1e-3, greedy tokens through
``runner.step``, and the runtime's own transfers: one copy up, one down and one synchronize per step.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runner_cases import Driver, scattered_tables

from hybrid_runtime.backend import SampleRow
from hybrid_runtime.config import Manifest
from hybrid_runtime.engine import Phase
from hybrid_runtime.ops.base import SeqStep
from hybrid_runtime.runner import ModelRunner
from hybrid_runtime.sampling import SamplingParams
from tests.trt_double import FakeTrt, Recorder, write_trt_bundle

pytestmark = pytest.mark.gpu

ATOL = 1e-3


class DeviceMemory:
    """The double's view of device memory: reads and writes through the backend's CudaDevice (its raw copy
    methods, taken before the test counts the runtime's), synchronizing, on the backend's stream."""

    def __init__(self, dev: Any) -> None:
        self.dev = dev
        self._htod, self._dtoh, self._sync = dev.copy_htod, dev.copy_dtoh, dev.synchronize

    def read(self, ptr: int, nbytes: int) -> bytes:
        out = np.empty(nbytes, np.uint8)
        self._dtoh(out.ctypes.data, ptr, nbytes)
        self._sync()
        return out.tobytes()

    def write(self, ptr: int, data: np.ndarray) -> None:
        self._htod(ptr, np.ascontiguousarray(data))
        self._sync()


@pytest.fixture(scope="module")
def trt_setup(default_bundle: Path, dev: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from hybrid_runtime.cuda.trt_backend import TrtDeviceBackend

    trt_dir = write_trt_bundle(default_bundle, tmp_path_factory.mktemp("trt_gpu") / "trt", arch=dev.arch)
    m = Manifest.load(trt_dir)
    rec = Recorder()
    fake = FakeTrt(rec, DeviceMemory(dev))  # type: ignore[arg-type]
    be = TrtDeviceBackend(trt_dir, m, device=f"cuda:{dev.ordinal}", cuda_device=dev, trt=fake)
    counts: Counter[str] = Counter()
    for name in ("copy_htod", "copy_dtoh", "synchronize"):  # the runtime's transfers, counted
        orig = getattr(dev, name)

        def counted(*a: Any, _orig: Any = orig, _name: str = name) -> Any:
            counts[_name] += 1
            return _orig(*a)

        setattr(dev, name, counted)
    runner = ModelRunner(trt_dir, m, backend=be, device=be.device)
    yield runner, be, fake, rec, counts, m
    for name in ("copy_htod", "copy_dtoh", "synchronize"):
        dev.__dict__.pop(name, None)


def test_trt_device_path_matches_the_cpu_backend(default_bundle: Path, trt_setup: Any) -> None:
    runner, be, fake, _, _, m = trt_setup
    cpu = ModelRunner(default_bundle, Manifest.load(default_bundle))
    assert runner.device.startswith("cuda:") and runner.engine is be.engine and runner.engine.bound
    rng = np.random.default_rng(0)
    slots, lens, decode_steps = [5, 0, 11], [200, 37, 150], 12
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in lens]
    tables = scattered_tables(m, [n + decode_steps for n in lens], seed=1)
    drv = Driver([cpu, runner], slots, tables, prompts)
    worst = 0.0
    rounds = drv.prefill(chunk=80)
    assert len(rounds) == 3  # every prompt but the shortest spans several chunks
    for a, b in rounds:
        assert a.shape == b.shape and np.isfinite(b).all()
        worst = max(worst, float(np.abs(a - b).max()))
    for _ in range(decode_steps):
        a, b = drv.decode()
        worst = max(worst, float(np.abs(a - b).max()))
    assert worst < ATOL, f"max |cpu - trt device| logit difference {worst:.2e}"
    assert runner.profile_switches == 0 and not be.dispatcher.errors
    for eng in fake.engines:  # every context still bound to the runtime's buffers
        si = [e.plan["segment"] for e in fake.engines].index(eng.plan["segment"])
        for c in eng.contexts:
            assert c.addresses == dict(be.seg_buffers.bindings(si, be.seg_addresses).addresses)
    for layer in m.model.linear_layers:  # the device state agrees with the CPU operators'
        (cc, rc), (cg, rg) = cpu.ops.state_arrays(layer), runner.ops.state_arrays(layer)
        assert np.abs(cg[slots] - cc[slots]).max() < 1e-3 and np.abs(rg[slots] - rc[slots]).max() < 1e-3


def test_trt_device_step_samples_on_the_device(default_bundle: Path, trt_setup: Any) -> None:
    """``runner.step`` (greedy): the device sampler's tokens are the CPU logits' argmax. After a warm-up step of each
    phase (first launches may load modules and plans), every step crosses host <-> device once each way and
    synchronizes once: the runtime's own transfers (the double's copies are not counted, they stand in for the
    plans' kernels)."""
    runner, _, _, _, counts, m = trt_setup
    warm = [SeqStep(15, [60, 61], 0, [5, 6, 7])]
    runner.ops.reset_slot(15)
    runner.run(Phase.PREFILL, warm)
    runner.run(Phase.DECODE, [SeqStep(15, [60, 61], 3, [8])])
    cpu = ModelRunner(default_bundle, Manifest.load(default_bundle))
    ps = m.limits.page_size
    prompts = [[3 + (7 * i + j) % 500 for j in range(n)] for i, n in enumerate((5, 33, 64, 17))]
    steps = [SeqStep(i, list(range(8 * i, 8 * i + 8)), 0, p) for i, p in enumerate(prompts)]
    assert all(len(p) + 8 <= 8 * ps for p in prompts)
    for r in (cpu, runner):
        for i in range(len(prompts)):
            r.ops.reset_slot(i)
    rows = [SampleRow(SamplingParams(temperature=0.0)) for _ in prompts]
    per_step = []
    counts.clear()
    want = cpu.run(Phase.PREFILL, steps)
    got = runner.step(Phase.PREFILL, steps, rows)
    per_step.append(dict(counts))
    assert got.tokens.tolist() == np.argmax(want, axis=-1).tolist()
    for _ in range(6):
        steps = [SeqStep(s.slot, s.page_table, s.start_pos + len(s.token_ids), [int(t)])
                 for s, t in zip(steps, got.tokens)]
        want = cpu.run(Phase.DECODE, steps)
        counts.clear()
        got = runner.step(Phase.DECODE, steps, rows)
        per_step.append(dict(counts))
        top2 = np.sort(want, axis=-1)[:, -2:]
        ok = (got.tokens == np.argmax(want, axis=-1)) | (top2[:, 1] - top2[:, 0] < ATOL)
        assert ok.all(), (got.tokens, np.argmax(want, axis=-1))
    one_each = {"copy_htod": 1, "copy_dtoh": 1, "synchronize": 1}
    assert all(c == one_each for c in per_step), per_step
