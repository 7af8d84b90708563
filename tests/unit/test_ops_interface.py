"""The stateful-operator interface: device selection, the CPU operators behind it, and what the runner
and the serving engine call through it (GPU numerics: tests/gpu/test_runner_cuda.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hybrid_runtime.config import ConfigError, Manifest
from hybrid_runtime.engine import Phase
from hybrid_runtime.ops.base import StatefulOps, parse_device
from hybrid_runtime.ops.cpu import CpuOps
from hybrid_runtime.runner import ModelRunner, SeqStep
from hybrid_runtime.serving import RuntimeOptions, ServingEngine


def test_parse_device() -> None:
    assert parse_device("cpu") == ("cpu", 0)
    assert parse_device("cuda") == ("cuda", 0)
    assert parse_device("cuda:3") == ("cuda", 3)
    for bad in ("gpu", "cpu:1", "cuda:", "cuda:-1", "CUDA", ""):
        with pytest.raises(ConfigError, match="device="):
            parse_device(bad)
    with pytest.raises(ConfigError, match="device='tpu'"):
        RuntimeOptions(device="tpu")
    assert RuntimeOptions().device == "auto"  # a cuda bundle on the GPU, any other on the CPU


def test_cpu_runner_exposes_its_operators(default_bundle: Path) -> None:
    runner = ModelRunner(default_bundle, Manifest.load(default_bundle))
    assert isinstance(runner.ops, CpuOps) and isinstance(runner.ops, StatefulOps)
    assert runner.device == "cpu"
    assert runner.state is runner.ops.state and runner.kv is runner.ops.kv
    assert runner.dispatcher is runner.ops.dispatcher
    layer = runner.cfg.linear_layers[0]
    runner.state.conv[layer][3] = 1.0
    runner.state.recurrent[layer][3] = 1.0
    runner.ops.reset_slot(3)
    conv, rec = runner.ops.state_arrays(layer)
    assert not conv[3].any() and not rec[3].any()


def test_serving_engine_admits_through_the_operators(default_bundle: Path) -> None:
    eng = ServingEngine(default_bundle, RuntimeOptions())
    assert eng.scheduler._on_admit == eng.runner.ops.reset_slot


def test_cuda_device_without_gpu_is_a_config_error(default_bundle: Path) -> None:
    from hybrid_runtime import cuda

    if cuda.available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ConfigError, match="device='cuda'"):
        ModelRunner(default_bundle, Manifest.load(default_bundle), device="cuda")


class Recorder:
    """Wraps the CPU operators and records each mixer call's layer, phase and array shapes."""

    def __init__(self, inner: CpuOps) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def gdn(self, layer: int, phase: Phase, steps: list[SeqStep], bounds: np.ndarray, *arrays: np.ndarray
            ) -> np.ndarray:
        self.calls.append(("gdn", layer, phase, [a.shape for a in arrays]))
        return self.inner.gdn(layer, phase, steps, bounds, *arrays)

    def attention(self, layer: int, phase: Phase, steps: list[SeqStep], bounds: np.ndarray,
                  *arrays: np.ndarray) -> np.ndarray:
        self.calls.append(("attention", layer, phase, [a.shape for a in arrays]))
        return self.inner.attention(layer, phase, steps, bounds, *arrays)


def test_runner_calls_each_mixer_once_per_layer(default_bundle: Path) -> None:
    runner = ModelRunner(default_bundle, Manifest.load(default_bundle))
    cfg = runner.cfg
    rec = Recorder(runner.ops)  # type: ignore[arg-type]
    runner.ops = runner.backend.ops = rec  # type: ignore[assignment,attr-defined]
    for s in (2, 7):
        rec.reset_slot(s)
    steps = [SeqStep(2, [4, 9], 0, [5, 6, 7]), SeqStep(7, [1], 0, [8, 9])]
    runner.run(Phase.PREFILL, steps)
    runner.run(Phase.DECODE, [SeqStep(2, [4, 9], 3, [1]), SeqStep(7, [1], 2, [2])])
    C, nv = cfg.conv_dim, cfg.linear_num_value_heads
    H, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for phase, T in ((Phase.PREFILL, 5), (Phase.DECODE, 2)):
        got = [c for c in rec.calls if c[2] == phase]
        want = [("gdn", i, phase, [(T, C), (T, nv), (T, nv)]) if i in cfg.linear_layers else
                ("attention", i, phase, [(T,), (T,), (T,), (T, H), (T, kv), (T, kv)]) for i in range(cfg.num_layers)]
        assert got == want
