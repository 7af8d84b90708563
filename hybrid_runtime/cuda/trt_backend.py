"""The device-resident TensorRT path: a TensorRT bundle's segments as plans bound to the runtime's device buffers,
and everything between them (GDN, paged attention, MoE, sampling) on the same GPU with the ``cuda`` backend's
kernels.

:class:`TrtDeviceBackend` is the :class:`~hybrid_runtime.cuda.backend.CudaBackend` with the segment programs
replaced by TensorRT execution contexts. Per step, exactly as for a ``cuda`` bundle: the host validates and packs
the step's small inputs into pinned memory (:meth:`CudaBackend.prepare`, plus the int64 token ids and positions the
plans read), ONE host-to-device copy, then on the backend's one stream: each segment's ``execute_async_v3`` on
buffers bound at load (:class:`~hybrid_runtime.engine.trt_buffers.SegmentBuffers`: two activation banks, the
operators' outputs, the head's rows and logits), the operators' kernels reading and writing those same buffers,
the device sampler, and ONE device-to-host copy of the sampled tokens (and logprobs) followed by the step's one
synchronize. No segment copies or synchronizes (``TrtEngine.run_bound``).

What differs from a ``cuda`` bundle, and how it is handled:

* Weights: the projections, norms and lm_head are inside the plans; the bundle's ``state_weights.safetensors``
  holds only what the stateful operators need (conv weights, MoE router / experts / shared expert, in the
  checkpoint's names and layouts). They are converted at load to the runtime weights the kernels read
  (:func:`~hybrid_runtime.program.derive_weight`: the router with the shared gate's row, stacked experts) and
  uploaded. Quantized (GPTQ) TensorRT bundles do not exist (the builder refuses them) and are refused here too.
* Dtype: segment tensors are float32 whatever precision the plans compute in (``--dtype float16`` plans cast
  inside the network), so the operators run the float32 kernels (the ``cuda`` backend's parity configuration): a
  float32 KV pool, float32 GDN, the CUDA-core MoE with a cuBLASLt router, float32 logits.
* Segment boundaries: the fused kernels of a ``cuda`` bundle that cross a segment boundary are not used (the GDN
  gates and gated norm, the attention q/k norm and RoPE are inside the plans): GDN decode runs the conv and delta
  rule launches, attention first writes the plan's k / v to the paged pool (``kv_write``, at the pool rows of the
  step upload), the MoE's slots are summed into ``ffn_out`` for the next plan (fused.cu's add, no norm), and the
  head's rows are gathered from the last x (the same add kernel, through the step's logit rows).
* No CUDA graphs: decode steps launch eagerly (a TensorRT enqueue can be captured, but that is not verified here).

Invariants: 2 (contexts bound once: ``per_context`` binds every address at load and never again;
``single_context`` rebinds the same runtime addresses after each switch), 3 (every enqueue checks the token count,
the active profile and every input shape against ``get_tensor_profile_shape`` first; a refused step enqueues
nothing) and 4 (plans of another TensorRT or compute capability refused at load) hold as in
:mod:`hybrid_runtime.engine.tensorrt`. Slots, the sink slot and sink page, bounds checks and the guarded decode
attention are the ``cuda`` backend's. Only the engine thread calls it (invariant 1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import BundleError, ConfigError, Manifest, SegmentSpec
from ..engine.base import Phase
from ..engine.trt_buffers import BufferSpec, SegmentBuffers
from ..pipeline import plan_segments
from ..program import derive_weight, moe_layers, runtime_weight_specs
from ..weights_io import SafetensorsFile
from .backend import CudaBackend, CudaCtx, Mat
from .driver import CudaDevice, DeviceArray, compute_capability
from .graphs import bucket_for
from .weights import DeviceWeights

log = logging.getLogger("hybrid_runtime.cuda")

_ALIGN = 256


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class DeviceCudaApi:
    """:class:`~hybrid_runtime.engine.tensorrt.CudaApi` over the backend's :class:`CudaDevice`: its context and its
    ONE stream, so TensorRT's enqueues and the operators' kernels are ordered by the stream alone."""

    def __init__(self, dev: CudaDevice) -> None:
        self.dev = dev
        self._bufs: dict[int, Any] = {}

    def compute_capability(self) -> tuple[int, int]:
        return compute_capability(self.dev.ordinal)

    def stream_create(self) -> int:
        return int(self.dev.stream)

    def stream_synchronize(self, stream: int) -> None:
        self.dev.synchronize()

    def malloc(self, nbytes: int) -> int:
        buf = self.dev.alloc(max(1, nbytes))
        self._bufs[buf.ptr] = buf
        return int(buf.ptr)

    def free(self, ptr: int) -> None:
        self._bufs.pop(ptr).free()

    def htod_async(self, dst: int, src: np.ndarray, stream: int) -> None:
        self.dev.copy_htod(dst, src)

    def dtoh_async(self, dst: np.ndarray, src: int, stream: int) -> None:
        self.dev.copy_dtoh(dst.ctypes.data, src, dst.nbytes)


@dataclass
class _HostRegion:
    """A slice of the pinned upload mirror, as :meth:`CudaBackend.prepare` writes it (``array``, ``ptr``)."""

    array: np.ndarray
    ptr: int


def segment_mismatch(spec: SegmentSpec, plan: Any) -> str | None:
    """Why a bundle segment's inputs / outputs differ from this runtime's pipeline plan (None: they agree)."""
    got = ([tuple(x) for x in spec.inputs], [tuple(x) for x in spec.outputs])
    want = ([tuple(x) for x in plan.inputs], [tuple(x) for x in plan.outputs])
    if spec.name != plan.name or got != want:
        return f"segment {spec.name}: bundle I/O {got}, this runtime's pipeline has {plan.name} {want}"
    return None


def operator_weights(bundle_dir: str | Path, manifest: Manifest) -> Callable[[str], np.ndarray]:
    """Runtime weight name (a GDN layer's ``conv1d``, an MoE layer's ``router`` / ``shared.gate`` / ``experts.*`` /
    ``shared.*``) -> its float32 array, derived from the bundle's state weights (checkpoint names; the experts'
    gate and up stored fused as ``experts.gate_up_proj``) exactly as a ``cuda`` bundle derives it from the
    checkpoint (:func:`~hybrid_runtime.program.derive_weight`), its shape checked against the runtime's spec."""
    cfg, rope_len = manifest.model, manifest.limits.max_seq_len
    path = Path(bundle_dir) / manifest.state_weights
    if not path.is_file():
        raise BundleError(f"{path} is missing: a TensorRT bundle keeps its operators' weights there")
    sw = SafetensorsFile(path)
    stored = set(sw.keys())
    inter = cfg.moe_intermediate_size
    specs = {s.name: s for s in runtime_weight_specs(cfg, rope_len)}

    def get(name: str) -> np.ndarray:
        if name.endswith((".experts.gate_proj", ".experts.up_proj")) and name not in stored:
            fused = name.rsplit(".", 1)[0] + ".gate_up_proj"
            if fused not in stored:
                raise BundleError(f"{path.name} has neither {name} nor {fused}")
            gu = np.asarray(sw.get(fused), np.float32)  # [E, 2I, H]: per expert the gate rows, then the up rows
            return gu[:, :inter] if name.endswith("gate_proj") else gu[:, inter:]
        if name not in stored:
            raise BundleError(f"{path.name} has no {name}: rebuild the bundle with this version of the builder")
        return np.asarray(sw.get(name), np.float32)

    def weight(name: str) -> np.ndarray:
        if name not in specs:
            raise KeyError(f"{name!r} is not a runtime weight of this model")
        arr = np.ascontiguousarray(derive_weight(cfg, name, get, rope_len), np.float32)
        if arr.shape != tuple(specs[name].shape):
            raise BundleError(f"state weights give {name} the shape {list(arr.shape)}, the runtime expects "
                              f"{list(specs[name].shape)}; rebuild the bundle with this version of the builder")
        return arr

    return weight


