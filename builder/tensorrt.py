"""``--backend tensorrt``: one TensorRT plan per ONNX segment, each with exactly two optimization profiles.

Called by :func:`builder.bundle.build_bundle` after the ONNX segments are written, so a TensorRT bundle holds
both. For every segment:

1. parse ``segments/<name>.onnx`` with the TensorRT ONNX parser into a strongly typed network (every parser
   error is reported with its node index, name and operator, then the build fails);
2. set the precision of ``--dtype``: float32 keeps the network as parsed; float16 / bfloat16 run every
   matrix multiply in that type (its activation and weight inputs cast down, its output cast back to
   float32) while everything else, including the segment inputs and outputs, stays float32;
3. apply the workarounds selected for (toolkit, version, target arch) -- never by batch size, see
   :mod:`builder.workarounds` -- e.g. ``trt-fp32-norm-reductions`` pins the RMSNorm square / mean / sqrt and
   the softplus gate layers to float32;
4. add the PREFILL profile (``num_tokens`` 1..max_num_tokens, opt = the PREFILL profile's opt) and the DECODE
   profile (1..max_batch_size, opt = max_batch_size) for every input -- rank-1 ``input_ids`` / ``positions``
   ``[num_tokens]`` and ``[num_tokens, width]`` activations -- in that order, so profile index == Phase;
5. build, serialize to ``segments/<name>.plan`` and read every profile's min/opt/max back from TensorRT for the
   manifest's ``trt_profiles``.

Precision is expressed with casts in the network rather than with builder flags: TensorRT-RTX and TensorRT
11 only build strongly typed networks, and the FP16/BF16 flags of TensorRT 10 are deprecated since 10.12 (see
:mod:`hybrid_runtime.trt_compat`, where every toolkit difference lives).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybrid_runtime import trt_compat
from hybrid_runtime.config import ConfigError, Limits, SegmentSpec

from .workarounds import Workaround

Shape = tuple[int, ...]
# segment name -> [ {"name": "prefill", "index": 0, "inputs": {input: {"min": [..], "opt": [..], "max": [..]}}}, .. ]
TrtProfiles = dict[str, list[dict[str, Any]]]


class TensorRTBuildError(ConfigError):
    """A segment TensorRT cannot parse or build (a ConfigError, so the CLI reports it without a traceback)."""


@dataclass(frozen=True, slots=True)
class TrtTarget:
    """What the plans are built with and for (recorded in the manifest, checked by the runtime at load)."""

    toolkit: trt_compat.Toolkit
    arch: str  # "sm_89"

    @property
    def compute_capability(self) -> tuple[int, int]:
        return trt_compat.parse_arch(self.arch)

    def manifest_toolkit(self) -> dict[str, str]:
        return {"tensorrt_flavor": self.toolkit.flavor, "tensorrt_version": self.toolkit.version}

    def manifest_target(self) -> dict[str, str]:
        major, minor = self.compute_capability
        return {"device": "cuda", "arch": self.arch, "compute_capability": f"{major}.{minor}"}


@dataclass(slots=True)
class PrecisionReport:
    """What :func:`apply_precision` and the workarounds did to one network."""

    half_matmuls: int = 0
    pinned_fp32: int = 0
    casts_added: int = 0
    pinned_layers: list[str] = field(default_factory=list)


def load_toolkit() -> trt_compat.Toolkit:
    """The installed TensorRT flavour, or a ConfigError that says how to install one."""
    try:
        return trt_compat.load()
    except trt_compat.TensorRTUnavailable as e:
        raise ConfigError(f"--backend tensorrt needs TensorRT: {e}") from e


def resolve_target(target_arch: str = "", dtype: str = "float32") -> TrtTarget:
    """Pick the build target: ``target_arch`` ("sm_89" / "8.9") or the current GPU's.

    Full TensorRT builds for the GPU it runs on, so ``target_arch`` must match that GPU (or be empty).
    TensorRT-RTX builds for any supported compute capability without a GPU; with neither a GPU nor
    ``target_arch`` the build stops and names the choices.
    """
    tk = load_toolkit()
    current = trt_compat.current_compute_capability()
    if target_arch:
        try:
            arch = trt_compat.arch_name(*trt_compat.parse_arch(target_arch))
        except ValueError as e:
            raise ConfigError(str(e)) from e
    elif current is not None:
        arch = trt_compat.arch_name(*current)
    else:
        choices = ", ".join(trt_compat.supported_arches(tk)) or "the GPU's"
        raise ConfigError(f"--backend tensorrt: no CUDA GPU found to build for; pass --target-arch ({choices})")
    if tk.flavor == trt_compat.RTX:
        if arch not in trt_compat.supported_arches(tk):
            raise ConfigError(f"{tk.display} cannot target {arch}; choose --target-arch from "
                              f"{', '.join(trt_compat.supported_arches(tk))}")
    elif current is None:
        raise ConfigError(f"{tk.display} builds plans on the GPU they will run on, and no CUDA GPU was found; "
                          f"build on that machine, or install TensorRT-RTX to build for {arch} without a GPU")
    elif arch != trt_compat.arch_name(*current):
        raise ConfigError(f"{tk.display} builds for the GPU it runs on ({trt_compat.arch_name(*current)}), not "
                          f"--target-arch {arch}; build on an {arch} machine")
    if dtype == "bfloat16" and trt_compat.parse_arch(arch) < (8, 0):
        raise ConfigError(f"--dtype bfloat16 needs compute capability 8.0 or newer; {arch} has no bfloat16 "
                          "(use --dtype float16)")
    return TrtTarget(tk, arch)


def io_shape(width: int, tokens: int) -> Shape:
    """``[num_tokens]`` for rank-1 inputs (width 0), else ``[num_tokens, width]``."""
    return (tokens,) if width == 0 else (tokens, width)


def expected_profiles(spec: SegmentSpec, limits: Limits) -> list[dict[str, Any]]:
    """The two profiles' min/opt/max of every input of ``spec``, in the manifest's ``trt_profiles`` form."""
    out = []
    for index, p in enumerate(limits.profiles()):
        out.append({"name": p.name, "index": index, "inputs": {
            name: {"min": list(io_shape(w, p.min_tokens)), "opt": list(io_shape(w, p.opt_tokens)),
                   "max": list(io_shape(w, p.max_tokens))}
            for name, _, w in spec.inputs}})
    return out


# ---- network surgery ------------------------------------------------------------------------------
def _layers(net: Any) -> list[Any]:
    return [net.get_layer(i) for i in range(net.num_layers)]


def _as(trt: Any, layer: Any, cls: str) -> Any:
    """The layer viewed as its subclass (the TensorRT Python idiom for reading op-specific fields)."""
    layer.__class__ = getattr(trt, cls)
    return layer


def _redirect(net: Any, old: Any, new: Any, skip: Iterable[Any] = ()) -> None:
    """Make every consumer of tensor ``old`` (except the layers in ``skip``) read ``new`` instead."""
    skip_names = {layer.name for layer in skip}
    for layer in _layers(net):
        if layer.name in skip_names:
            continue
        for i in range(layer.num_inputs):
            t = layer.get_input(i)
            if t is not None and t.name == old.name:
                layer.set_input(i, new)
    if old.is_network_output:
        name = old.name
        net.unmark_output(old)
        old.name = f"{name}.pre_cast"
        new.name = name
        net.mark_output(new)


def _cast_input(net: Any, layer: Any, index: int, dtype: Any, tag: str) -> bool:
    t = layer.get_input(index)
    if t is None or t.dtype == dtype:
        return False
    c = net.add_cast(t, dtype)
    c.name = f"{layer.name}.{tag}{index}"
    layer.set_input(index, c.get_output(0))
    return True


def _cast_output_back(net: Any, layer: Any, dtype: Any, tag: str) -> int:
    """Cast every output of ``layer`` whose type is not ``dtype`` back to it, for all its consumers."""
    n = 0
    for i in range(layer.num_outputs):
        out = layer.get_output(i)
        if out.dtype == dtype:
            continue
        c = net.add_cast(out, dtype)
        c.name = f"{layer.name}.{tag}{i}"
        _redirect(net, out, c.get_output(0), skip=[c])
        n += 1
    return n


def apply_precision(tk: trt_compat.Toolkit, net: Any, dtype: str, report: PrecisionReport) -> None:
    """float16/bfloat16: every matrix multiply runs in ``dtype`` (inputs cast down, output cast back to float32)."""
    if dtype == "float32":
        return
    trt, half = tk.trt, trt_compat.half_type(tk, dtype)
    for layer in _layers(net):
        if layer.type != trt.LayerType.MATRIX_MULTIPLY:
            continue
        before = [layer.get_output(i).dtype for i in range(layer.num_outputs)]
        for i in range(layer.num_inputs):
            report.casts_added += _cast_input(net, layer, i, half, "to_half")
        for i, dt in enumerate(before):
            out = layer.get_output(i)
            if out.dtype != dt:
                c = net.add_cast(out, dt)
                c.name = f"{layer.name}.to_float{i}"
                _redirect(net, out, c.get_output(0), skip=[c])
                report.casts_added += 1
        report.half_matmuls += 1


def fp32_pinned_layers(tk: trt_compat.Toolkit, net: Any) -> list[Any]:
    """The layers workaround ``trt-fp32-norm-reductions`` keeps in float32: RMSNorm's square (``x * x``),
    mean (reduce) and sqrt, and the softplus of the gated-delta gate."""
    trt = tk.trt

    def pinned(layer: Any) -> bool:
        kind = layer.type
        if kind == trt.LayerType.REDUCE:
            return True
        if kind == trt.LayerType.UNARY:
            return _as(trt, layer, "IUnaryLayer").op == trt.UnaryOperation.SQRT
        if kind == trt.LayerType.ACTIVATION:
            return _as(trt, layer, "IActivationLayer").type == trt.ActivationType.SOFTPLUS
        if kind == trt.LayerType.ELEMENTWISE:
            if _as(trt, layer, "IElementWiseLayer").op != trt.ElementWiseOperation.PROD:
                return False
            a, b = layer.get_input(0), layer.get_input(1)
            return a is not None and b is not None and a.name == b.name
        return False

    # get_layer() again: the subclass views above are not handed out
    return [net.get_layer(i) for i in range(net.num_layers) if pinned(net.get_layer(i))]


def _pin_fp32(tk: trt_compat.Toolkit, net: Any, report: PrecisionReport) -> None:
    """Force float32 inputs on the pinned layers (casting outputs back where a consumer expects another type)."""
    f32 = tk.trt.float32
    for layer in fp32_pinned_layers(tk, net):
        before = [layer.get_output(i).dtype for i in range(layer.num_outputs)]
        for i in range(layer.num_inputs):
            report.casts_added += _cast_input(net, layer, i, f32, "to_fp32_")
        for i, dt in enumerate(before):
            if layer.get_output(i).dtype != dt:
                report.casts_added += _cast_output_back(net, layer, dt, "from_fp32_")
        report.pinned_fp32 += 1
        report.pinned_layers.append(layer.name)


# Workaround id -> how the builder applies it to a parsed network. Every TensorRT entry of the table needs one.
APPLY: dict[str, Callable[[trt_compat.Toolkit, Any, PrecisionReport], None]] = {
    "trt-fp32-norm-reductions": _pin_fp32,
}


def apply_workarounds(tk: trt_compat.Toolkit, net: Any, applied: Iterable[Workaround],
                      report: PrecisionReport) -> None:
    for wa in applied:
        fn = APPLY.get(wa.id)
        if fn is None:
            raise ConfigError(f"workaround {wa.id} is selected for {tk.display} but builder/tensorrt.py has no "
                              "implementation for it")
        fn(tk, net, report)


# ---- parse / build ------------------------------------------------------------------------------
def parse_onnx(tk: trt_compat.Toolkit, builder: Any, onnx_path: Path, logger: Any,
               progress: Callable[[str], None]) -> tuple[Any, Any]:
    """Parse ``onnx_path`` (external data beside it) into a strongly typed network; report every parser error.

    Returns ``(network, parser)``: keep the parser alive until the build ends (it owns the weights).
    """
    trt = tk.trt
    net = builder.create_network(trt_compat.network_flags(tk))
    parser = trt.OnnxParser(net, logger)
    ok = parser.parse_from_file(str(onnx_path))
    if not ok or parser.num_errors:
        lines = []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            node = e.node()
            where = (f"node {node} ({e.node_name() or '<unnamed>'}, op {e.node_operator() or '?'})"
                     if node >= 0 else "model")
            lines.append(f"{onnx_path.name}: {where}: {e.desc()} [{e.code()}]")
        for line in lines:
            progress(f"onnx parser error: {line}")
        detail = "; ".join(lines) or "the parser gave no details"
        raise TensorRTBuildError(f"{tk.display} cannot parse {onnx_path}: {detail}")
    if net.num_inputs == 0 or net.num_outputs == 0:  # e.g. bytes that are no ONNX protobuf parse to nothing
        progress(f"onnx parser error: {onnx_path.name}: model: no inputs or outputs (not an ONNX model?)")
        raise TensorRTBuildError(f"{tk.display} cannot parse {onnx_path}: the parsed network has "
                                 f"{net.num_inputs} inputs and {net.num_outputs} outputs (not an ONNX model?)")
    return net, parser


def check_io(net: Any, spec: SegmentSpec) -> None:
    """The parsed network's inputs/outputs must be exactly the segment's, with a dynamic first dim."""
    ins = {net.get_input(i).name: tuple(net.get_input(i).shape) for i in range(net.num_inputs)}
    outs = {net.get_output(i).name for i in range(net.num_outputs)}
    want_in = {name: io_shape(w, -1) for name, _, w in spec.inputs}
    if ins != want_in or outs != {name for name, _, _ in spec.outputs}:
        raise TensorRTBuildError(f"segment {spec.name}: network inputs {ins} / outputs {sorted(outs)} do not match "
                                 f"the segment spec {want_in} / {[o[0] for o in spec.outputs]}")


def add_profiles(tk: trt_compat.Toolkit, builder: Any, config: Any, spec: SegmentSpec,
                 limits: Limits) -> list[dict[str, Any]]:
    """Add PREFILL (index 0) and DECODE (index 1); returns the shapes read back from the profile objects."""
    recorded = []
    for want in expected_profiles(spec, limits):
        prof = builder.create_optimization_profile()
        for name, s in want["inputs"].items():
            prof.set_shape(name, s["min"], s["opt"], s["max"])
        index = config.add_optimization_profile(prof)
        if index != want["index"]:
            raise TensorRTBuildError(f"segment {spec.name}: profile {want['name']} got index {index}, "
                                     f"expected {want['index']} (the runtime maps profile index == phase)")
        got = {}
        for name in want["inputs"]:
            mn, opt, mx = prof.get_shape(name)
            got[name] = {"min": list(mn), "opt": list(opt), "max": list(mx)}
        recorded.append({"name": want["name"], "index": index, "inputs": got})
    if config.num_optimization_profiles != 2:
        raise TensorRTBuildError(f"segment {spec.name}: {config.num_optimization_profiles} optimization profiles, "
                                 "expected exactly 2")
    return recorded


def build_plan(target: TrtTarget, spec: SegmentSpec, onnx_path: Path, plan_path: Path, limits: Limits, dtype: str,
               applied: Iterable[Workaround], progress: Callable[[str], None]
               ) -> tuple[list[dict[str, Any]], PrecisionReport]:
    """Parse, type, apply workarounds, add the two profiles, build and write one plan."""
    tk = target.toolkit
    logger = trt_compat.make_logger(tk)
    with trt_compat.collect_errors() as errors:
        builder = tk.trt.Builder(logger)
        net, parser = parse_onnx(tk, builder, onnx_path, logger, progress)
        check_io(net, spec)
        report = PrecisionReport()
        apply_precision(tk, net, dtype, report)
        apply_workarounds(tk, net, applied, report)
        config = builder.create_builder_config()
        try:
            trt_compat.set_target(tk, config, target.arch)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        recorded = add_profiles(tk, builder, config, spec, limits)
        blob = builder.build_serialized_network(net, config)
        if blob is None:
            raise TensorRTBuildError(f"{tk.display} failed to build segment {spec.name} for {target.arch}: "
                                     + ("; ".join(errors) or "no error message"))
        with open(plan_path, "wb") as f:
            f.write(memoryview(blob))
        del parser  # owned the network's weights until the plan was serialized
    return recorded, report


def build_plans(bundle_dir: Path, specs: list[SegmentSpec], limits: Limits, dtype: str, target: TrtTarget,
                applied: list[Workaround], progress: Callable[[str], None]
                ) -> tuple[list[SegmentSpec], TrtProfiles]:
    """Build ``segments/<name>.plan`` for every segment of ``bundle_dir``; returns the specs with ``plan`` set
    and the per-segment profile shapes read back from TensorRT."""
    out: list[SegmentSpec] = []
    profiles: TrtProfiles = {}
    t_all = time.perf_counter()
    for n, spec in enumerate(specs, 1):
        t0 = time.perf_counter()
        rel = f"segments/{spec.name}.plan"
        recorded, rep = build_plan(target, spec, bundle_dir / spec.onnx, bundle_dir / rel, limits, dtype, applied,
                                   progress)
        if recorded != expected_profiles(spec, limits):
            raise TensorRTBuildError(f"segment {spec.name}: TensorRT recorded profiles {recorded}, expected "
                                     f"{expected_profiles(spec, limits)}")
        profiles[spec.name] = recorded
        out.append(SegmentSpec(spec.name, spec.onnx, spec.inputs, spec.outputs, plan=rel))
        size = (bundle_dir / rel).stat().st_size
        progress(f"tensorrt {n}/{len(specs)}: {spec.name}: {rep.half_matmuls} matmuls in {dtype}, "
                 f"{rep.pinned_fp32} layers pinned float32, 2 profiles, plan {size / 1e6:.1f} MB "
                 f"({time.perf_counter() - t0:.1f} s)")
    progress(f"tensorrt: {len(specs)} plans built with {target.toolkit.display} for {target.arch} "
             f"in {time.perf_counter() - t_all:.1f} s")
    return out, profiles
