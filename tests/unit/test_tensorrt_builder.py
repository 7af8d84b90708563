"""``--backend tensorrt`` with the real TensorRT-RTX builder (CPU-only ahead-of-time builds).

TensorRT-RTX (``pip install -e .[dev]`` installs it) parses ONNX, builds networks with two optimization
profiles and serializes plans without a GPU, so everything up to the plan file is real here. It cannot
deserialize a plan without a GPU (``deserialize_cuda_engine`` returns None: "CUDA driver version is
insufficient"), nor can ``Runtime.get_engine_validity`` read one, so the profile ranges are checked against
what TensorRT itself reports at build time (``IOptimizationProfile.get_shape`` of the profiles added to the
builder config, recorded in the manifest's ``trt_profiles``) and, when a GPU is present, against the
deserialized engine (``get_tensor_profile_shape``). All 14 segments of the default model are built: about
0.2 s a segment on 2 cores.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from builder import tensorrt as trt_builder
from builder import workarounds
from builder.bundle import BuildOptions, build_bundle, verify_checksums
from hybrid_runtime import trt_compat
from hybrid_runtime.config import BundleError, ConfigError, Manifest
from hybrid_runtime.engine import load_engine

needs_trt = pytest.mark.skipif(not trt_compat.available(), reason="TensorRT / TensorRT-RTX not importable: "
                               "`pip install -e .[dev]` installs tensorrt-rtx-cu13-libs/-bindings")
ARCH = "sm_89"
LIMITS = {"max_input_len": 48, "max_seq_len": 96, "max_num_tokens": 64}


@pytest.fixture(scope="module")
def trt_bundles(default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, list]]:
    """The default model built with --backend tensorrt --dtype float16 at max batch size 1, 2 and 16."""
    if not trt_compat.available():
        pytest.skip("TensorRT-RTX not importable")
    root = tmp_path_factory.mktemp("trt_bundles")
    out = {}
    for mbs in (1, 2, 16):
        lines: list[str] = []
        build_bundle(default_checkpoint, root / f"b{mbs}", BuildOptions(
            backend="tensorrt", dtype="float16", target_arch=ARCH, max_batch_size=mbs, **LIMITS), progress=lines.append)
        out[mbs] = (root / f"b{mbs}", lines)
    return out


def _want(width: int, lo: int, opt: int, hi: int) -> dict[str, list[int]]:
    shape = (lambda n: [n]) if width == 0 else (lambda n: [n, width])
    return {"min": shape(lo), "opt": shape(opt), "max": shape(hi)}


@needs_trt
def test_every_segment_gets_a_plan_with_two_profiles(trt_bundles: dict) -> None:
    tk = trt_compat.load()
    for mbs, (bundle, lines) in trt_bundles.items():
        m = Manifest.load(bundle)
        raw = json.loads((bundle / "manifest.json").read_text())
        assert m.backend == "tensorrt" and m.dtype == "float16"
        assert raw["toolkit"]["tensorrt_flavor"] == tk.flavor and raw["toolkit"]["tensorrt_version"] == tk.version
        assert raw["target"] == {"device": "cuda", "arch": ARCH, "compute_capability": "8.9"}
        assert verify_checksums(bundle, m) == []
        prefill, decode = m.profiles
        assert (prefill.max_tokens, decode.opt_tokens, decode.max_tokens) == (64, mbs, mbs)
        assert len(m.segments) == 14 and set(m.trt_profiles) == {s.name for s in m.segments}
        for s in m.segments:
            assert s.plan == f"segments/{s.name}.plan" and (bundle / s.onnx).is_file()
            assert (bundle / s.plan).stat().st_size > 10_000 and s.plan in m.checksums
            recorded = m.trt_profiles[s.name]
            assert [(p["name"], p["index"]) for p in recorded] == [("prefill", 0), ("decode", 1)]
            for name, _, width in s.inputs:  # rank-1 ids/positions and [num_tokens, width] activations
                assert recorded[0]["inputs"][name] == _want(width, 1, prefill.opt_tokens, 64)
                assert recorded[1]["inputs"][name] == _want(width, 1, mbs, mbs)
            assert set(recorded[0]["inputs"]) == {i[0] for i in s.inputs}
        assert sum("tensorrt " in ln and "2 profiles" in ln for ln in lines) == 14  # one progress line a segment
        assert any(ln.startswith("workaround trt-fp32-norm-reductions") for ln in lines)


@needs_trt
def test_plans_deserialize_with_the_recorded_profiles_where_a_gpu_exists(trt_bundles: dict) -> None:
    """Without a GPU TensorRT-RTX refuses to deserialize; the check then rests on the build-time record."""
    tk = trt_compat.load()
    bundle, _ = trt_bundles[2]
    m = Manifest.load(bundle)
    runtime = tk.trt.Runtime(trt_compat.make_logger(tk))
    seg = m.segments[1]
    eng = runtime.deserialize_cuda_engine((bundle / seg.plan).read_bytes())
    if eng is None:
        assert trt_compat.current_compute_capability() is None, "a GPU is present but the plan did not load"
        pytest.skip("no GPU: TensorRT-RTX cannot deserialize plans here (checked via the recorded profiles)")
    assert eng.num_optimization_profiles == 2
    for rec in m.trt_profiles[seg.name]:
        for name, s in rec["inputs"].items():
            assert [list(d) for d in eng.get_tensor_profile_shape(name, rec["index"])] == [s["min"], s["opt"], s["max"]]


@needs_trt
def test_workarounds_are_identical_for_every_max_batch_size(trt_bundles: dict) -> None:
    recorded = [json.loads((b / "manifest.json").read_text())["workarounds"] for b, _ in trt_bundles.values()]
    assert recorded[0] == recorded[1] == recorded[2]
    tk = trt_compat.load()
    assert [w["id"] for w in recorded[0]] == [w.id for w in workarounds.select(tk.flavor, tk.version, ARCH)]
    assert "trt-fp32-norm-reductions" in {w["id"] for w in recorded[0]}
    assert list(inspect.signature(workarounds.select).parameters) == ["toolkit", "version", "arch"]
    for w in workarounds.TABLE:  # every TensorRT workaround has an implementation in the builder
        if w.toolkit in (trt_compat.FULL, trt_compat.RTX):
            assert w.id in trt_builder.APPLY


@needs_trt
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_runs_matmuls_in_half_and_pins_norms_and_softplus(trt_bundles: dict, dtype: str) -> None:
    tk = trt_compat.load()
    trt = tk.trt
    bundle, _ = trt_bundles[2]
    m = Manifest.load(bundle)
    seg = next(s for s in m.segments if s.name == "post_moe0")  # final part of layer 0 + layer 1's GDN inputs
    builder = trt.Builder(trt_compat.make_logger(tk))
    net, _parser = trt_builder.parse_onnx(tk, builder, bundle / seg.onnx, builder.logger, print)
    report = trt_builder.PrecisionReport()
    trt_builder.apply_precision(tk, net, dtype, report)
    trt_builder.apply_workarounds(tk, net, workarounds.select(tk.flavor, tk.version, ARCH), report)
    half = trt_compat.half_type(tk, dtype)
    layers = [net.get_layer(i) for i in range(net.num_layers)]
    matmuls = [ly for ly in layers if ly.type == trt.LayerType.MATRIX_MULTIPLY]
    assert matmuls and report.half_matmuls == len(matmuls)
    for ly in matmuls:
        assert ly.get_input(0).dtype == ly.get_input(1).dtype == ly.get_output(0).dtype == half
    pinned = trt_builder.fp32_pinned_layers(tk, net)
    kinds = {str(ly.type) for ly in pinned}
    assert kinds == {"LayerType.REDUCE", "LayerType.UNARY", "LayerType.ACTIVATION", "LayerType.ELEMENTWISE"}
    assert report.pinned_fp32 == len(pinned) == 4  # RMSNorm square, mean, sqrt + the softplus gate
    for ly in pinned:
        assert all(ly.get_input(i).dtype == trt.float32 for i in range(ly.num_inputs) if ly.get_input(i) is not None)
        assert ly.get_output(0).dtype == trt.float32
    for i in range(net.num_outputs):  # the segment's interface stays float32
        assert net.get_output(i).dtype == trt.float32
    assert {net.get_input(i).dtype for i in range(net.num_inputs)} == {trt.float32}


def _bad_model(path: Path) -> None:
    w = numpy_helper.from_array(np.ones((8, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="ok_matmul"),
             helper.make_node("NoSuchOperator", ["y"], ["z"], name="broken_node")]
    g = helper.make_graph(nodes, "broken", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["num_tokens", 8])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["num_tokens", 4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))


@needs_trt
def test_parser_errors_are_printed_with_their_node_and_raise(tmp_path: Path) -> None:
    from hybrid_runtime.config import Limits, SegmentSpec

    _bad_model(tmp_path / "bad.onnx")
    spec = SegmentSpec("bad", "bad.onnx", (("x", "float32", 8),), (("z", "float32", 4),))
    limits = Limits(max_batch_size=2, max_input_len=8, max_seq_len=16, max_num_tokens=8, page_size=4,
                    num_kv_pages=8, num_state_slots=2)
    target = trt_builder.resolve_target(ARCH)
    lines: list[str] = []
    with pytest.raises(trt_builder.TensorRTBuildError, match=r"node 1 \(broken_node, op NoSuchOperator\)") as e:
        trt_builder.build_plan(target, spec, tmp_path / "bad.onnx", tmp_path / "bad.plan", limits, "float32", [],
                               lines.append)
    assert isinstance(e.value, ConfigError) and "cannot parse" in str(e.value)
    assert lines and all(ln.startswith("onnx parser error: bad.onnx: node 1 (broken_node") for ln in lines)
    assert not (tmp_path / "bad.plan").exists()
    (tmp_path / "garbage.onnx").write_bytes(b"this is not a protobuf")
    with pytest.raises(trt_builder.TensorRTBuildError, match="cannot parse"):
        trt_builder.build_plan(target, spec, tmp_path / "garbage.onnx", tmp_path / "g.plan", limits, "float32", [],
                               lines.append)


@needs_trt
def test_target_arch_is_checked_before_building(default_checkpoint: Path, tmp_path: Path) -> None:
    opts = {"backend": "tensorrt", "max_batch_size": 2, **LIMITS}
    with pytest.raises(ConfigError, match="cannot target sm_90; choose --target-arch from"):
        build_bundle(default_checkpoint, tmp_path / "o", BuildOptions(target_arch="sm_90", **opts),
                     progress=lambda _m: None)
    with pytest.raises(ConfigError, match=r"bfloat16 needs compute capability 8\.0"):
        build_bundle(default_checkpoint, tmp_path / "o", BuildOptions(target_arch="sm_75", dtype="bfloat16", **opts),
                     progress=lambda _m: None)
    if trt_compat.current_compute_capability() is None:
        with pytest.raises(ConfigError, match="no CUDA GPU found to build for; pass --target-arch"):
            build_bundle(default_checkpoint, tmp_path / "o", BuildOptions(**opts), progress=lambda _m: None)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_missing_tensorrt_says_how_to_install(default_checkpoint: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trt_compat, "MODULE_NAMES", ("no_such_tensorrt_module",))
    with pytest.raises(ConfigError, match=r"needs TensorRT: .*pip install tensorrt-rtx-cu13-libs "
                                          r"tensorrt-rtx-cu13-bindings"):
        build_bundle(default_checkpoint, tmp_path / "o", BuildOptions(backend="tensorrt", target_arch=ARCH, **LIMITS),
                     progress=lambda _m: None)
    assert not (tmp_path / "o").exists()


@needs_trt
def test_a_failed_build_raises_with_tensorrts_own_errors(trt_bundles: dict, default_checkpoint: Path,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 for Turing gets past a hand-made target (resolve_target refuses it) and fails in TensorRT."""
    bundle, _ = trt_bundles[1]
    m = Manifest.load(bundle)
    seg = m.segments[-1]
    target = trt_builder.TrtTarget(trt_compat.load(), "sm_75")
    with pytest.raises(trt_builder.TensorRTBuildError, match=r"failed to build segment head for sm_75: .*sm75"):
        trt_builder.build_plan(target, seg, bundle / seg.onnx, tmp_path / "head.plan", m.limits, "bfloat16",
                               [], lambda _m: None)
    assert not (tmp_path / "head.plan").exists()
    # Through build_bundle: the error reaches the caller and no bundle (nor its .partial folder) is left.
    monkeypatch.setattr(trt_builder, "resolve_target", lambda *_a: target)
    with pytest.raises(trt_builder.TensorRTBuildError, match="failed to build segment embed"):
        build_bundle(default_checkpoint, tmp_path / "o", BuildOptions(backend="tensorrt", dtype="bfloat16",
                                                                      max_batch_size=2, **LIMITS),
                     progress=lambda _m: None)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@needs_trt
def test_the_runtime_refuses_a_real_plan_cleanly_without_a_gpu(trt_bundles: dict) -> None:
    """The real backend on this machine: toolkit and version match (same TensorRT-RTX), then no GPU."""
    if trt_compat.current_compute_capability() is not None:
        pytest.skip("a GPU is present: scripts/trt_smoke.py covers the real runtime there")
    bundle, _ = trt_bundles[2]
    with pytest.raises(BundleError, match="needs an NVIDIA GPU and cuda-python"):
        load_engine(bundle, Manifest.load(bundle))