class TrtDeviceBackend(CudaBackend):
    """A TensorRT bundle on one GPU, device-resident (see the module docstring).

    ``pinning``: ``per_context`` | ``single_context`` (invariant 2). ``trt`` / ``cuda_device``: the TensorRT module
    and the device to use (default: the installed TensorRT, and ``device``'s GPU); tests pass a double and a
    device. The other arguments are :class:`CudaBackend`'s."""

    kind = "tensorrt"
    bundle_backend = "tensorrt"

    def __init__(self, bundle_dir: str | Path, manifest: Manifest, *, device: str = "cuda",
                 pinning: str = "per_context", multi_block_mode: str = "auto", num_kv_pages: int | None = None,
                 cuda_device: CudaDevice | None = None, gpu_memory_fraction: float | None = None, trt: Any = None,
                 progress: Callable[[str], None] | None = None) -> None:
        if manifest.quantization is not None:
            raise BundleError(f"TensorRT bundle with a {manifest.quantization.method} quantization record: quantized "
                              "weights run on the onnxruntime and cuda backends only; rebuild with --backend cuda")
        self._bundle_dir = Path(bundle_dir)
        self._pinning, self._trt = pinning, trt
        plans = plan_segments(manifest.model)
        if len(plans) != len(manifest.segments):
            raise BundleError(f"bundle has {len(manifest.segments)} segments, this runtime's pipeline "
                              f"{len(plans)}; rebuild the bundle with this version of the builder")
        for spec, plan in zip(manifest.segments, plans):
            if (why := segment_mismatch(spec, plan)) is not None:
                raise BundleError(f"{why}; rebuild the bundle with this version of the builder")
        self.seg_plans = plans
        self.engine: Any = None
        # The operators' kernels as the float32 cuda backend runs them: no fused kernel that crosses a segment
        # boundary (gates, gated norm and RoPE are in the plans), no tensor-core / bf16 decode paths.
        super().__init__(bundle_dir, manifest, device=device, multi_block_mode=multi_block_mode,
                         num_kv_pages=num_kv_pages, cuda_device=cuda_device, gpu_memory_fraction=gpu_memory_fraction,
                         moe_decode="cuda_cores", fused_router=False, fused_gdn_decode=False, dense_decode=False,
                         progress=progress)
        self.head_index = len(plans) - 1
        log.info("tensorrt bundle on %s, device-resident: %d segments, %d contexts (%s), segment buffers %.1f MB; "
                 "plans %s, operators float32", self.device, len(plans), self.engine.num_contexts(), pinning,
                 self.seg_buffers.nbytes / 1e6, manifest.dtype)

    # ------------------------------------------------------------------ load hooks

    def _runtime_dtype(self, manifest: Manifest) -> str:
        if manifest.dtype not in ("float32", "float16", "bfloat16"):
            raise BundleError(f"tensorrt bundle dtype {manifest.dtype!r} is not float32 / float16 / bfloat16")
        return "float32"  # segment tensors are float32 whatever the plans compute in: the operators follow

    def _load_weights(self, bundle_dir: str | Path, manifest: Manifest, progress: Callable[[str], None] | None,
                      keep_packed: bool, packed_linears: bool, packed_experts: bool = False,
                      prefill_zeros: bool = True, dual_linears: bool = False) -> DeviceWeights:
        """The stateful operators' weights from the bundle's state weights (checkpoint names and layouts) as the
        runtime weights the kernels read: conv weights, and per MoE layer the router (+ the shared gate's row) and
        the stacked experts (``DeviceWeights._stack_moe``). Float32 on the device."""
        cfg = manifest.model
        w = DeviceWeights(self.dev, cfg, "float32", manifest.limits.max_seq_len)
        weight = operator_weights(bundle_dir, manifest)
        keep: list[np.ndarray] = []  # host arrays until the copies are done

        def put(name: str, ptr: int) -> None:
            keep.append(arr := weight(name))
            self.dev.copy_htod(ptr, arr)

        for layer in cfg.linear_layers:
            name = f"layers.{layer}.linear_attn.conv1d"
            w.arrays[name] = a = self.dev.empty(w.specs[name].shape, "float32")
            put(name, a.ptr)
        for layer in moe_layers(cfg):
            if progress:
                progress(f"loading MoE layer {layer + 1}/{cfg.num_layers} to {self.dev.limits.name}")
            w._moe[layer] = w._stack_moe(layer, put)
        self.dev.synchronize()  # the host arrays in keep are free to go after this
        return w

    def _arena_shapes(self) -> dict[str, tuple[tuple[int, int], str]]:
        """The cuda backend's arena less the segment programs' own buffers (the plans have theirs): what GDN
        (core, gdn_x), attention (attn) and the MoE (router, pairs, slots, the shared expert's gu / act) use."""
        shapes = super()._arena_shapes()
        for name in ("x", "h", "proj", "q", "o", "g", "beta", "h_out", "logits"):
            shapes.pop(name, None)
        return shapes

    def _alloc_arena(self) -> None:
        """The operators' scratch (the float32 cuda backend's buffers that GDN, attention, MoE use), the segment
        buffers of :class:`SegmentBuffers`, the upload region with the plans' int64 ids / positions in front, and
        the TensorRT engine with every context bound to them."""
        super()._alloc_arena()
        A = self.arena
        T, R = self.T_max, self.R_max
        self.seg_buffers = sb = SegmentBuffers(self.seg_plans, T, R)
        # One upload: [int64 ids | int64 positions | the cuda backend's input layout]; the plans read the first two
        pre = _up(8 * T) * 2
        self._up_dev = self.dev.empty((pre + self.in_layout.nbytes,), "uint8")
        self._up_host = self.dev.pinned(pre + self.in_layout.nbytes)
        self._up_pre = pre
        self.inp = DeviceArray(self._up_dev.ptr + pre, (self.in_layout.nbytes,), "uint8", self.dev.ordinal,
                               owner=self._up_dev)
        self.host_in = _HostRegion(self._up_host.array[pre:], self._up_host.ptr + pre)  # type: ignore[assignment]

        def alloc(b: BufferSpec) -> int:
            A.bufs[b.key] = a = self.dev.empty((b.rows, max(b.width, 1)), b.dtype)
            return a.ptr

        given = {"step.input_ids": self._up_dev.ptr, "step.positions": self._up_dev.ptr + pre // 2}
        for key in ("core", "attn"):  # the operators' outputs the next plan reads: the arena's own buffers
            if key in sb.buffers:
                given[key] = A.bufs[key].ptr
                assert A.bufs[key].shape[1] >= sb.buffers[key].width and A.bufs[key].shape[0] >= T
        self.seg_addresses = sb.allocate(alloc, given)
        self.arena_bytes = sum(a.nbytes for a in A.bufs.values())
        from ..engine.tensorrt import TrtEngine

        self.engine = TrtEngine(self._bundle_dir, self.manifest, self._pinning, trt=self._trt,
                                cuda=DeviceCudaApi(self.dev),
                                bindings=lambda si, _spec: sb.bindings(si, self.seg_addresses))

    # The upload region is one pinned buffer (ids and positions in front of the packed inputs): no second one
    # for a step prepared while another runs, so no async scheduling (serving.py runs steps one by one).
    supports_ahead = False

    # ------------------------------------------------------------------ one step

    def prepare(self, phase: Phase, steps: list[Any], rows: Any, want_logits: bool) -> CudaCtx:
        """:meth:`CudaBackend.prepare`, then the plans' int64 token ids and positions (padding rows included) in
        front of the packed inputs: they travel in the same copy. Every segment's rows are checked against the
        plans' profiles and the bound buffers first (``TrtEngine.check_rows``): a refused step launches nothing."""
        if phase == Phase.DECODE:
            n = bucket_for(len(steps), self.buckets) or 0  # padded to its bucket (none: prepare refuses it)
            r = n
        else:
            n, r = sum(len(st.token_ids) for st in steps), sum(bool(st.need_logits) for st in steps)
        if n:  # (an empty step: prepare refuses it)
            self.engine.check_rows(phase, [n] * self.head_index + [r])
        ctx = super().prepare(phase, steps, rows, want_logits)
        assert (ctx.n, ctx.R) == (n, r), "the step's rows differ from the ones checked"
        n, L, pre = ctx.n, self.in_layout, self._up_pre
        b = self._up_host.array
        ids = self.host_in.array[L.ids:L.ids + 4 * n].view(np.int32)
        pos = self.host_in.array[L.positions:L.positions + 4 * n].view(np.int32)
        b[:8 * n].view(np.int64)[:] = ids
        b[pre // 2:pre // 2 + 8 * n].view(np.int64)[:] = pos
        return ctx

    def _upload(self, ctx: CudaCtx) -> None:
        self.dev.copy_htod(self._up_dev.ptr, self._up_host.array[:self._up_pre + ctx.upload_bytes])

    def _mat(self, key: str, rows: int) -> Mat:
        b = self.seg_buffers.buffers[key]
        w = max(b.width, 1)
        return Mat(self.seg_addresses[key], rows, w, w, b.dtype)

    def inputs(self, ctx: CudaCtx) -> dict[str, Any]:
        return {"input_ids": self._mat("step.input_ids", ctx.n), "positions": self._mat("step.positions", ctx.n)}

    def segment(self, index: int, ctx: CudaCtx, env: dict[str, Any]) -> dict[str, Any]:
        """Enqueue segment ``index`` over the step's ``ctx.n`` rows of its bound buffers; its outputs as Mats of
        those buffers. The pipeline's tensors must be the bound ones (one plan for both; checked, host-side)."""
        sb = self.seg_buffers
        spec = self.seg_plans[index]
        for name, _, _ in spec.inputs:
            t = env.get(name)
            if not isinstance(t, Mat) or t.ptr != self.seg_addresses[sb.key(index, name)]:
                raise AssertionError(f"segment {spec.name} input {name}: the pipeline's tensor is not the buffer "
                                     f"the context is bound to")
        self.engine.run_bound(index, ctx.phase, ctx.n)
        return {name: self._mat(sb.key(index, name), ctx.n) for name, _, _ in spec.outputs}

    def attention(self, layer: int, ctx: CudaCtx, out: dict[str, Any]) -> Mat:
        """The plan's new k / v into the paged pool at the step's pool rows (the sink page for padding rows), then
        the cuda backend's guarded attention over q."""
        assert self.kv is not None
        self.kv.write_rows_device(layer, self._ptr(self.in_layout.kv_rows), out["k"].ptr, out["v"].ptr, ctx.n)
        return super().attention(layer, ctx, out)

    def moe(self, layer: int, ctx: CudaCtx, h: Mat) -> Mat:  # type: ignore[override]
        """The cuda backend's MoE on the plan's ``h``, its slots summed (fused.cu's add, slot order, no norm) into
        ``ffn_out``, the next plan's input."""
        y = super().moe(layer, ctx, h)
        n = ctx.n
        ffn = self._mat("ffn_out", n)
        self.dev.memset_d8(ffn.ptr, 0, n * ffn.ld * 4)
        self._rmsnorm(ffn, None, None, n, y=y, x_out=ffn)
        return ffn

    def head(self, ctx: CudaCtx, x: Mat) -> Mat | None:
        """The rows that need logits gathered from the last x into the head's input (fused.cu's add kernel with
        the step's logit rows), then the head plan into the logits buffer the sampler reads."""
        if ctx.R == 0:
            return None
        hx = self._mat("head.x", ctx.R)
        self._rmsnorm(x, None, None, ctx.R, x_out=hx, rows_ptr=self._ptr(self.in_layout.logit_rows))
        self.engine.run_bound(self.head_index, ctx.phase, ctx.R)
        return self._mat("head.logits", ctx.R)

    @property
    def profile_switches(self) -> int:
        return int(self.engine.profile_switches) if self.engine is not None else 0

    def capture_graphs(self, forward: Callable[[CudaCtx], Any], buckets: Any = None) -> None:
        raise ConfigError("CUDA graphs are not captured on the TensorRT device path (decode steps run eagerly)")
