"""Model runner: executes one batch (PREFILL or DECODE) through the segment pipeline, on a backend.

One pipeline for every backend (:meth:`ModelRunner._forward`): the segments of
:func:`~hybrid_runtime.pipeline.plan_segments` in order, with the stateful operator named by each segment's
``exit`` after it (GDN, attention, MoE), then the head; the backend (:mod:`hybrid_runtime.backend`) executes
each piece on its own device and tensor type: :class:`~hybrid_runtime.backend.HostBackend` for onnxruntime /
TensorRT bundles (host tensors, numpy or CUDA stateful operators), :class:`~hybrid_runtime.cuda.backend.CudaBackend`
for ``cuda`` bundles (everything on the GPU, decode steps replayed as CUDA graphs). The runner makes no
policy decisions: the scheduler decides which sequences, slots and pages; the runner computes logits or
next tokens. Only the engine thread calls it (invariant 1).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .backend import Backend, HostBackend, SampleRow, StepResult
from .config import LINEAR, BundleError, ConfigError, Manifest
from .engine import Engine, Phase
from .kv_cache import KVCache
from .ops.base import SeqStep, parse_device
from .ops.cpu import CpuOps
from .ops.dispatcher import DecodeAttentionDispatcher
from .pipeline import plan_segments
from .state_cache import StateCache

__all__ = ["InFlight", "ModelRunner", "SampleRow", "SeqStep", "StepResult"]  # SeqStep lives in ops.base

log = logging.getLogger("hybrid_runtime.runner")


@dataclass(slots=True)
class InFlight:
    """A step :meth:`ModelRunner.launch` enqueued: the backend's context, and on host backends (which run the
    step inside ``launch``) its result already."""

    ctx: Any
    result: StepResult | None = None


TRT_PATHS = ("auto", "device", "host")
# What a cuda GPTQ bundle keeps packed on the GPU (CudaBackend packed_linears / packed_experts / dual_linears): "off"
# dequantises every packed weight at load (the float bundle's kernels and memory), "linears" keeps the dense
# projections only packed, "experts" the MoE layers' experts, "all" both; "dual" the experts only packed and the
# dense projections in both forms (packed for decode steps of <= 16 rows: "all"'s bits; dequantised for everything
# else; prefill has "experts"' bits, which are "off"'s; with packed projections, "all" and "dual", int4 experts decode
# with the scale on the accumulator: moe_nbits_decode.FAST_BUILDS); "auto" (the default) = "dual" for a GPTQ cuda
# bundle (decode steps of few rows as fast as "all", prefill as "experts"; 35B-A3B int4 on an H100: 32% of the bf16
# weight memory, benchmarks/results/gpu_decode_step_quant_h200.md "Stop 51"), "off" for any other bundle.
PACKED_WEIGHTS = ("auto", "off", "linears", "experts", "all", "dual")


def resolve_packed_weights(packed_weights: str, manifest: Manifest) -> str:
    """The :data:`PACKED_WEIGHTS` mode a bundle runs with: ``auto`` becomes ``dual`` for a GPTQ ``cuda`` bundle
    and ``off`` for any other; the other modes are themselves. ConfigError for an unknown mode."""
    if packed_weights not in PACKED_WEIGHTS:
        raise ConfigError(f"packed_weights={packed_weights!r}: choose one of {', '.join(PACKED_WEIGHTS)}")
    if packed_weights == "auto":
        return "dual" if manifest.backend == "cuda" and manifest.quantization is not None else "off"
    return packed_weights


def resolve_device(device: str | None, manifest: Manifest) -> str:
    """``auto`` (or None): ``cuda`` for a ``cuda`` or ``tensorrt`` bundle (TensorRT plans run on a GPU), ``cpu``
    otherwise; anything else as given."""
    if device in (None, "auto"):
        return "cuda" if manifest.backend in ("cuda", "tensorrt") else "cpu"
    return device


class ModelRunner:
    """Runs batches of :class:`SeqStep` on one bundle; see :meth:`run` and :meth:`step`. ``device`` picks where
    the work runs: for onnxruntime / TensorRT bundles the stateful operators' device (``"cpu"``: numpy,
    ``"cuda"`` / ``"cuda:N"``: CUDA kernels); a ``cuda`` bundle runs whole on ``"cuda"`` / ``"cuda:N"`` (its
    ``cuda_graphs`` option: capture decode steps as CUDA graphs at load). ``device`` None or ``"auto"``: the
    bundle's own device (``cuda`` for a cuda or tensorrt bundle, else ``cpu``).

    ``trt_path`` (TensorRT bundles): ``"device"`` = :class:`~hybrid_runtime.cuda.trt_backend.TrtDeviceBackend`
    (plans bound to the runtime's device buffers, operators / MoE / sampler on the GPU, one copy up and one down
    per step); ``"host"`` = :class:`~hybrid_runtime.backend.HostBackend` (each segment's outputs copied to the
    host, the stateful operators of ``device``, MoE and sampling on the host); ``"auto"`` = ``"device"`` on a
    ``cuda`` / ``cuda:N`` device unless a host ``engine`` is passed, else ``"host"``.

    ``packed_weights`` (:data:`PACKED_WEIGHTS`; GPTQ ``cuda`` bundles of bf16 / fp16): which packed weights stay
    packed on the GPU instead of being dequantised at load - decode steps then read them with the int4 / int8
    kernels (with ``experts`` the dequantised bundle's bits; the projections within ~2% of its logits, and with
    them packed, ``all`` / ``dual``, int4 experts with the scale on the accumulator: closer to the quantized model,
    faster; about a quarter of the weight memory at int4); prefill runs packed experts on the packed grouped GEMMs
    where they run (Hopper; the same bits) and dequantises the other packed weights into a scratch buffer first.
    ``dual`` keeps the projections both packed and dequantised: decode steps of <= 16 rows read them packed (as
    ``all``: the same bits), everything else reads the dequantised copy (no scratch; prefill as ``experts``: the
    same bits), for the packed projections' bytes on top. ``auto`` (the
    default): ``dual`` for a GPTQ cuda bundle, else ``off`` (:func:`resolve_packed_weights`). Any other mode
    is ignored, with a log line, for a bundle it does not apply to."""

    def __init__(self, bundle_dir: str | Path, manifest: Manifest, *, pinning: str = "per_context",
                 multi_block_mode: str = "auto", num_kv_pages: int | None = None,
                 intra_op_threads: int = 0, engine: Engine | None = None, device: str | None = None,
                 cuda_graphs: bool = True, backend: Backend | None = None,
                 gpu_memory_fraction: float | None = None, trt_path: str = "auto",
                 packed_weights: str = "auto") -> None:
        self.manifest = manifest
        cfg = self.cfg = manifest.model
        self.plans = plan_segments(cfg)
        if [p.name for p in self.plans] != [s.name for s in manifest.segments]:
            raise BundleError("bundle segments do not match this runtime's pipeline for the model config; "
                              "rebuild the bundle with this version of the builder")
        if cfg.attention_layers and not (16 <= cfg.head_dim <= 256 and cfg.head_dim % 16 == 0):
            raise BundleError(f"head_dim={cfg.head_dim}: the decode-attention kernels support multiples of 16 "
                              f"in 16..256")
        if trt_path not in TRT_PATHS:
            raise ConfigError(f"trt_path={trt_path!r}: choose one of {', '.join(TRT_PATHS)}")
        asked = packed_weights
        packed_weights = resolve_packed_weights(packed_weights, manifest)
        if asked not in ("auto", "off") and (manifest.backend != "cuda" or manifest.quantization is None
                                             or backend is not None):
            log.info("packed_weights=%s has no effect here: it applies to GPTQ bundles built with --backend cuda "
                     "(this bundle: backend %s, %s)", packed_weights, manifest.backend,
                     "quantized" if manifest.quantization is not None else "not quantized")
            packed_weights = "off"
        device = resolve_device(device, manifest)
        on_gpu = parse_device(device)[0] == "cuda"
        if trt_path == "device" and (not on_gpu or engine is not None or manifest.backend != "tensorrt"):
            raise ConfigError(f"trt_path='device' needs a tensorrt bundle on device 'cuda' / 'cuda:N' and no host "
                              f"engine (got backend {manifest.backend!r}, device {device!r}"
                              f"{', an engine' if engine is not None else ''})")
        trt_device = (manifest.backend == "tensorrt" and backend is None and
                      (trt_path == "device" or (trt_path == "auto" and on_gpu and engine is None)))
        if manifest.quantization is not None and manifest.backend not in ("onnxruntime", "cuda"):
            raise BundleError(f"bundle backend {manifest.backend!r} with a {manifest.quantization.method} "
                              f"int{manifest.quantization.bits} quantization record: quantized weights run on the "
                              f"onnxruntime (CPU) and cuda backends only; rebuild with --backend onnxruntime or cuda")
        if backend is not None:
            self.backend = backend
        elif manifest.backend == "cuda":
            from .cuda.backend import CudaBackend

            self.backend = CudaBackend(bundle_dir, manifest, device=device, multi_block_mode=multi_block_mode,
                                       num_kv_pages=num_kv_pages, gpu_memory_fraction=gpu_memory_fraction,
                                       packed_linears=packed_weights in ("linears", "all"),
                                       packed_experts=packed_weights in ("experts", "all", "dual"),
                                       dual_linears=packed_weights == "dual")
        elif trt_device:
            from .cuda.trt_backend import TrtDeviceBackend

            self.backend = TrtDeviceBackend(bundle_dir, manifest, device=device, pinning=pinning,
                                            multi_block_mode=multi_block_mode, num_kv_pages=num_kv_pages,
                                            gpu_memory_fraction=gpu_memory_fraction)
        else:
            self.backend = HostBackend(bundle_dir, manifest, pinning=pinning, multi_block_mode=multi_block_mode,
                                       num_kv_pages=num_kv_pages, intra_op_threads=intra_op_threads,
                                       engine=engine, device=device)
        self.ops = self.backend.ops
        if backend is None and manifest.backend == "cuda" and cuda_graphs:
            self.backend.capture_graphs(self._forward)  # type: ignore[attr-defined]

    # ---- what the serving loop and the tests read ---------------------------------------------
    @property
    def device(self) -> str:
        return self.backend.device

    @property
    def dispatcher(self) -> DecodeAttentionDispatcher:
        """The decode-attention dispatcher of the backend's device (plans, fallbacks, errors)."""
        return self.ops.dispatcher

    @property
    def timings(self) -> Counter:
        """Seconds per piece (segments, gdn, attention, moe, sampler) on host backends."""
        return self.backend.timings

    @property
    def num_kv_pages(self) -> int:
        """KV pages the backend allocated (the scheduler's page pool; a cuda backend may cap the bundle's
        count to its memory budget)."""
        return int(self.backend.num_pages)  # type: ignore[attr-defined]

    @property
    def profile_switches(self) -> int:
        return self.backend.profile_switches

    @property
    def engine(self) -> Any:
        """The segment engine (onnxruntime / TensorRT, host or device-resident); None for a ``cuda`` bundle."""
        return getattr(self.backend, "engine", None)

    @property
    def kv_layout(self) -> Any:
        return self.ops.kv_layout

    def _cpu_ops(self, what: str) -> CpuOps:
        if not isinstance(self.ops, CpuOps):
            raise AttributeError(f"runner.{what} holds host buffers of the cpu operators; on {self.device} use "
                                 f"runner.ops (reset_slot, state_arrays, kv_arrays)")
        return self.ops

    @property
    def state(self) -> StateCache:
        """The host :class:`StateCache` (cpu only)."""
        return self._cpu_ops("state").state

    @property
    def kv(self) -> KVCache:
        """The host :class:`KVCache` (cpu only)."""
        return self._cpu_ops("kv").kv

    # ------------------------------------------------------------------------------------------
    def run(self, phase: Phase, steps: list[SeqStep]) -> np.ndarray:
        """Logits ``[n, vocab]`` float32 (host) for the steps with ``need_logits`` (in order; n may be 0).

        PREFILL: each step is a chunk of one prompt. DECODE: each step is exactly one token.
        """
        ctx = self.backend.prepare(phase, steps, None, True)
        res = self.backend.execute(ctx, self._forward)
        assert res.logits is not None
        return res.logits

    def step(self, phase: Phase, steps: list[SeqStep], rows: Sequence[SampleRow],
             want_logits: bool = False) -> StepResult:
        """Run the batch and draw the next token of every step with ``need_logits`` (``rows``: one
        :class:`SampleRow` per such step, in order). ``want_logits`` also returns the logits (an extra copy
        on the GPU backend)."""
        ctx = self.backend.prepare(phase, steps, rows, want_logits)
        return self.backend.execute(ctx, self._forward)

    # ---- split steps (the serving loop's async scheduling) -------------------------------------
    def launch(self, phase: Phase, steps: list[SeqStep], rows: Sequence[SampleRow]) -> InFlight:
        """:meth:`step` in two halves: this one enqueues the step on a backend that runs asynchronously (a cuda
        bundle: upload, graph replay, download) and returns; :meth:`collect` waits for its :class:`StepResult`.
        On a host backend the step runs here, whole."""
        ctx = self.backend.prepare(phase, steps, rows, False)
        return self._launch(ctx)

    def _launch(self, ctx: Any) -> InFlight:
        launch = getattr(self.backend, "launch", None)
        if launch is None:
            return InFlight(ctx, self.backend.execute(ctx, self._forward))
        launch(ctx, self._forward)
        return InFlight(ctx)

    def collect(self, step: InFlight) -> StepResult:
        """The result of a :meth:`launch`ed step (waits for the device). Call once per launch, in launch order."""
        if step.result is not None:
            return step.result
        return self.backend.finish(step.ctx)  # type: ignore[attr-defined]

    @property
    def supports_ahead(self) -> bool:
        """Whether the backend can prepare a decode step before its token ids are known (:meth:`prepare_ahead`)."""
        return bool(getattr(self.backend, "supports_ahead", False))

    def prepare_ahead(self, steps: list[SeqStep], rows: Sequence[SampleRow]) -> Any:
        """Prepare the DECODE step after the one in flight (host work only; the step in flight keeps running):
        ``steps``' token ids are placeholders that :meth:`launch_ahead` replaces. Only where
        :attr:`supports_ahead`; the context goes to exactly one of :meth:`launch_ahead` / :meth:`abandon`."""
        return self.backend.prepare_ahead(Phase.DECODE, steps, rows)  # type: ignore[attr-defined]

    def launch_ahead(self, ctx: Any, token_ids: Sequence[int]) -> InFlight:
        """Launch a :meth:`prepare_ahead` step with its token ids (``[sequences]``, step order)."""
        self.backend.patch_ids(ctx, np.asarray(token_ids, np.int64))  # type: ignore[attr-defined]
        return self._launch(ctx)

    def abandon(self, ctx: Any) -> None:
        """Throw away a :meth:`prepare_ahead` step that will not run (its metric counts are taken back)."""
        self.backend.abandon(ctx)  # type: ignore[attr-defined]

    def _forward(self, ctx: Any) -> Any:
        """The one pipeline: segments and their exits' operators, then the head (backend tensors)."""
        be, cfg = self.backend, self.cfg
        env = be.inputs(ctx)
        for si, plan in enumerate(self.plans[:-1]):
            out = be.segment(si, ctx, env)
            env["x"] = out["x_next"]
            kind, layer = plan.exit
            if kind == "mixer" and cfg.layer_types[layer] == LINEAR:
                env["mix_core"] = be.gdn(layer, ctx, out)
                env["mix_z"] = out["z"]
            elif kind == "mixer":
                env["mix_attn"] = be.attention(layer, ctx, out)
                env["mix_gate"] = out["gate"]
            elif kind == "moe":
                env["ffn_out"] = be.moe(layer, ctx, out["h"])
        return be.head(ctx, env["x"])
