"""Write an engine bundle: ONNX segments, state weights, tokenizer files and ``manifest.json``.

The bundle is written to a temporary sibling folder and renamed into place at the end, so an
interrupted build never leaves a half-written bundle that a server could pick up.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime

from hybrid_runtime.config import (
    DUMMY_WEIGHTS,
    MANIFEST_VERSION,
    ConfigError,
    Limits,
    Manifest,
    ModelConfig,
    SegmentSpec,
)
from hybrid_runtime.ops.moe import fuse_gate_up
from hybrid_runtime.pipeline import plan_segments, state_weight_names
from hybrid_runtime.program import PROGRAM_VERSION, experts_gate_up
from hybrid_runtime.quant import is_quantized
from hybrid_runtime.weights_io import save_safetensors

from . import quant_bundle, workarounds
from .checkpoint import Checkpoint, load_hf_config, load_weights
from .segments import build_segment

BACKENDS = ("onnxruntime", "tensorrt", "cuda")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
STATE_WEIGHTS = "state_weights.safetensors"


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """Command-line options of ``python -m builder build`` (0 / None = derive a default)."""

    backend: str = "onnxruntime"
    dtype: str = "float32"
    max_batch_size: int = 8
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int = 0
    page_size: int = 16
    num_kv_pages: int = 0
    num_state_slots: int = 0
    target_arch: str = ""  # --backend tensorrt: "sm_89" / "8.9"; "" = the current GPU
    quant_activations: str = "fp32"  # GPTQ checkpoints: MatMulNBits activations, fp32 | int8 (quant_bundle.py)
    # --backend cuda: write no weights; the runtime generates seeded random ones on the device at load (only
    # config.json and the tokenizer are read from the checkpoint folder). For benchmarks and load tests.
    dummy_weights: bool = False

    def limits(self) -> Limits:
        return Limits(
            max_batch_size=self.max_batch_size,
            max_input_len=self.max_input_len,
            max_seq_len=self.max_seq_len,
            max_num_tokens=self.max_num_tokens or max(512, self.max_batch_size),
            page_size=self.page_size,
            # Default pool: every slot can hold a full-length sequence at once.
            num_kv_pages=self.num_kv_pages or (self.num_state_slots or self.max_batch_size)
            * math.ceil(self.max_seq_len / self.page_size),
            num_state_slots=self.num_state_slots or self.max_batch_size,
        )


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tokenizer_info(ckpt_dir: Path, eos_from_config: tuple[int, ...]) -> dict:
    files = [n for n in TOKENIZER_FILES if (ckpt_dir / n).is_file()]
    if "tokenizer.json" not in files:
        raise ConfigError(f"no tokenizer.json in {ckpt_dir}: a bundle needs the tokenizer to serve text")
    return {"files": files, "eos_token_ids": list(eos_from_config)}


def _state_weight(weights: dict, name: str):
    """A state weight by its bundle name; ``experts.gate_up_proj`` is fused from gate/up (quantized
    experts: per expert, by rows)."""
    if name.endswith(".experts.gate_up_proj"):
        p = name.removesuffix("gate_up_proj")
        gate, up = weights[p + "gate_proj"], weights[p + "up_proj"]
        if is_quantized(gate) or is_quantized(up):
            return experts_gate_up(gate, up)
        return fuse_gate_up(gate, up)
    return weights[name]


def build_bundle(checkpoint: str | Path, output: str | Path, opts: BuildOptions,
                 progress: Callable[[str], None] = print) -> Manifest:
    """Build the bundle for ``checkpoint`` into ``output`` (replaced if it exists)."""
    if opts.backend not in BACKENDS:
        raise ConfigError(f"unknown backend {opts.backend!r}: choose one of {', '.join(BACKENDS)}")
    if opts.dtype not in ("float32", "float16", "bfloat16"):
        raise ConfigError(f"unknown dtype {opts.dtype!r}: choose float32, float16 or bfloat16")
    t0 = time.perf_counter()
    limits = opts.limits()
    if opts.dummy_weights and opts.backend != "cuda":
        raise ConfigError("--dummy-weights is for --backend cuda only (the weights are generated on the GPU)")
    if opts.dummy_weights:  # config and tokenizer only: no weights are read
        if not (Path(checkpoint) / "config.json").is_file():
            raise ConfigError(f"{checkpoint}: no config.json")
        ckpt, cfg = None, load_hf_config(Path(checkpoint))[0]
    else:
        ckpt = Checkpoint(checkpoint)
        cfg = ckpt.config
    if limits.max_seq_len > cfg.max_position_embeddings:
        raise ConfigError(f"--max-seq-len {limits.max_seq_len} exceeds the model's max_position_embeddings="
                          f"{cfg.max_position_embeddings}")
    if ckpt is None:
        return _build_cuda(None, cfg, Path(checkpoint), Path(output), opts, limits, progress, t0)
    trt_target = None
    if ckpt.quant is not None and opts.backend == "tensorrt":
        raise ConfigError(f"--backend {opts.backend}: GPTQ int{ckpt.quant.bits} checkpoints are not implemented "
                          f"for this backend; build with --backend onnxruntime (CPU, com.microsoft.MatMulNBits) or "
                          f"--backend cuda (packed weights dequantised on the GPU at load)")
    if ckpt.quant is not None and opts.backend == "cuda" and opts.quant_activations != "fp32":
        raise ConfigError(f"--quant-activations {opts.quant_activations}: a cuda bundle's activations are its "
                          f"--dtype ({opts.dtype}); --quant-activations int8 is for --backend onnxruntime")
    if opts.backend == "cuda":
        return _build_cuda(ckpt, cfg, Path(checkpoint), Path(output), opts, limits, progress, t0)
    if opts.backend == "tensorrt":  # fails here, before any work, when TensorRT is missing or cannot target
        from . import tensorrt as trt_builder

        trt_target = trt_builder.resolve_target(opts.target_arch, opts.dtype)
        toolkit = {"onnx": onnx.__version__, "opset": "17", **trt_target.manifest_toolkit()}
        target = trt_target.manifest_target()
        applied = workarounds.select(trt_target.toolkit.flavor, trt_target.toolkit.version, trt_target.arch)
        dtype = opts.dtype  # of the plans; the ONNX segments beside them stay float32
        progress(f"tensorrt: {trt_target.toolkit.display}, target {trt_target.arch}, {dtype}")
    else:
        toolkit = {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "opset": "17"}
        target = {"device": "cpu", "arch": "cpu"}
        applied = workarounds.select("onnxruntime", onnxruntime.__version__, "cpu")
        dtype = "float32"  # ort-cpu-fp32-activations: see the workaround table
    for wa in applied:
        progress(f"workaround {wa.id}: {wa.action}")
    progress(f"model: {cfg.model_type}, {cfg.num_layers} layers ({len(cfg.linear_layers)} linear, "
             f"{len(cfg.attention_layers)} full attention), {cfg.num_parameters() / 1e6:.1f}M parameters")
    weights = load_weights(ckpt, progress)
    quant = None
    if ckpt.quant is not None:
        weights, quant = quant_bundle.plan(weights, ckpt.quant, opts.quant_activations, progress)

    out = Path(output)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "segments").mkdir(parents=True)
    plans = plan_segments(cfg)
    specs: list[SegmentSpec] = []
    for n, plan in enumerate(plans, 1):
        progress(f"segment {n}/{len(plans)}: {plan.name}")
        model = build_segment(cfg, weights, plan, limits.max_seq_len,
                              accuracy_level=quant.accuracy_level if quant else 0)
        rel = f"segments/{plan.name}.onnx"
        onnx.save_model(model, str(tmp / rel), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{plan.name}.onnx.data", size_threshold=1024)
        onnx.checker.check_model(str(tmp / rel))
        data = tmp / "segments" / f"{plan.name}.onnx.data"
        if data.exists():  # onnx writes external data owner-only; a server may run as another user
            data.chmod(0o644)
        specs.append(SegmentSpec(plan.name, rel, plan.inputs, plan.outputs))
    trt_profiles: dict = {}
    if trt_target is not None:
        try:
            specs, trt_profiles = trt_builder.build_plans(tmp, specs, limits, dtype, trt_target, applied, progress)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # no half-built bundle is left behind
            raise
    progress("writing state weights")
    level = quant.accuracy_level if quant else 0
    save_safetensors(tmp / STATE_WEIGHTS, {k: v for n in state_weight_names(cfg) for k, v in
                                           quant_bundle.state_tensors(n, _state_weight(weights, n), level).items()})
    ckpt_dir = Path(checkpoint)
    tok = _tokenizer_info(ckpt_dir, cfg.eos_token_ids)
    for name in tok["files"]:
        shutil.copyfile(ckpt_dir / name, tmp / name)
    shutil.copyfile(ckpt_dir / "config.json", tmp / "hf_config.json")
    checksums = {str(p.relative_to(tmp)): sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = Manifest(
        version=MANIFEST_VERSION, model=cfg, limits=limits, backend=opts.backend, dtype=dtype,
        segments=tuple(specs), state_weights=STATE_WEIGHTS, toolkit=toolkit, target=target,
        workarounds=tuple(w.record() for w in applied), checksums=checksums, tokenizer=tok,
        trt_profiles=trt_profiles, quantization=quant,
    )
    manifest.save(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    progress(f"engine built: {out} ({len(specs)} segments, {size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s)")
    return manifest


def _finish(tmp: Path, out: Path, ckpt_dir: Path, manifest_kw: dict, progress: Callable[[str], None],
            t0: float, what: str) -> Manifest:
    """Tokenizer files, checksums, manifest, then the rename into place."""
    cfg = manifest_kw["model"]
    tok = _tokenizer_info(ckpt_dir, cfg.eos_token_ids)
    for name in tok["files"]:
        shutil.copyfile(ckpt_dir / name, tmp / name)
    shutil.copyfile(ckpt_dir / "config.json", tmp / "hf_config.json")
    checksums = {str(p.relative_to(tmp)): sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = Manifest(version=MANIFEST_VERSION, checksums=checksums, tokenizer=tok, **manifest_kw)
    manifest.save(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    progress(f"engine built: {out} ({what}, {size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s)")
    return manifest


def _build_cuda(ckpt: Checkpoint | None, cfg: ModelConfig, ckpt_dir: Path, out: Path, opts: BuildOptions,
                limits: Limits, progress: Callable[[str], None], t0: float) -> Manifest:
    """``--backend cuda``: the native GPU runtime's weights (see :mod:`builder.cuda_bundle`), no ONNX.
    ``ckpt`` None (``--dummy-weights``): manifest + tokenizer only (see :data:`DUMMY_WEIGHTS`)."""
    from .cuda_bundle import FORMAT_VERSION, WEIGHTS, write_cuda_weights

    applied = workarounds.select("cuda", "1", "any")
    progress(f"model: {cfg.model_type}, {cfg.num_layers} layers ({len(cfg.linear_layers)} linear, "
             f"{len(cfg.attention_layers)} full attention), {cfg.num_parameters() / 1e6:.1f}M parameters; "
             f"backend cuda, {opts.dtype}" + ("" if ckpt else ", DUMMY weights (generated on the device at load)"))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        quant = None
        if ckpt is None:
            toolkit = {"format": FORMAT_VERSION, "program": str(PROGRAM_VERSION), "weights": "dummy"}
        else:
            toolkit, quant = write_cuda_weights(ckpt, tmp, opts.dtype, limits.max_seq_len, progress)
        specs = tuple(SegmentSpec(p.name, "", p.inputs, p.outputs) for p in plan_segments(cfg))
        return _finish(tmp, out, ckpt_dir, dict(
            model=cfg, limits=limits, backend="cuda", dtype=opts.dtype, segments=specs,
            state_weights=WEIGHTS if ckpt else DUMMY_WEIGHTS, toolkit=toolkit,
            target={"device": "cuda", "arch": "any (NVRTC compiles the kernels at load)"},
            workarounds=tuple(w.record() for w in applied), quantization=quant), progress, t0,
            "cuda weights" if ckpt else "cuda, dummy weights")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def verify_checksums(bundle_dir: str | Path, manifest: Manifest) -> list[str]:
    """Files whose sha256 differs from the manifest (or are missing)."""
    d = Path(bundle_dir)
    bad = []
    for rel, digest in manifest.checksums.items():
        p = d / rel
        if not p.is_file() or sha256(p) != digest:
            bad.append(rel)
    return bad


def describe(bundle_dir: str | Path) -> str:
    """A human summary of a bundle's manifest (``python -m builder inspect``)."""
    m = Manifest.load(bundle_dir)
    lines = [f"bundle {bundle_dir}: {m.backend} {m.dtype}, model {m.model.model_type} "
             f"({m.model.num_layers} layers, {m.model.num_parameters() / 1e6:.1f}M parameters)",
             f"limits: {json.dumps(m.to_dict()['limits'])}"]
    lines += [f"profile {p.name}: tokens {p.min_tokens}..{p.max_tokens} (opt {p.opt_tokens})" for p in m.profiles]
    lines += [f"segment {s.name}: in {[i[0] for i in s.inputs]} -> out {[o[0] for o in s.outputs]}"
              for s in m.segments]
    lines += [f"workaround {w['id']}: {w['action']} ({w['reason']})" for w in m.workarounds]
    if m.quantization is not None:
        q = m.quantization
        lines.append(f"quantization: {q.method} int{q.bits} group {q.group_size} sym={q.sym} desc_act={q.desc_act} "
                     f"({q.checkpoint_format}), {len(q.modules)} weights quantized, {q.activations} activations, "
                     f"{len(q.fallbacks)} dequantised")
    return "\n".join(lines)
