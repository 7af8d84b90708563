"""The ``cuda`` backend: a whole step on one GPU — segment programs as fused kernels and cuBLASLt GEMMs,
GDN and decode attention kernels on device state, MoE and sampling on the device, decode steps replayed
as CUDA graphs.

Per step the host validates and packs the step's small inputs (:mod:`.stepio`) into pinned memory, sends
them in ONE copy, replays a graph (decode) or launches eagerly (prefill, or a decode step no graph fits),
and receives the sampled tokens (and logprobs) in ONE copy. Nothing else crosses; activations live in a
static arena allocated at load (the first ``n`` rows of each buffer are a step's), so a graph reads and
writes the same addresses on every replay. Only the engine thread calls it (invariant 1).

Precision: weights and the activations GEMMs read (normed h, o, act) are the bundle dtype (bfloat16 /
float16 / float32, the last true float32 for parity tests); the residual stream, the projections (GEMM
outputs: GDN / attention inputs, gate-up), the GDN core, attention outputs, router logits and logits are
float32; the KV pool is the bundle dtype (bf16 KV for bf16 bundles); GDN conv and recurrent state are float32.

Invariants kept here: one owner (the engine thread); slots bounds-checked and distinct, one sink slot and
one sink KV page for padding rows, slots zeroed on admission (:meth:`reset_slot`); the decode-attention
plan of every launch — captured or eager — validated by the guarded dispatcher right before it is enqueued
or captured; every kernel launch re-checked against the device limits (:meth:`Kernel.launch`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..backend import FAULT_KINDS, DeviceLost, SampleRow, StepResult, check_steps, slot_mapping
from ..config import DUMMY_WEIGHTS, BundleError, ConfigError, Manifest
from ..engine.base import Phase
from ..kv_cache import KVLayout
from ..ops.base import SeqStep, parse_device
from ..ops.dispatcher import SEQ_CHUNKS, VECTOR_MIN, DecodeBatch, LaunchPlan, validate
from ..ops.gdn import _check_slots
from ..pipeline import plan_segments
from ..program import PROGRAM_VERSION, Op, output_names, segment_program
from ..sampler import TokenLogprobs
from ..sampling import SamplingParams
from ..state_cache import StateLayout
from .attention import CudaDecodeAttention
from .blas import Blas
from .dense_decode import KNOB_SETS as DENSE_KNOB_SETS
from .dense_decode import MAX_ROWS as DENSE_MAX_ROWS
from .dense_decode import TUNE_SETS as DENSE_TUNE_SETS
from .dense_decode import DenseDecode, DenseKnobs
from .dense_decode import problems as dense_problems
from .driver import CudaDevice, CudaError, CudaGraph, DeviceArray, is_sticky
from .gdn import CudaGdn
from .graphs import GraphStats, bucket_for, choose, class_blocks, decode_buckets
from .kernels import load_module
from .memory import MemoryPlan, plan_memory
from .moe_decode import KNOB_SETS as MOE_DECODE_KNOB_SETS
from .moe_decode import MoEDecode
from .moe_nbits_decode import ALL_SETS as MOE_NBITS_KNOB_SETS
from .moe_nbits_decode import BACKEND_BUILDS as MOE_NBITS_BUILDS
from .moe_nbits_decode import FAST_BUILDS as MOE_NBITS_FAST_BUILDS
from .moe_nbits_decode import MoENBitsDecode
from .moe_nbits_decode import backend_build as moe_nbits_build
from .moe_nbits_decode import resolve_build as resolve_moe_nbits_build
from .moe_prefill import PACKED_MAX_TOKENS, ROUTE_MAX_CTAS, MoEBuffers, MoEPrefill, supported, tile_list_words
from .moe_router import MAX_TOKENS as ROUTER_MAX_TOKENS
from .moe_router import WORKSPACE_BYTES as ROUTER_WORKSPACE_BYTES
from .moe_router import MoERouter, RouteBuffers
from .moe_router import supported as router_supported
from .nbits_decode import BACKEND_KNOBS as NBITS_BACKEND_KNOBS
from .nbits_decode import MAX_ROWS as NBITS_MAX_ROWS
from .nbits_decode import NBitsDecode, NBitsOperand
from .nbits_decode import build_name as nbits_build_name
from .nbits_decode import problems as nbits_problems
from .nbits_decode import tune_candidates as nbits_tune_candidates
from .prefill_attention import (
    CudaPrefillAttention,
    PrefillAttentionError,
    PrefillPlan,
    pack_prefill_inputs,
    plan_prefill,
)
from .quant import NBitsDequant, PackedLinear
from .sampler import DeviceSampler, rows_params
from .state import DeviceKVCache, DeviceStateCache
from .stepio import MAX_TOP_LOGPROBS, ROW_WORDS, InputLayout, OutputLayout, StepInputs, pack
from .weights import DeviceWeights

log = logging.getLogger("hybrid_runtime.cuda")

DT_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}
SMEM_DEFAULT = 48 * 1024
GEMV_MAX_M = 16  # decode GEMMs of at most this many rows run the fused gemv kernel
FOLD_MAX_TOKENS = 16  # up to this many tokens the shared expert runs inside the routed-expert kernels


MOE_ROWS_PER_CTA = 16  # ops/cuda/fused.cu: 8 warps x MOE_RPW (2) rows
MOE_DECODE_MODES = ("auto", "tensor_cores", "cuda_cores", "mma_decode")


def moe_path(prefill: bool, n: int, tensor_cores: bool, decode_mode: str = "auto") -> str:
    """Which routed-expert kernels a step of ``n`` token rows runs: ``"tensor_cores"`` (``cuda/moe_prefill.py``:
    device routing, a tile list and grouped GEMMs; each touched expert's weights are streamed once per step),
    ``"mma_decode"`` (``cuda/moe_decode.py``: tensor cores with the weights as the M operand, 8-pair columns)
    or ``"cuda_cores"`` (``fused.cu``'s moe_route / moe_gate_up / moe_down).

    Prefill always takes the tensor cores when they exist (``tensor_cores``: bf16/fp16 and a shape the tiles
    divide, which the decode kernels' shapes include). Decode follows ``decode_mode``: ``"tensor_cores"`` /
    ``"mma_decode"`` / ``"cuda_cores"`` always; ``"auto"`` is ``"mma_decode"``: on the H200 it reads the experts
    faster than the CUDA-core kernels at every batch size (23 vs 29 us at 1 row, 102 vs 161 at 8, 385 vs 598 at
    64; within 4% of the grouped GEMMs at 64: benchmarks/results/gpu_moe_decode_h200.md), and a pair's result
    does not depend on how many pairs share its expert, so a row's MoE bits are the same at every decode batch
    size."""
    if decode_mode not in MOE_DECODE_MODES:
        raise ValueError(f"moe decode mode {decode_mode!r}: one of {MOE_DECODE_MODES}")
    if not tensor_cores:
        return "cuda_cores"
    if prefill or decode_mode == "tensor_cores":
        return "tensor_cores"
    return "cuda_cores" if decode_mode == "cuda_cores" else "mma_decode"


def moe_scratch_reasons(packed_bits: dict[int, int], folds: dict[int, bool], max_tokens: int, tensor_cores: bool,
                        decode_mode: str, packed_moe_prefill: bool,
                        packed_prefill_ok: Callable[[int, bool], bool]) -> list[str]:
    """Why a backend with packed experts (``packed_bits``: MoE layer -> code bits of its packed experts;
    ``folds``: layer -> whether its shared expert is folded in as expert E) needs the dequantised scratch stack
    (``DeviceWeights.moe_scratch``: ``E_all x 3 x I x H`` elements of the bundle dtype, 1.6 GB for Qwen3.5-35B-A3B)
    for some step it can run; empty: every step reads the packed experts directly and the stack can go.

    The paths (``moe()``): decode steps on ``"mma_decode"`` read them with the packed decode MoE at every batch size;
    ``"tensor_cores"`` steps (every prefill step of ``1 .. max_tokens`` rows, and decode steps in that mode, folded
    up to :data:`FOLD_MAX_TOKENS` rows) run the packed grouped GEMMs when ``packed_moe_prefill`` is on, the step's
    rows are at most ``PACKED_MAX_TOKENS[bits]`` and ``packed_prefill_ok(layer, fold)`` (Hopper; the stacks'
    shapes); ``"cuda_cores"`` steps always dequantise first."""
    out: list[str] = []
    decode_path = moe_path(False, 1, tensor_cores, decode_mode)  # the same path for every decode batch size
    if decode_path == "cuda_cores":
        out.append("decode steps take the CUDA-core MoE, which reads dequantised experts"
                   + ("" if tensor_cores else " (no tensor-core MoE for this dtype / shape)"))
    tc_folds = [False] + ([True] if decode_path == "tensor_cores" else [])  # prefill never folds
    if tensor_cores and not packed_moe_prefill:
        out.append("packed_moe_prefill is off: tensor-core steps dequantise the experts first")
    elif tensor_cores:
        for layer, bits in sorted(packed_bits.items()):
            cap = PACKED_MAX_TOKENS.get(bits, 0)
            if max_tokens > cap:
                out.append(f"layer {layer}: steps of {cap + 1}..{max_tokens} rows ({bits}-bit) dequantise first")
            bad = [f for f in tc_folds if (not f or folds.get(layer, False)) and not packed_prefill_ok(layer, f)]
            if bad:
                out.append(f"layer {layer}: the packed grouped GEMMs refuse its stacks (see the load log)")
    return out


def to_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 host values as the raw bits of ``dtype`` (bfloat16 as uint16), for uploads."""
    from ..weights_io import f32_to_bf16_bits

    a = np.asarray(a, np.float32)
    if dtype == "bfloat16":
        return f32_to_bf16_bits(a)
    return a.astype(np.float16 if dtype == "float16" else np.float32)


@dataclass(frozen=True)
class Mat:
    """Rows of a row-major device matrix: ``rows x cols`` elements of ``dtype``, ``ld`` elements apart."""

    ptr: int
    rows: int
    cols: int
    ld: int
    dtype: str

    def col(self, start: int, width: int) -> Mat:
        return Mat(self.ptr + start * ITEMSIZE[self.dtype], self.rows, width, self.ld, self.dtype)

    def first(self, rows: int) -> Mat:
        return Mat(self.ptr, rows, self.cols, self.ld, self.dtype)


@dataclass(frozen=True)
class MoEOut:
    """The MoE's output as the next add reads it: ``y [n, ny, H]`` of ``dtype`` (slot sums = the FFN output;
    the last slot times sigmoid(sg) when ``sg`` is set: a shared expert run as GEMMs). ``dtype`` is float32, or in
    prefill steps of bf16 / fp16 bundles the bundle dtype (``CudaBackend.moe_slots_lowp``): every slot rounded once
    to it by the GEMM that wrote it, summed in float32 in slot order by the add."""

    y: int
    ny: int
    sg: int = 0
    sg_stride: int = 0
    dtype: str = "float32"


NORM_MAX_THREADS = 512  # ops/cuda/fused.cu rmsnorm_rows: its launch bound
NORM_KMAX = 4  # ... and the 4-column groups a thread holds by default (-DNORM_KMAX)
NORM_FEW_ROWS = 64  # up to this many rows a row's norm gets a thread per 4 columns (latency); past it 256 threads


def norm_block(hidden: int, rows: int) -> tuple[int, int]:
    """(threads per row, NORM_KMAX build) of fused.cu's ``rmsnorm_rows`` for ``rows`` rows of ``hidden``. Only speed
    follows from it: the kernel's sum of squares is one fixed tree per row whatever the block (a row's bits never
    depend on the rows beside it, decode or prefill). Few rows (decode, the head): one thread per 4-column group, up
    to NORM_MAX_THREADS, every load of the row in flight at once; many rows: 256 threads (up to NORM_KMAX groups each,
    several CTAs per SM). Rows wider than 4 * NORM_KMAX * NORM_MAX_THREADS (8192) take a build with more groups."""
    groups = -(-hidden // 4)
    kmax = NORM_KMAX
    while 4 * kmax * NORM_MAX_THREADS < hidden:
        kmax *= 2
    one_each = min(NORM_MAX_THREADS, max(32, 1 << (groups - 1).bit_length()))
    threads = one_each if rows <= NORM_FEW_ROWS else min(one_each, 256)
    while threads * kmax < groups:
        threads *= 2
    return threads, kmax


@dataclass
class CudaCtx:
    phase: Phase
    n: int  # token rows the kernels run (decode: the bucket, padding included)
    n_real: int
    S: int  # sequences (decode: rows, padding included)
    R: int  # logit rows (decode: n)
    R_real: int
    max_len: int  # longest prefill chunk (GDN prefill grid)
    plan: LaunchPlan | None
    batch: DecodeBatch | None
    queries: int
    rows: Sequence[SampleRow] | None
    want_logits: bool
    upload_bytes: int = 0
    graph: CudaGraph | None = None
    want_top: bool = False
    logits: Mat | None = None
    prefill: PrefillPlan | None = None  # the prefill-attention kernel's plan (prefill steps, when it runs)
    prefill_tables: int = 0  # byte offset of its page tables in the step upload (its work list is at attn)
    prefill_stride: int = 0
    host_in: Any = None  # the pinned buffer its inputs were packed into (prepare_ahead alternates two)
    counters: tuple[Counter, ...] | None = None  # prepare_ahead: the counters before it, for abandon()
    launched: bool = False
    t0: float = 0.0
    host_logits: np.ndarray | None = None


def _linear_weight(w: Any, name: str) -> DeviceArray | PackedLinear:
    """A linear op's weight: its float array, or its packed form when the weights keep it only packed
    (``DeviceWeights.packed_only``; ``w`` may be any mapping of name -> array)."""
    packed = getattr(w, "packed_only", None)
    return packed[name] if packed and name in packed else w[name]


@dataclass
class _Arena:
    bufs: dict[str, DeviceArray] = field(default_factory=dict)

    def mat(self, name: str, rows: int, cols: int | None = None, dense: bool = False) -> Mat:
        """The first ``rows`` rows of buffer ``name``: rows ``ld`` = the buffer's width apart, or (``dense``)
        ``cols`` apart, for kernels that write contiguous ``[rows, cols]`` output."""
        a = self.bufs[name]
        c = a.shape[1] if cols is None else cols
        if c > a.shape[1]:
            raise ValueError(f"arena buffer {name} is {a.shape[1]} wide, {c} columns asked for")
        return Mat(a.ptr, rows, c, c if dense else a.shape[1], a.dtype.name)


def fill_random(dev: CudaDevice, fused: Any, a: DeviceArray, seed: int, scale: float, offset: float = 0.0) -> None:
    """Fill ``a`` in place with seeded uniform values in offset +- scale (``fused``: fused.cu loaded for the
    weights' dtype; its fill_random kernels)."""
    k = fused.kernel("fill_random_f32" if a.dtype.name == "float32" else "fill_random")
    k.launch(dev, (4096, 1, 1), (256, 1, 1), 0, [("ptr", a.ptr), ("i64", a.size), ("u64", seed), ("f32", scale),
                                                 ("f32", offset)])


def fill_random_codes(dev: CudaDevice, fused: Any, a: DeviceArray, seed: int, bits: int) -> None:
    """Fill ``a`` (any dtype, a multiple of 4 bytes) in place with seeded random ``bits``-bit weight codes (4: two a
    byte, 8: one), uniform over 1 .. 2^bits - 1: symmetric around the zero-point 2^(bits-1), as a real checkpoint's
    codes are (``fused``: fused.cu, any dtype; its fill_random_codes kernel)."""
    if bits not in (4, 8) or a.nbytes % 4:
        raise ValueError(f"random codes: bits {bits} (4 / 8) into {a.nbytes} bytes (a multiple of 4)")
    fused.kernel("fill_random_codes").launch(dev, (4096, 1, 1), (256, 1, 1), 0,
                                             [("ptr", a.ptr), ("i64", a.nbytes // 4), ("u64", seed),
                                              ("i32", bits)])


class CudaBackend:
    """Loads a ``cuda`` bundle onto one GPU and runs its steps (see the module docstring)."""

    kind = "cuda"
    bundle_backend = "cuda"  # the manifest backend this class loads (cuda/trt_backend.py: "tensorrt")
    _fault: str | None = None  # a test-only fault for the next step (inject_fault)
    capture_bytes = 0  # device memory that warm-up and graph capture took (capture_graphs)
    dense_tune_seconds = 0.0  # what tune_dense_decode took at load
    nbits_tune_seconds = 0.0  # what tune_nbits_decode took at load
    prefill_plans = 0  # prefill steps planned for the tensor-core prefill-attention kernel
    moe_slots_lowp = True  # prefill MoE slots in the bundle dtype (moe); False: float32 (tests, benchmarks)

    def __init__(self, bundle_dir: str | Path | None, manifest: Manifest, *, device: str = "cuda",
                 multi_block_mode: str = "auto", num_kv_pages: int | None = None, cuda_device: CudaDevice | None = None,
                 weights: DeviceWeights | None = None, batch_invariant_gemm: bool = True,
                 gemv_decode: bool = False, progress: Callable[[str], None] | None = None,
                 gpu_memory_fraction: float | None = None, moe_decode: str = "auto",
                 batch_invariant_attention: bool = True, fused_router: bool = True,
                 fused_gdn_decode: bool = True, dense_decode: bool | DenseKnobs = True,
                 dense_decode_max_mb: float | None = None, keep_packed: bool = False,
                 packed_linears: bool = False, packed_experts: bool = False,
                 packed_moe_prefill: bool = True, dual_linears: bool = False) -> None:
        kind, ordinal = parse_device(device)
        if kind != "cuda":
            raise ConfigError(f"device={device!r}: a cuda bundle runs on the GPU: use device 'cuda' or 'cuda:N' "
                              f"(or 'auto')")
        if manifest.backend != self.bundle_backend:
            raise BundleError(f"{type(self).__name__} needs a {self.bundle_backend} bundle, got backend "
                              f"{manifest.backend!r}")
        if manifest.toolkit.get("program") not in (None, str(PROGRAM_VERSION)):
            raise BundleError(f"bundle built for segment program version {manifest.toolkit.get('program')}, this "
                              f"runtime runs version {PROGRAM_VERSION}: rebuild it")
        t0 = time.perf_counter()
        cfg, lim = manifest.model, manifest.limits
        self.cfg, self.lim, self.manifest = cfg, lim, manifest
        self.dtype = self._runtime_dtype(manifest)
        self.es = ITEMSIZE[self.dtype]
        try:
            self.dev = cuda_device or CudaDevice(ordinal)
        except CudaError as e:
            raise ConfigError(f"device={device!r}: the CUDA backend cannot start: {e}") from e
        self.device = f"cuda:{self.dev.ordinal}"
        self.batch_invariant_gemm = batch_invariant_gemm
        self.gemv_decode = gemv_decode
        # Decode GEMMs of <= 16 rows on dense_decode.cu's tensor-core kernel (bf16 / fp16 bundles): a programmatic
        # dependent whose weight stream starts before the kernel ahead of it ends (cuda/dense_decode.py); products
        # of more than dense_decode_max_mb MiB of weights (None: no limit) stay on cuBLASLt. float32: cuBLASLt.
        self.dense: DenseDecode | None = None
        self.dense_max_bytes = None if dense_decode_max_mb is None else int(dense_decode_max_mb * 2**20)
        moe_path(False, 1, False, moe_decode)  # validates the mode
        self.moe_decode = moe_decode  # which decode steps take the tensor-core MoE (moe_path); tests, benchmarks
        arch = self.dev.arch
        self.fused = load_module("fused.cu", (f"-DDT={DT_CODES[self.dtype]}",), arch)
        self.sampling = load_module("sampling.cu", (), arch)
        # Prefill MoE on tensor cores (bf16/fp16 bundles whose shapes the tiles divide); None: fused.cu's kernels
        self.moe_prefill: MoEPrefill | None = None
        if "moe" in cfg.ffn_types and supported(self.dtype, cfg.hidden_size, cfg.moe_intermediate_size,
                                                cfg.num_experts, cfg.num_experts_per_tok):
            self.moe_prefill = MoEPrefill(self.dev, self.dtype)
        # Decode steps of <= 16 rows on the CUDA-core MoE: router GEMM + moe_route in one launch (cuda/moe_router.py)
        # for bf16/fp16 bundles whose router shape it takes (fused_router); None: cuBLASLt GEMM + moe_route
        self.moe_router: MoERouter | None = None
        if fused_router and "moe" in cfg.ffn_types:
            e_pad = -(-(cfg.num_experts + int(cfg.shared_expert_intermediate_size > 0)) // 8) * 8  # weights.py
            if router_supported(self.dtype, cfg.hidden_size, e_pad, cfg.num_experts, cfg.num_experts_per_tok):
                self.moe_router = MoERouter(self.dev, self.dtype)
        # Decode MoE on tensor cores, weights as the M operand (moe_decode "mma_decode"); built here when that mode
        # is asked for, else on the first step that takes it (moe(): benchmarks switch modes on a live backend)
        self.moe_mma_decode: MoEDecode | None = None
        self.moe_mma_decode_one: MoEDecode | None = None  # the dn_pre build, for 1-row steps
        self.moe_mma_decode_many: MoEDecode | None = None  # KNOB_SETS["many"], for steps of > 16 rows
        # the packed-expert decode MoE (packed_experts): the build MOE_NBITS_BUILDS names for a step's rows (same bits)
        self.moe_nbits: dict[str, MoENBitsDecode] = {}
        if moe_decode == "mma_decode" and self.moe_prefill is not None:
            self.moe_mma_decode = MoEDecode(self.dev, self.dtype)
        self.blas = Blas(self.dev)
        if dense_decode and self.dtype in ("bfloat16", "float16"):
            if isinstance(dense_decode, DenseKnobs):  # one build, no tuning (tests, benchmarks)
                self.dense = DenseDecode(self.dev, self.dtype, dense_decode)
            else:  # the default build and the ones capture_graphs times per shape at load (same bits)
                self.dense = DenseDecode(self.dev, self.dtype, DENSE_KNOB_SETS["default"],
                                         [DENSE_KNOB_SETS[k] for k in DENSE_TUNE_SETS])
        if weights is None and manifest.state_weights == DUMMY_WEIGHTS:
            log.warning("DUMMY WEIGHTS: this bundle (--dummy-weights) has no weights; seeded random ones are "
                        "generated on %s. Its outputs are meaningless (benchmarks and load tests only)",
                        self.dev.limits.name)
            weights = DeviceWeights.random(self.dev, cfg, self.dtype, lim.max_seq_len, self._fill_random, seed=0,
                                           progress=progress)
        if weights is None:
            if bundle_dir is None:
                raise ValueError("need a bundle directory or preloaded weights")
            # a GPTQ bundle's packed weights are dequantised at load; keep_packed keeps their device copies too
            # (DeviceWeights.packed; counted in the weights' bytes and taken before the memory plan reads free memory)
            # packed_linears (bf16 / fp16 GPTQ bundles; off by default: the int4 / int8 decode GEMM beats dense_decode
            # over the dequantised bf16 weights on the H200 (benchmarks/results/gpu_nbits_decode_h200.md), but prefill
            # then dequantises a scratch copy per product, and that step-level trade is not measured yet):
            # the dense linear weights stored packed stay only packed; decode GEMMs of <= NBITS_MAX_ROWS rows read
            # them with the int4 / int8 kernel, the others dequantise them into a scratch buffer first (_gemm).
            # float32 bundles (the parity configuration) always dequantise everything.
            packed_linears = packed_linears and self.dtype in ("bfloat16", "float16")
            # dual_linears (bf16 / fp16 GPTQ bundles; packed_weights=dual): the same dense linears in both forms,
            # dequantised (every other product as without it) and packed (DeviceWeights.packed_decode): decode GEMMs
            # of <= NBITS_MAX_ROWS rows read the packed form with the int4 / int8 decode GEMM, packed_linears' builds
            # (the same bits as packed_linears' decode steps: 4-bit multiplies by the scale rounded to the dtype)
            dual_linears = dual_linears and not packed_linears and self.dtype in ("bfloat16", "float16")
            # packed_experts (bf16 / fp16 GPTQ bundles; off by default, not yet measured in a served step): the MoE
            # layers whose experts stack as one packed operand keep them only packed (DeviceWeights.packed_moe);
            # decode steps on the "mma_decode" path read them with the int4 / int8 decode MoE
            # (cuda/moe_nbits_decode.py: the bits of moe_decode on the dequantised weights, or with packed projections
            # the int4 sacc builds, moe_nbits_table), tensor-core steps
            # (prefill) on Hopper the packed grouped GEMMs (packed_moe_prefill: the bits of the dequantised stack),
            # every other use dequantises the layer into one scratch stack first (moe()).
            packed_experts = packed_experts and self.dtype in ("bfloat16", "float16")
            # the int32 zero-point copies only where the packed prefill GEMMs can run (Hopper, turned on)
            prefill_zeros = (packed_moe_prefill and self.moe_prefill is not None
                             and tuple(self.dev.compute_capability) == (9, 0))
            weights = self._load_weights(bundle_dir, manifest, progress, keep_packed, packed_linears,
                                         packed_experts=packed_experts, prefill_zeros=prefill_zeros,
                                         dual_linears=dual_linears)
        self.w = weights
        self.moe_nbits_calls = 0  # packed-expert decode MoE launches issued (eager steps and graph captures)
        # tensor-core MoE steps (prefill) of packed experts on the packed grouped GEMMs (moe_prefill.experts_packed),
        # where packed_problems allows; False or refused: the stack is dequantised into the scratch first (same bits)
        self.packed_moe_prefill = packed_moe_prefill
        self.moe_packed_prefill_calls = 0
        # the packed experts' decode builds: the dequantised bundle's bits (MOE_NBITS_BUILDS) where the dense
        # projections are not packed (packed_weights experts), the faster sacc builds where they are (all / dual,
        # whose decode steps already differ from the dequantised bundle's bits)
        packed_proj = bool(getattr(self.w, "packed_only", None) or getattr(self.w, "packed_decode", None))
        self.moe_nbits_table = MOE_NBITS_FAST_BUILDS if packed_proj else MOE_NBITS_BUILDS
        if self.w.packed_moe:  # compiled and opted in now: never inside a graph capture
            for pk in self.w.packed_moe.values():
                nb_bits, sizes = pk.gate_up.bits, (pk.gate_up.block_size, pk.down.block_size)  # type: ignore
                for _, name in self.moe_nbits_table[nb_bits]:
                    build = resolve_moe_nbits_build(name, nb_bits, sizes)
                    if build not in self.moe_nbits:
                        self.moe_nbits[build] = MoENBitsDecode(self.dev, self.dtype, MOE_NBITS_KNOB_SETS[build])
                    dec = self.moe_nbits[build]
                    dec.module_for(pk.gate_up)  # type: ignore[arg-type]  # each (bits, fma) build its operands take
                    dec.module_for(pk.down)  # type: ignore[arg-type]
            if packed_moe_prefill and self.moe_prefill is not None:
                # the packed prefill GEMMs' builds too (asked per layer and fold now: refusals logged at load)
                for layer, pk in self.w.packed_moe.items():
                    folds = (False, True) if self.w.moe(layer).fold else (False,)
                    if any([self._packed_prefill_ok(layer, pk, f) for f in folds]):
                        self.moe_prefill.packed_module(pk.sources[0].bits)
            # the dequantised scratch stack only where some step can need it (before the memory plan reads free
            # memory: what it held goes to the KV pool)
            scratch = self.w.moe_scratch
            if scratch is not None:
                why = moe_scratch_reasons(
                    {layer: pk.sources[0].bits for layer, pk in self.w.packed_moe.items()},
                    {layer: self.w.moe(layer).fold for layer in self.w.packed_moe},
                    max(lim.max_num_tokens, lim.max_batch_size), self.moe_prefill is not None, self.moe_decode,
                    packed_moe_prefill,
                    lambda layer, fold: self._packed_prefill_ok(layer, self.w.packed_moe[layer], fold))
                gib = sum(a.nbytes for a in scratch) / 2**30
                if why:
                    log.info("packed experts: keeping the %.2f GiB dequantised scratch stack: %s", gib,
                             "; ".join(why[:4]) + (f"; and {len(why) - 4} more" if len(why) > 4 else ""))
                else:
                    self.w.release_moe_scratch()
                    log.info("packed experts: every step reads them packed; the %.2f GiB dequantised scratch stack "
                             "is freed", gib)
        self.nbits: NBitsDecode | None = None
        self.nbits_deq: NBitsDequant | None = None
        self.nbits_scratch: DeviceArray | None = None
        self._nbits_ops: dict[int, NBitsOperand] = {}
        self.nbits_calls = self.nbits_fallbacks = 0  # packed-weight GEMMs launched: by the kernel, dequantised first
        packed_decode = self.w.packed_decode
        if self.w.packed_only or packed_decode:
            # the backend's build (sacc where it applies) and the ones capture_graphs times per shape at load
            # (tune_nbits_decode; the same bits)
            self.nbits = NBitsDecode(self.dev, self.dtype, NBITS_BACKEND_KNOBS,
                                     nbits_tune_candidates(NBITS_BACKEND_KNOBS))
            # keyed by the pointer _gemm is handed: a packed-only weight's codes, a dual weight's dequantised array
            self._nbits_ops = {p.B.ptr: NBitsOperand.from_packed(p) for p in self.w.packed_only.values()}
            self._nbits_ops.update({self.w[n].ptr: NBitsOperand.from_packed(p) for n, p in packed_decode.items()})
            self.nbits.prepare(list(self._nbits_ops.values()))  # compiled now, never during a graph capture
        if self.w.packed_only:
            self.nbits_deq = NBitsDequant(self.dev, self.dtype)
            self.nbits_scratch = self.dev.empty((max(p.N * p.k_in for p in self.w.packed_only.values()),), self.dtype)
        # Biases in the activation dtype too (cuBLASLt's bias epilogue reads the output's dtype), made here:
        # never during a graph capture.
        self._bias_t: dict[int, DeviceArray] = {}
        for name, a in self.w.arrays.items():
            if name.endswith(("qkv_bias", "o_bias")) and self.dtype != "float32":
                self._bias_t[a.ptr] = self.dev.upload(to_dtype(self.dev.download(a), self.dtype), dtype=self.dtype)
        # ---- static buffers
        self.buckets = decode_buckets(lim.max_batch_size)
        self.T_max = max(lim.max_num_tokens, self.buckets[-1])
        self.R_max = max(lim.max_batch_size, self.buckets[-1])
        self.table_stride = -(-lim.max_seq_len // lim.page_size)
        self.in_layout = InputLayout(self.T_max, self.R_max, self.table_stride)
        self.out_layout = OutputLayout(self.R_max)
        self.inp = self.dev.empty((self.in_layout.nbytes,), "uint8")
        self.out = self.dev.empty((self.out_layout.nbytes,), "uint8")
        self.host_in = self.dev.pinned(self.in_layout.nbytes)
        # prepare_ahead packs the next step here while the current one (from host_in) may not be uploaded yet
        self._host_in_spare = self.dev.pinned(self.in_layout.nbytes)
        self.host_out = self.dev.pinned(self.out_layout.nbytes)
        self._alloc_arena()
        self.sampler = DeviceSampler(self.dev, self.sampling, self.R_max, cfg.vocab_size)
        # ---- state: GDN slots (+ sink row), KV pages (+ one sink page for padding rows), sized last: the
        # memory budget (gpu_memory_fraction) is a share of what the weights and static buffers leave free
        self.state_layout = StateLayout.for_model(cfg, lim.num_state_slots)
        # GDN reads u from the float32 projection and writes its core output in float32; the fused decode pair
        # writes the gated norm's o in the bundle dtype (what out_proj reads). The chunked prefill's build follows
        # the bundle: float32 SIMT for float32; for bfloat16 the state pass on bf16 tensor cores (operands in the
        # bundle's own precision; the delta rule 1.36x the tf32 build's speed at one 8192-token prompt); tf32 for
        # float16 (bf16 operands would be coarser than the bundle)
        gdn_precision = {"float32": "fp32", "bfloat16": "bf16"}.get(self.dtype, "tf32")
        self.gdn_k = (CudaGdn(self.dev, self.state_layout, cfg.linear_num_key_heads, act_dtype="float32",
                              precision=gdn_precision, out_dtype=self.dtype)
                      if cfg.linear_layers else None)
        # Decode steps run a GDN layer's gdn_gates + conv + delta rule + gated_rmsnorm as two kernels
        # (gdn_conv_gates_decode, gdn_decode_norm: cuda/gdn.py) where the head shape has them (dk, dv <= 128);
        # False: the four launches (benchmarks compare). Prefill is the same either way. The effective value:
        self.fused_gdn_decode = bool(fused_gdn_decode and self.gdn_k is not None and self.gdn_k.fused_decode_ok)
        if fused_gdn_decode and self.gdn_k is not None and not self.fused_gdn_decode:
            log.info("GDN decode runs four launches per layer: no fused kernel for dk=%d, dv=%d", self.gdn_k.dk,
                     self.gdn_k.dv)
        # the chunked delta rule's workspace (w, u, Aqk, scales of a step's tokens), one for every GDN layer,
        # a static buffer: allocated before the memory plan shares out what is left
        self.gdn_ws = (self.dev.empty((self.gdn_k.workspace_bytes(self.T_max, self.R_max),), "uint8")
                       if self.gdn_k is not None and self.gdn_k.chunk_module is not None else None)
        kv_np = np.float32 if self.dtype == "float32" else np.float16  # itemsize only (bf16 has no numpy type)
        nattn = max(1, len(cfg.attention_layers))
        one_page = KVLayout(1, lim.page_size, cfg.num_kv_heads, max(1, cfg.head_dim), kv_np, nattn).bytes_per_page
        wanted = num_kv_pages or lim.num_kv_pages
        self.memory_plan: MemoryPlan | None = None
        if gpu_memory_fraction:
            free, total = self.dev.mem_info()
            state_bytes = len(cfg.linear_layers) * self.state_layout.total_bytes
            page_bytes = one_page if cfg.attention_layers else 0
            min_pages = -(-lim.max_seq_len // lim.page_size) if cfg.attention_layers else 0
            # the sink page comes out of the same budget: plan for one page more, allocate the plan's pages
            self.memory_plan = plan_memory(free, total, fraction=gpu_memory_fraction, state_bytes=state_bytes,
                                           page_bytes=page_bytes, pages_wanted=wanted + 1, min_pages=min_pages + 1)
            wanted = self.memory_plan.pages - 1
            log.info("%s", self.memory_plan.describe())
            if self.memory_plan.capped:
                log.warning("KV pool capped to %d pages by gpu_memory_fraction=%g (%d asked for): requests that "
                            "need more pages than are free wait for them", wanted, gpu_memory_fraction,
                            self.memory_plan.pages_wanted - 1)
        self.num_pages = wanted
        self.sink_page = self.num_pages
        self.state = DeviceStateCache(self.dev, self.state_layout, cfg.linear_layers)
        self.kv_layout = KVLayout(self.num_pages, lim.page_size, cfg.num_kv_heads, max(1, cfg.head_dim), kv_np, nattn)
        self.kv = None
        if cfg.attention_layers:
            pool = KVLayout(self.num_pages + 1, lim.page_size, cfg.num_kv_heads, cfg.head_dim, kv_np, nattn)
            self.kv = DeviceKVCache(self.dev, pool, cfg.attention_layers, dtype=self.dtype)
        group = cfg.num_heads // max(1, cfg.num_kv_heads)
        prepare = [(self.dtype, cfg.head_dim, group)] if cfg.attention_layers else []
        # the batch-invariant split's partials at the largest batch: max_batch x Hq x SEQ_CHUNKS x (hd + 2) floats
        ws = max(64 << 20, lim.max_batch_size * cfg.num_heads * SEQ_CHUNKS * (cfg.head_dim + 2) * 4)
        self.attn = CudaDecodeAttention(self.dev, optin=True, prepare=prepare, workspace_bytes=ws)
        # Prefill attention: the causal tensor-core kernel over the paged pool (bf16/fp16 bundles whose shapes it
        # takes); None: every prefill query runs as a decode-kernel query over its prefix (float32 bundles)
        self.prefill_attn: CudaPrefillAttention | None = None
        if cfg.attention_layers:
            try:
                plan_prefill([1], [0], num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                             head_dim=cfg.head_dim, dtype=self.dtype, page_size=lim.page_size,
                             limits=self.dev.limits)
                self.prefill_attn = CudaPrefillAttention(self.dev, self.dtype, cfg.head_dim, group)
            except PrefillAttentionError as e:
                log.info("prefill attention runs as per-token decode-kernel queries: %s", e)
        self.dispatcher = self.attn.dispatcher(multi_block_mode)  # type: ignore[arg-type]
        # decode attention split by each sequence's own length: its output bits never depend on the batch
        self.dispatcher.batch_invariant = batch_invariant_attention
        self.programs = [(p, segment_program(cfg, p)) for p in plan_segments(cfg)]
        self.graphs: dict[tuple[int, int], CudaGraph] = {}
        self.graph_stats = GraphStats()
        self.graphs_on = False
        self._profile: list[tuple[str, Any, Any]] | None = None
        self.timings: Counter[str] = Counter()
        self.ops = self  # the state owner the scheduler and tests talk to
        self.load_seconds = time.perf_counter() - t0
        log.info("cuda backend on %s: %s weights %.2f GB, KV pool %d pages (+1 sink) x %d tokens (%s), %d state "
                 "slots, arena %.1f MB, loaded in %.1f s", self.dev.limits.name, self.dtype, self.w.nbytes / 1e9,
                 self.num_pages, lim.page_size, self.dtype, lim.num_state_slots, self.arena_bytes / 1e6,
                 self.load_seconds)

    # ------------------------------------------------------------------ load hooks (cuda/trt_backend.py overrides)

    def _runtime_dtype(self, manifest: Manifest) -> str:
        """The dtype the kernels run in: a cuda bundle's own."""
        if manifest.dtype not in DT_CODES:
            raise BundleError(f"cuda bundle dtype {manifest.dtype!r} is not one of {sorted(DT_CODES)}")
        return manifest.dtype

    def _load_weights(self, bundle_dir: str | Path, manifest: Manifest, progress: Callable[[str], None] | None,
                      keep_packed: bool, packed_linears: bool, packed_experts: bool = False,
                      prefill_zeros: bool = True, dual_linears: bool = False) -> DeviceWeights:
        """The bundle's weights on the device (a cuda bundle: every runtime weight, DeviceWeights.load)."""
        return DeviceWeights.load(self.dev, bundle_dir, manifest, progress, keep_packed=keep_packed,
                                  packed_linears=packed_linears, packed_experts=packed_experts,
                                  prefill_zeros=prefill_zeros, dual_linears=dual_linears)

    # ------------------------------------------------------------------ allocation

    def _arena_shapes(self) -> dict[str, tuple[tuple[int, int], str]]:
        """Name -> (shape, dtype) of every activation buffer of the arena (sets ``kk`` / ``ny``, the MoE slots)."""
        cfg, T, R, d = self.cfg, self.T_max, self.R_max, self.dtype
        H = cfg.hidden_size
        widths = [cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads if cfg.linear_layers else 0,
                  (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim if cfg.attention_layers else 0]
        qd = cfg.num_heads * cfg.head_dim if cfg.attention_layers else 0
        inter = max([cfg.intermediate_size if "dense" in cfg.ffn_types else 0,
                     cfg.shared_expert_intermediate_size if "moe" in cfg.ffn_types else 0, 1])
        moe = "moe" in cfg.ffn_types
        self.kk = cfg.num_experts_per_tok + int(moe and 0 < cfg.shared_expert_intermediate_size
                                                == cfg.moe_intermediate_size)
        self.ny = cfg.num_experts_per_tok + int(moe and cfg.shared_expert_intermediate_size > 0)
        e_pad = -(-(cfg.num_experts + 1) // 8) * 8 if moe else 8
        shapes: dict[str, tuple[tuple[int, int], str]] = {
            "x": ((T, H), "float32"), "h": ((T, H), d), "proj": ((T, max([*widths, 1])), "float32"),
            "q": ((T, max(qd, 1)), d), "attn": ((T, max(qd, 1)), "float32"), "o": ((T, max(qd, cfg.value_dim, 1)), d),
            "gdn_x": ((T, max(cfg.conv_dim, 1)), "float32"), "core": ((T, max(cfg.value_dim, 1)), "float32"),
            "g": ((T, max(cfg.linear_num_value_heads, 1)), "float32"),
            "beta": ((T, max(cfg.linear_num_value_heads, 1)), "float32"),
            "gu": ((T, 2 * inter), "float32"), "act": ((T, inter), d),
            "h_out": ((R, H), d), "logits": ((R, cfg.vocab_size), "float32"),
        }
        if moe:
            E_all = cfg.num_experts + 1
            shapes.update({
                "router": ((T, e_pad), "float32"), "pair_w": ((T, self.kk), "float32"),
                "pair_e": ((T, self.kk), "int32"), "pair_list": ((T, self.kk), "int32"),
                "expert_off": ((1, E_all + 1), "int32"), "active": ((1, E_all + 1), "int32"),
                "moe_act": ((T * self.kk, cfg.moe_intermediate_size), d), "y": ((T, self.ny * H), "float32"),
            })
            if self.moe_router is not None:  # the fused router's CTA counter (zeroed below, reset by the kernel)
                shapes["moe_router_ws"] = ((1, ROUTER_WORKSPACE_BYTES // 4), "int32")
            if self.moe_prefill is not None:  # the tensor-core prefill MoE's tile list
                shapes.update({"moe_tiles": ((1, tile_list_words(T * self.kk, E_all)), "int32"),
                               "moe_cta_counts": ((ROUTE_MAX_CTAS, E_all), "int32")})
        return shapes

    def _alloc_arena(self) -> None:
        shapes = self._arena_shapes()
        self.arena = _Arena()
        for name, (shape, dt) in shapes.items():
            self.arena.bufs[name] = self.dev.empty(shape, dt)
        if "moe_router_ws" in self.arena.bufs:
            ws = self.arena.bufs["moe_router_ws"]
            self.dev.memset_d8(ws.ptr, 0, ws.nbytes)
        self.arena_bytes = sum(a.nbytes for a in self.arena.bufs.values())

    # ------------------------------------------------------------------ state owner (scheduler, tests)

    def reset_slot(self, slot: int) -> None:
        """Zero ``slot``'s conv and recurrent state in every GDN layer (stream-ordered before the next step)."""
        self.state.reset(slot)

    def state_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.state.download_layer(layer)

    def kv_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies (float32) of ``layer``'s K and V pools, the allocator's pages only (no sink page)."""
        assert self.kv is not None
        k, v = self.kv.buffers(layer)
        return self.dev.download(k)[:self.num_pages], self.dev.download(v)[:self.num_pages]

    def synchronize(self) -> None:
        self.dev.synchronize()

    @property
    def device_wait(self) -> threading.Event:
        """Set while the engine thread waits for this device (GIL released): see ``CudaDevice.waiting``."""
        return self.dev.waiting

    def to_host(self, t: Any, rows: int | None = None) -> np.ndarray | None:
        """A host float32 copy of a pipeline tensor (tests and debugging only: it synchronises): a
        :class:`Mat`, or a :class:`MoEOut` summed over its slots as the next add does."""
        if t is None:
            return None
        if isinstance(t, MoEOut):
            n = rows or 0
            H = self.cfg.hidden_size
            y = self.dev.download(DeviceArray(t.y, (n, t.ny, H), t.dtype, self.dev.ordinal)).astype(np.float64)
            if t.sg:
                sg = self.dev.download(DeviceArray(t.sg - self.cfg.num_experts * 4, (n, t.sg_stride), "float32",
                                                   self.dev.ordinal))[:, self.cfg.num_experts]
                y[:, -1] *= 1.0 / (1.0 + np.exp(-sg[:, None]))
            return y.sum(1).astype(np.float32)
        m = t if rows is None else t.first(rows)
        full = self.dev.download(DeviceArray(m.ptr, (m.rows, m.ld), m.dtype, self.dev.ordinal)) if m.rows else \
            np.zeros((0, m.ld), np.float32)
        return np.ascontiguousarray(full[:, :m.cols])

    @property
    def profile_switches(self) -> int:
        return 0  # no execution contexts: nothing ever switches

    # ------------------------------------------------------------------ launching

    def _launch(self, name: str, grid: tuple[int, int, int], block: int, args: list[tuple[str, Any]],
                smem: int = 0, module: Any = None) -> None:
        """One guarded launch of a fused kernel, as a programmatic dependent (every kernel of fused.cu waits
        for its predecessor before touching memory), so its launch overlaps the previous kernel's tail."""
        with self._prof(name):
            (module or self.fused).kernel(name).launch(self.dev, grid, (block, 1, 1), smem, args, pdl=True)

    @contextlib.contextmanager
    def _prof(self, name: str) -> Iterator[None]:
        """With profiling on (:meth:`profile_step`), CUDA events around the enclosed launches."""
        if self._profile is None:
            yield
            return
        e0 = self.dev.event()
        self.dev.record(e0)
        yield
        e1 = self.dev.event()
        self.dev.record(e1)
        self._profile.append((name, e0, e1))

    def profile_step(self, ctx: CudaCtx, forward: Callable[[CudaCtx], Any], spin: Callable[[], None] | None = None
                     ) -> dict[str, tuple[int, float]]:
        """One eager run of ``ctx`` with events around every launch: kernel kind -> (launches, seconds).
        ``spin`` queues GPU work first so that the host enqueues the whole step before the GPU reaches it
        (then events time kernels, not host gaps). Debugging and benchmarks only."""
        self._profile = []
        graph, ctx.graph = ctx.graph, None
        try:
            if spin is not None:
                spin()
            self.execute(ctx, forward)
            out: dict[str, list[float]] = {}
            for name, e0, e1 in self._profile:
                out.setdefault(name, []).append(self.dev.elapsed_ms(e0, e1) / 1e3)
            return {k: (len(v), sum(v)) for k, v in out.items()}
        finally:
            self._profile = None
            ctx.graph = graph

    def _gemm(self, x: Mat, weight: DeviceArray | PackedLinear, out: Mat, residual: Mat | None = None,
              bias: DeviceArray | None = None, decode: bool = False) -> None:
        """``out = x @ weight.T (+ bias) (+ residual)`` through cuBLASLt, its algorithm pinned (when
        ``batch_invariant_gemm``) to the one chosen for the largest M of its class — decode steps of <= 16 rows,
        larger decode steps, prefill — so a row's result does not depend on how many rows share the product.
        ``gemv_decode`` uses the fused ``gemv`` kernel for decode steps of <= GEMV_MAX_M rows instead (batch
        invariant by construction, but on the H200 it reads at 1.8-2.8 TB/s where cuBLASLt reaches 1.8-4.1:
        benchmarks/results/gpu_kernel_tune_h200.md).

        A weight kept only packed (:class:`PackedLinear`, a GPTQ bundle's dense linear): decode steps of <=
        NBITS_MAX_ROWS rows run the int4 / int8 decode GEMM on it (``nbits_decode``, batch invariant); any other
        product first dequantises it into ``nbits_scratch`` (the load's kernel: the same bits as a dequantised
        bundle's weight) and continues below on that copy. A dequantised weight with a packed twin
        (``dual_linears``: ``DeviceWeights.packed_decode``): decode steps of <= NBITS_MAX_ROWS rows run the decode
        GEMM on the twin, every other product runs below on the weight itself."""
        op = self._nbits_ops.get(weight.B.ptr if isinstance(weight, PackedLinear) else weight.ptr)
        if op is not None and not isinstance(weight, PackedLinear) and (op.N, op.k_in) != tuple(weight.shape):
            op = None  # another view at a dual weight's address: not the packed twin's product
        if op is not None and decode and x.rows <= NBITS_MAX_ROWS \
                and not nbits_problems(self.dtype, x.rows, x.ld, x.ptr, op):
            assert self.nbits is not None
            self.nbits_calls += 1
            with self._prof("nbits_decode"):
                self.nbits.launch(x.rows, x.ptr, x.ld, op, out.ptr, out.ld, out.dtype == "float32",
                                  residual=residual.ptr if residual is not None else 0,
                                  ldr=residual.ld if residual is not None else 0,
                                  bias=bias.ptr if bias is not None else 0)
            return
        if isinstance(weight, PackedLinear):
            assert self.nbits_deq is not None and self.nbits_scratch is not None
            self.nbits_fallbacks += 1
            with self._prof("nbits_dequant"):
                self.nbits_deq.launch(weight, self.nbits_scratch.ptr, weight.k_in, 0)
            sc = self.nbits_scratch
            weight = DeviceArray(sc.ptr, (weight.N, weight.k_in), self.dtype, sc.device, sc)
        N, K = weight.shape[0], weight.shape[-1]
        vec = 16 // self.es
        if decode and self.gemv_decode and x.rows <= GEMV_MAX_M and K % vec == 0 and x.ld % vec == 0:
            self._launch("gemv", (-(-N // 8), 1, 1), 128,
                         [("ptr", x.ptr), ("i64", x.ld), ("ptr", weight.ptr), ("i32", N), ("i32", K),
                          ("ptr", bias.ptr if bias is not None else 0),
                          ("ptr", residual.ptr if residual is not None else 0),
                          ("i64", residual.ld if residual is not None else 0), ("ptr", out.ptr), ("i64", out.ld),
                          ("i32", int(out.dtype == "float32")), ("i32", x.rows)])
            return
        if (decode and self.dense is not None and x.rows <= DENSE_MAX_ROWS
                and (self.dense_max_bytes is None or N * K * self.es <= self.dense_max_bytes)
                and not dense_problems(self.dtype, x.rows, N, K, x.ld, x.ptr, weight.ptr)):
            # bias float32 whatever the output's dtype; residual float32 (D = C in place when it is out)
            with self._prof("dense_decode"):
                self.dense.launch(x.rows, x.ptr, x.ld, weight.ptr, N, K, out.ptr, out.ld, out.dtype == "float32",
                                  residual=residual.ptr if residual is not None else 0,
                                  ldr=residual.ld if residual is not None else 0,
                                  bias=bias.ptr if bias is not None else 0)
            return
        pin = 0
        if self.batch_invariant_gemm:
            pin = (min(GEMV_MAX_M, self.buckets[-1]) if x.rows <= GEMV_MAX_M else self.buckets[-1]) if decode \
                else self.T_max
        b = None
        if bias is not None:  # cuBLASLt's bias epilogue reads the bias in the output's dtype
            b = bias if out.dtype == "float32" else self._bias_t[bias.ptr]
        with self._prof("cublaslt"):
            self.blas.gemm(x.rows, N, K, x.ptr, weight.ptr, out.ptr, dtype=self.dtype, out_dtype=out.dtype,
                           ldx=x.ld, ldy=out.ld, c=residual.ptr if residual is not None else 0,
                           bias=b.ptr if b is not None else 0, pin_m=pin)

    def _rmsnorm(self, x: Mat, w: DeviceArray | None, h: Mat | None, n: int, *, y: MoEOut | Mat | None = None,
                 x_out: Mat | None = None, rows_ptr: int = 0) -> None:
        """fused.cu's (add +) RMSNorm: ``rmsnorm_rows`` for float32 ``y`` (or none), ``rmsnorm_rows_t`` for slots in
        the bundle dtype (prefill MoE outputs); the block by :func:`norm_block` (speed only, never the bits)."""
        H = self.cfg.hidden_size
        ydt = "float32"
        if isinstance(y, MoEOut):
            yp, ny, sg, sgs, ydt = y.y, y.ny, y.sg, y.sg_stride, y.dtype
        elif y is not None:
            yp, ny, sg, sgs, ydt = y.ptr, 1, 0, 0, y.dtype
        else:
            yp, ny, sg, sgs = 0, 0, 0, 0
        if ydt not in ("float32", self.dtype):
            raise ValueError(f"an add of {ydt} slots in a {self.dtype} bundle")
        threads, kmax = norm_block(H, n)
        module = None
        if kmax != NORM_KMAX:  # rows past 8192 columns: a build holding more groups per thread, loaded once
            mods = self.__dict__.setdefault("_wide_norm", {})
            if kmax not in mods:
                mods[kmax] = load_module("fused.cu", (f"-DDT={DT_CODES[self.dtype]}", f"-DNORM_KMAX={kmax}"),
                                         self.dev.arch)
            module = mods[kmax]
        self._launch("rmsnorm_rows" if ydt == "float32" else "rmsnorm_rows_t", (n, 1, 1), threads,
                     [("ptr", x.ptr), ("ptr", yp), ("i32", ny), ("ptr", sg), ("i64", sgs),
                      ("ptr", w.ptr if w is not None else 0), ("ptr", x_out.ptr if x_out is not None else 0),
                      ("ptr", h.ptr if h is not None else 0), ("ptr", rows_ptr), ("i32", n), ("i32", H),
                      ("f32", self.cfg.rms_norm_eps)], module=module)

    # ------------------------------------------------------------------ prepare (host only)

    def prepare(self, phase: Phase, steps: list[SeqStep], rows: Sequence[SampleRow] | None,
                want_logits: bool) -> CudaCtx:
        """Validate the step and pack its inputs into the pinned upload buffer (no device work)."""
        check_steps(phase, steps)
        cfg, lim = self.cfg, self.lim
        if not steps:
            raise ValueError("an empty batch")
        decode = phase == Phase.DECODE
        B = len(steps)
        if decode:  # one token per sequence (check_steps)
            lens = None
            bounds = self._arange(B + 1)
            n_real = B
            ids = np.fromiter((s.token_ids[0] for s in steps), np.int64, count=B)
        else:
            lens = [len(s.token_ids) for s in steps]
            bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            n_real = int(bounds[-1])
            ids = np.fromiter((t for s in steps for t in s.token_ids), np.int64, count=n_real)
        if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ValueError(f"token id outside the vocabulary 0..{cfg.vocab_size - 1}")
        if decode:
            positions = np.fromiter((s.start_pos for s in steps), np.int64, count=B)
        else:
            positions = np.concatenate([np.arange(s.start_pos, s.start_pos + k) for s, k in zip(steps, lens)])
        if positions.min() < 0 or positions.max() >= lim.max_seq_len:
            raise ValueError(f"positions must lie in 0..{lim.max_seq_len - 1} (max_seq_len)")
        pages, offsets = slot_mapping(steps, positions, bounds, lim.page_size, self.num_pages)
        kv_rows = pages * lim.page_size + offsets
        slots = np.fromiter((s.slot for s in steps), np.int64, count=B)
        if decode:
            bucket = bucket_for(B, self.buckets)
            if bucket is None:
                raise ValueError(f"a decode batch of {B} exceeds max_batch_size={lim.max_batch_size}")
            pad = bucket - B
            n = bucket
            if pad:
                zeros, sink_rows, sink_slots = self._padding(pad)
                ids = np.concatenate([ids, zeros])
                positions = np.concatenate([positions, zeros])
                kv_rows = np.concatenate([kv_rows, sink_rows])
                slots = np.concatenate([slots, sink_slots])
            _check_slots(slots, self.state_layout.rows, n)
            logit_rows = self._arange(n)
            R_real = B
            S = n
        else:
            n = n_real
            if n > self.T_max:
                raise ValueError(f"a prefill step of {n} tokens exceeds max_num_tokens={lim.max_num_tokens}")
            _check_slots(slots, self.state_layout.rows, B)
            if np.unique(slots).size != slots.size:
                raise ValueError(f"prefill sequences need distinct slots, got {slots.tolist()}")
            logit_rows = np.array([int(bounds[i + 1]) - 1 for i, s in enumerate(steps) if s.need_logits], np.int64)
            R_real = len(logit_rows)
            S = B
        R = n if decode else R_real
        if rows is not None and len(rows) != R_real:
            raise ValueError(f"{len(rows)} sampling rows for {R_real} rows that need logits")
        params = rows_params(rows or (), R)
        want_top = any(bool(sr.logprobs) for sr in rows or ())
        # attention: decode = one query per (padded) row; prefill = one query per token over its prefix
        batch: DecodeBatch | None = None
        plan_: LaunchPlan | None = None
        graph = None
        chunk = 0
        attn_lens: list[int]
        attn_layers = cfg.attention_layers
        if decode:
            attn_lens = (positions[:B] + 1).tolist() + [1] * pad
            tables = [np.asarray(s.page_table, np.int64) for s in steps] + [self._sink_table()] * pad
        elif self.prefill_attn is not None and attn_layers:
            # one work item per query tile, one page table per sequence (cuda/prefill_attention.py)
            attn_lens, tables = [], [np.asarray(s.page_table, np.int64) for s in steps]
        else:
            attn_lens, tables = [], []
            for i, s in enumerate(steps):
                t = np.asarray(s.page_table, np.int64)
                tables += [t] * lens[i]  # type: ignore[index]
                attn_lens += range(s.start_pos + 1, s.start_pos + lens[i] + 1)  # type: ignore[index]
        pplan: PrefillPlan | None = None
        packed = None
        padded: tuple[np.ndarray, np.ndarray] | None = None
        if not decode and self.prefill_attn is not None and attn_layers:
            if any(len(t) > self.table_stride for t in tables):
                raise ValueError(f"a page table is longer than max_seq_len / page_size = {self.table_stride} pages")
            pplan = self.prefill_attn.plan(lens, [s.start_pos for s in steps], num_q_heads=cfg.num_heads,
                                           num_kv_heads=cfg.num_kv_heads, page_size=lim.page_size)
            packed = pack_prefill_inputs(pplan, tables, table_stride=self.table_stride)
        elif attn_layers:
            ctx_lens = tuple(attn_lens) if decode else tuple(int(x) for x in attn_lens)  # decode: ints already
            batch = DecodeBatch(ctx_lens, tuple(tables), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, lim.page_size,
                                self.dtype, self.num_pages + 1)
            padded = batch.padded_tables if len(tables) >= VECTOR_MIN else None
            if (any(len(t) > self.table_stride for t in tables) if padded is None
                    else int(padded[1].max()) > self.table_stride):
                raise ValueError(f"a page table is longer than max_seq_len / page_size = {self.table_stride} pages")
        elif any(len(t) > self.table_stride for t in tables):
            raise ValueError(f"a page table is longer than max_seq_len / page_size = {self.table_stride} pages")
        if decode:
            choice = choose(batch, n, self.dispatcher, self._has_graph, self.graphs_on)
            plan_ = choice.plan
            if choice.key is not None:
                graph = self.graphs[choice.key]
                self.graph_stats.replays[choice.key] += 1
            else:
                self.graph_stats.eager[choice.reason] += 1
        elif batch is not None and pplan is None:
            plan_ = self.dispatcher.select(batch)
        if plan_ is not None:
            chunk = plan_.chunk_len
            self.dispatcher.plans[plan_.kernel] += len(attn_layers)
        seq_start = bounds if not decode else self._arange(n + 1)
        inputs = StepInputs(ids, positions, kv_rows, seq_start, slots, logit_rows, params, attn_lens, tables, chunk,
                            attn_packed=packed.host if packed is not None else None,
                            seq_chunks=plan_.seq_chunks if plan_ is not None else None,
                            attn_padded=padded)
        upload = pack(self.in_layout, self.host_in.array, inputs)
        ctx = CudaCtx(phase, n, n_real, S, R, R_real, 1 if lens is None else max(lens), plan_, batch, len(attn_lens),
                      rows, want_logits, upload, graph, want_top, host_in=self.host_in)
        if packed is not None:
            self.prefill_plans += 1
            ctx.prefill, ctx.prefill_stride = pplan, packed.table_stride
            ctx.prefill_tables = self.in_layout.attn + 4 * packed.tables_offset
        return ctx

    def _has_graph(self, key: tuple[int, int]) -> bool:
        return key in self.graphs

    def _arange(self, n: int) -> np.ndarray:
        """A read-only ``np.arange(n)`` (int64), made once per length."""
        memo = self.__dict__.setdefault("_aranges", {})
        a = memo.get(n)
        if a is None:
            a = memo[n] = np.arange(n, dtype=np.int64)
            a.setflags(write=False)
        return a

    def _padding(self, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A decode step's ``pad`` padding rows (read-only, made once per count): token ids and positions 0, the KV
        sink page's first row, the state sink slot."""
        memo = self.__dict__.setdefault("_pads", {})
        p = memo.get(pad)
        if p is None:
            p = (np.zeros(pad, np.int64), np.full(pad, self.sink_page * self.lim.page_size, np.int64),
                 np.full(pad, self.state_layout.sink, np.int64))
            for a in p:
                a.setflags(write=False)
            memo[pad] = p
        return p

    def _sink_table(self) -> np.ndarray:
        """A padding row's page table: the KV sink page (read-only, made once)."""
        t = self.__dict__.get("_sink_tbl")
        if t is None:
            t = self.__dict__["_sink_tbl"] = np.array([self.sink_page])
            t.setflags(write=False)
        return t

    # ------------------------------------------------------------------ the pipeline pieces (device work)

    def _ptr(self, field_offset: int) -> int:
        return self.inp.ptr + field_offset

    def inputs(self, ctx: CudaCtx) -> dict[str, Any]:
        return {}

    def segment(self, index: int, ctx: CudaCtx, env: dict[str, Any]) -> dict[str, Any]:
        plan, program = self.programs[index]
        local = dict(env)
        for op in program:
            self._op(op, ctx, local, plan.exit)
        return {out: local[src] for out, src in output_names(plan, program).items()}

    def _op(self, op: Op, ctx: CudaCtx, env: dict[str, Any], exit_: tuple[str, int]) -> None:
        cfg, a, n, A = self.cfg, op.attrs, ctx.n, self.arena
        decode = ctx.phase == Phase.DECODE
        W: list[Any] = [_linear_weight(self.w, name) if op.kind == "linear" and i == 0 else self.w[name]
                        for i, name in enumerate(op.weights)]
        if op.kind == "embed":
            x = A.mat("x", n)
            self._launch("embed_rows", (n, 1, 1), 256,
                         [("ptr", self._ptr(self.in_layout.ids)), ("ptr", W[0].ptr), ("ptr", x.ptr), ("i32", n),
                          ("i32", cfg.hidden_size)])
            env[op.outputs[0]] = x
        elif op.kind == "rmsnorm":
            h = A.mat("h", n)
            self._rmsnorm(env[op.inputs[0]], W[0], h, n)
            env[op.outputs[0]] = h
        elif op.kind in ("add", "add_rmsnorm"):
            x = env[op.inputs[0]]
            h = A.mat("h", n) if op.kind == "add_rmsnorm" else None
            self._rmsnorm(x, W[0] if W else None, h, n, y=env[op.inputs[1]], x_out=x)
            env[op.outputs[0]] = x
            if h is not None:
                env[op.outputs[1]] = h
        elif op.kind == "linear":
            inp = env[op.inputs[0]]
            bias = W[1] if len(W) > 1 else None
            if len(op.inputs) > 1:  # residual: D = C in place (float32)
                res = env[op.inputs[1]]
                self._gemm(inp, W[0], res, residual=res, bias=bias, decode=decode)
                env[op.outputs[0]] = res
            else:
                name = {"proj": "proj", "gu": "gu"}[op.outputs[0]]
                out = A.mat(name, n, W[0].N if isinstance(W[0], PackedLinear) else W[0].shape[0])
                self._gemm(inp, W[0], out, bias=bias, decode=decode)
                env[op.outputs[0]] = out
        elif op.kind == "gdn_gates":
            p = env[op.inputs[0]]
            C, vd, nv = a["conv_dim"], a["value_dim"], a["nv"]
            g, beta = A.mat("g", n, nv), A.mat("beta", n, nv)
            # fused decode: gdn() computes g and beta into these buffers inside its conv launch (from u's rows,
            # which are p's: u = p.col(0, C)); until then they hold the previous layer's gates
            if not (decode and self.fused_gdn_decode):
                self._launch("gdn_gates", (-(-n * nv // 256), 1, 1), 256,
                             [("ptr", p.ptr), ("i64", p.ld), ("i32", C + vd), ("i32", C + vd + nv),
                              ("ptr", W[0].ptr), ("ptr", W[1].ptr), ("ptr", g.ptr), ("ptr", beta.ptr), ("i32", n),
                              ("i32", nv)])
            env.update(u=p.col(0, C), z=p.col(C, vd), g=g, beta=beta)
        elif op.kind == "attn_qkv":
            p = env[op.inputs[0]]
            H, Hkv, hd, rd = a["num_heads"], a["num_kv_heads"], a["head_dim"], a["rotary_dim"]
            assert self.kv is not None and exit_[0] == "mixer"
            kp, vp = self.kv.buffers(exit_[1])
            q = A.mat("q", n, H * hd, dense=True)
            self._launch("attn_qkv", (n, -(-(H + 2 * Hkv) // 4), 1), 128,
                         [("ptr", p.ptr), ("i64", p.ld), ("ptr", self._ptr(self.in_layout.positions)),
                          ("ptr", W[0].ptr), ("ptr", W[1].ptr), ("ptr", W[2].ptr), ("ptr", W[3].ptr), ("ptr", q.ptr),
                          ("ptr", kp.ptr), ("ptr", vp.ptr), ("ptr", self._ptr(self.in_layout.kv_rows)), ("ptr", 0),
                          ("ptr", 0), ("i32", n), ("i32", H), ("i32", Hkv), ("i32", hd), ("i32", rd),
                          ("f32", a["eps"])])
            env.update(q=q, k=None, v=None, gate=p.col(hd, H * hd))  # k, v: already in the pools
        elif op.kind == "gated_rmsnorm":
            core, z = env[op.inputs[0]], env[op.inputs[1]]
            nv, dv = a["nv"], a["dv"]
            o = A.mat("o", n, nv * dv, dense=True)
            # fused decode: gdn() of this layer (the pipeline piece right before this segment) already wrote o here
            if not (decode and self.fused_gdn_decode):
                self._launch("gated_rmsnorm", (n, -(-nv // 4), 1), 128,
                             [("ptr", core.ptr), ("ptr", z.ptr), ("i64", z.ld), ("ptr", W[0].ptr), ("ptr", o.ptr),
                              ("i32", n), ("i32", nv), ("i32", dv), ("f32", a["eps"])])
            env[op.outputs[0]] = o
        elif op.kind == "sigmoid_mul":
            att, gate = env[op.inputs[0]], env[op.inputs[1]]
            H, hd = cfg.num_heads, cfg.head_dim
            o = A.mat("o", n, H * hd, dense=True)
            self._launch("sigmoid_mul", (n, -(-H * hd // 256), 1), 256,
                         [("ptr", att.ptr), ("ptr", gate.ptr), ("i64", gate.ld), ("i32", hd), ("ptr", o.ptr),
                          ("i32", n), ("i32", H)])
            env[op.outputs[0]] = o
        elif op.kind == "swiglu":
            gu = env[op.inputs[0]]
            inter = a["inter"]
            act = A.mat("act", n, inter, dense=True)
            self._launch("swiglu", (n, -(-inter // 256), 1), 256,
                         [("ptr", gu.ptr), ("i64", gu.ld), ("ptr", act.ptr), ("i32", n), ("i32", inter)])
            env[op.outputs[0]] = act
        else:  # pragma: no cover - Op validates kinds
            raise ValueError(op.kind)

    def gdn(self, layer: int, ctx: CudaCtx, out: dict[str, Any]) -> Mat:
        assert self.gdn_k is not None
        u, g, beta = out["u"], out["g"], out["beta"]
        conv, rec = self.state.conv[layer], self.state.recurrent[layer]
        conv_w = self.w[f"layers.{layer}.linear_attn.conv1d"]
        n, A = ctx.n, self.arena
        core, x = A.mat("core", n, dense=True), A.mat("gdn_x", n, dense=True)
        slots = self._ptr(self.in_layout.slots)
        with self._prof("gdn"):
            if ctx.phase == Phase.DECODE and self.fused_gdn_decode:
                # gdn_gates, conv, delta rule and gated_rmsnorm in two launches: the gates from p = [u | z | b | a]
                # (u = p.col(0, C): its rows are p's), o into the buffer the gated_rmsnorm op hands on (the core is
                # written too, so this piece's output stays the core)
                cfg = self.cfg
                C, vd, nv, dv = cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
                z = out["z"]
                assert u.dtype == z.dtype == "float32" and z.ptr == u.ptr + 4 * C and z.ld == u.ld
                la = f"layers.{layer}.linear_attn."
                o = A.mat("o", n, nv * dv, dense=True)
                self.gdn_k.conv_gates_decode(conv, slots, u.ptr, u.ld, conv_w, x.ptr, n, u.ptr, u.ld, C + vd,
                                             C + vd + nv, self.w[la + "neg_exp_a"].ptr, self.w[la + "dt_bias"].ptr,
                                             g.ptr, beta.ptr)
                self.gdn_k.delta_norm_decode(rec, slots, x.ptr, g.ptr, beta.ptr, z.ptr, z.ld, self.w[la + "norm"].ptr,
                                             cfg.rms_norm_eps, o.ptr, n, core_ptr=core.ptr)
            elif ctx.phase == Phase.DECODE:
                self.gdn_k.conv_decode(conv, slots, u, conv_w, x, n, u_stride=u.ld)  # type: ignore[arg-type]
                self.gdn_k.delta_decode(rec, slots, x, g, beta, core, n)  # type: ignore[arg-type]
            else:
                self.gdn_k.prefill_launch(conv, rec, self._ptr(self.in_layout.seq_start), slots, ctx.S, ctx.max_len,
                                          u.ptr, u.ld, g.ptr, beta.ptr, conv_w, x.ptr, core.ptr,
                                          workspace=self.gdn_ws, n_tokens=self.T_max)
        return core

    def attention(self, layer: int, ctx: CudaCtx, out: dict[str, Any]) -> Mat:
        if ctx.prefill is not None:
            return self._prefill_attention(layer, ctx, out)
        cfg, Q = self.cfg, ctx.queries
        assert self.kv is not None and ctx.plan is not None and ctx.batch is not None
        p = ctx.plan
        # The guard, once more right where the launch is enqueued (or captured): no path skips it.
        if reasons := validate(p, ctx.batch, self.dispatcher.limits, self.dispatcher.workspace_capacity):
            raise AssertionError(f"unvalidated decode-attention plan reached launch: {reasons}")
        q = out["q"]
        H, hd = cfg.num_heads, cfg.head_dim
        qa = DeviceArray(q.ptr, (Q, H, hd), self.dtype, self.dev.ordinal)
        res = self.arena.mat("attn", Q, H * hd, dense=True)
        oa = DeviceArray(res.ptr, (Q, H, hd), "float32", self.dev.ordinal)
        kb, vb = self.kv.buffers(layer)
        base = self.in_layout.attn
        with self._prof("decode_attention"):
            self.attn.launch(p, qa, kb, vb, self._ptr(self.in_layout.tables(Q)), self.table_stride,
                             self._ptr(base), oa, device_chunk=True)
        return res

    def _prefill_attention(self, layer: int, ctx: CudaCtx, out: dict[str, Any]) -> Mat:
        """Causal attention of a prefill step's tokens over their sequences' pages (this chunk's K/V are in the
        pool already: attn_qkv wrote them), the tensor-core kernel; float32 ``[n, Hq*hd]`` into the arena."""
        assert self.kv is not None and self.prefill_attn is not None and ctx.prefill is not None
        H, hd = self.cfg.num_heads, self.cfg.head_dim
        res = self.arena.mat("attn", ctx.n, H * hd, dense=True)
        kb, vb = self.kv.buffers(layer)
        with self._prof("prefill_attention"):
            self.prefill_attn.launch(ctx.prefill, out["q"].ptr, kb.ptr, vb.ptr, self._ptr(ctx.prefill_tables),
                                     ctx.prefill_stride, self._ptr(self.in_layout.attn), res.ptr,
                                     pool_pages=kb.shape[0])
        return res

    def _fused_route(self, n: int, h: Mat, mw: Any, router: Mat, k: int, fold: bool) -> None:
        """Router GEMM + moe_route's routing in one launch (cuda/moe_router.py): logits into ``router`` and the
        pair_* / expert_off / pair_list / active buffers, as the cuBLASLt GEMM + moe_route pair writes them."""
        assert self.moe_router is not None
        A = self.arena
        with self._prof("moe_router_route"):
            self.moe_router.launch(n, h.ptr, h.ld, mw.router, router.ptr, router.ld, self.cfg.num_experts, k,
                                   self.cfg.norm_topk_prob, fold,
                                   RouteBuffers(A.bufs["pair_w"].ptr, A.bufs["pair_e"].ptr, A.bufs["expert_off"].ptr,
                                                A.bufs["pair_list"].ptr, A.bufs["active"].ptr,
                                                A.bufs["moe_router_ws"].ptr))

    def _moe_route(self, n: int, router: Mat, k: int, fold: bool) -> None:
        """fused.cu's one-CTA moe_route over the router logits ``router`` ``[n, e_pad]`` -> the arena's pair_w,
        pair_e, expert_off, pair_list, active."""
        A, cfg = self.arena.bufs, self.cfg
        self._launch("moe_route", (1, 1, 1), 1024,
                     [("ptr", router.ptr), ("i32", router.ld), ("i32", n), ("i32", cfg.num_experts), ("i32", k),
                      ("i32", int(cfg.norm_topk_prob)), ("i32", int(fold)), ("ptr", A["pair_w"].ptr),
                      ("ptr", A["pair_e"].ptr), ("ptr", A["expert_off"].ptr), ("ptr", A["pair_list"].ptr),
                      ("ptr", A["active"].ptr)])

    def _moe_buffers(self) -> MoEBuffers:
        """The arena's MoE scratch as the tensor-core kernels take it (cuda/moe_prefill.py MoEBuffers)."""
        A = self.arena.bufs
        tl = A["moe_tiles"]
        return MoEBuffers(A["pair_w"].ptr, A["pair_e"].ptr, A["pair_list"].ptr, A["expert_off"].ptr,
                          A["active"].ptr, tl.ptr, A["moe_cta_counts"].ptr, A["moe_act"].ptr, A["y"].ptr,
                          (tl.size - 4) // 4)

    def moe(self, layer: int, ctx: CudaCtx, h: Mat) -> MoEOut:
        cfg, n, A = self.cfg, ctx.n, self.arena
        mw = self.w.moe(layer)
        H, inter, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        router = A.mat("router", n, mw.e_pad)
        path = moe_path(ctx.phase == Phase.PREFILL, n, self.moe_prefill is not None, self.moe_decode)
        # decode steps of <= 16 rows routed by moe_route: router GEMM + moe_route as one launch (moe_router_route)
        fused_router = (self.moe_router is not None and ctx.phase == Phase.DECODE and n <= ROUTER_MAX_TOKENS
                        and n <= FOLD_MAX_TOKENS and path in ("cuda_cores", "mma_decode"))
        if not fused_router:
            self._gemm(h, mw.router, router, decode=ctx.phase == Phase.DECODE)
        pw, pl = A.bufs["pair_w"], A.bufs["pair_list"]
        off, act_l = A.bufs["expert_off"], A.bufs["active"]
        # The shared expert rides along as expert E (one pair per token) in decode steps of <= 16 rows; with many
        # tokens its CTAs would do a dense GEMM's work alone, so it runs as GEMMs there, and always in prefill
        # (whose token count follows how prompts share steps: the same prompt must take the same path).
        fold = mw.fold and ctx.phase == Phase.DECODE and n <= FOLD_MAX_TOKENS
        moe_act = A.bufs["moe_act"]
        y = A.bufs["y"]
        # Prefill on the tensor cores writes the slots in the bundle dtype (half the bytes of the down GEMM's output
        # and of the add + norm's biggest read: 9 slots x H per token); decode keeps float32 slots
        ydt = self.dtype if (self.moe_slots_lowp and path == "tensor_cores" and ctx.phase == Phase.PREFILL) \
            else "float32"
        if path == "mma_decode":
            # Decode on tensor cores with the weights as the M operand (cuda/moe_decode.py): routing by moe_route
            # (one CTA) for up to FOLD_MAX_TOKENS rows, by the prefill's moe_topk + moe_group (many CTAs; the same
            # bits and buffers) past that; the shared expert folded in as expert E exactly when the CUDA-core path
            # folds it. The same pair_* / expert_off / active / moe_act / y contract as the other paths.
            assert self.moe_prefill is not None  # moe_path gives "mma_decode" only with the tensor-core shapes
            if self.moe_mma_decode is None:
                self.moe_mma_decode = MoEDecode(self.dev, self.dtype)
            mma = self.moe_mma_decode
            if n == 1:  # down's weight stream before its wait for gate_up: 2.90 -> 2.85 ms per batch-1 step on the
                # H200 (40 layers), none at batch 8 (benchmarks/results/gpu_decode_step_notes.md); the same bits
                if self.moe_mma_decode_one is None:
                    self.moe_mma_decode_one = MoEDecode(self.dev, self.dtype, dn_pre=1)
                mma = self.moe_mma_decode_one
            elif n > FOLD_MAX_TOKENS:  # 64 weight rows per gate_up CTA (KNOB_SETS["many"]): 8% faster at 64 rows
                # on the H200 (benchmarks/results/gpu_moe_decode_h200.md); the same bits as every build
                if self.moe_mma_decode_many is None:
                    self.moe_mma_decode_many = MoEDecode(self.dev, self.dtype, **asdict(MOE_DECODE_KNOB_SETS["many"]))
                mma = self.moe_mma_decode_many
            kk, e_all = k + int(fold), cfg.num_experts + int(fold)
            bufs = self._moe_buffers()
            if n > FOLD_MAX_TOKENS:
                with self._prof("moe_route_many"):
                    self.moe_prefill.route(n, router.ptr, router.ld, cfg.num_experts, k, cfg.norm_topk_prob, bufs,
                                           fold_shared=fold)
            elif fused_router:
                self._fused_route(n, h, mw, router, k, fold)
            else:
                self._moe_route(n, router, k, fold)
            pk = getattr(self.w, "packed_moe", {}).get(layer)  # (host fakes of the weights have none)
            if pk is not None:  # the experts kept only packed (packed_experts): moe_nbits_table's build
                build = moe_nbits_build(pk.gate_up.bits, n, self.moe_nbits_table,  # type: ignore[attr-defined]
                                        (pk.gate_up.block_size, pk.down.block_size))  # type: ignore[attr-defined]
                if build not in self.moe_nbits:
                    self.moe_nbits[build] = MoENBitsDecode(self.dev, self.dtype, MOE_NBITS_KNOB_SETS[build])
                self.moe_nbits_calls += 1
                with self._prof("moe_nbits_decode"):
                    self.moe_nbits[build].launch(n, h.ptr, h.ld, pk.gate_up, pk.down, H, inter, kk,  # type: ignore
                                                 self.ny, e_all, bufs)
            else:
                with self._prof("moe_mma_decode"):
                    mma.launch(n, h.ptr, h.ld, mw.gate_up.ptr, mw.down.ptr, H, inter, kk, self.ny, e_all, bufs)
        elif path == "tensor_cores":
            assert self.moe_prefill is not None
            # Tensor cores for every prefill step whatever its token count (a prompt takes the same path alone
            # or batched) and for the decode steps moe_path gives them: routing + tile list on the device, two
            # grouped GEMMs (cuda/moe_prefill.py); the same pair_* / expert_off / active / moe_act / y contract as
            # below, the shared expert folded in as expert E exactly when the CUDA-core path would fold it.
            bufs = self._moe_buffers()
            pk = getattr(self.w, "packed_moe", {}).get(layer)
            if (pk is not None and self.packed_moe_prefill and n <= PACKED_MAX_TOKENS.get(pk.sources[0].bits, 0)
                    and self._packed_prefill_ok(layer, pk, fold)):
                # packed experts on the packed grouped GEMMs: each weight tile dequantised in shared memory (the bits
                # of the dequantised stack below, without writing it)
                self.moe_packed_prefill_calls += 1
                with self._prof("moe_prefill_packed"):
                    self.moe_prefill.route(n, router.ptr, router.ld, cfg.num_experts, k, cfg.norm_topk_prob, bufs,
                                           fold_shared=fold)
                    self.moe_prefill.experts_packed(n, h.ptr, h.ld, *pk.sources, H, inter, k + int(fold), self.ny,
                                                    cfg.num_experts + int(fold), bufs, y_dtype=ydt, zeros=pk.zeros)
            else:
                if pk is not None:  # packed experts: into the scratch stack mw points at
                    self.w.dequantise_experts(layer)
                with self._prof("moe_prefill" if ctx.phase == Phase.PREFILL else "moe_tensor_cores"):
                    self.moe_prefill.launch(n, router.ptr, router.ld, mw, h.ptr, h.ld, k, cfg.norm_topk_prob,
                                            self.ny, bufs, fold_shared=fold, y_dtype=ydt)
        else:  # decode (weight-read bound), float32 bundles, shapes the tiles do not divide: CUDA cores
            if fused_router:
                self._fused_route(n, h, mw, router, k, fold)
            else:
                self._moe_route(n, router, k, fold)
            kk = k + int(fold)
            e_all = cfg.num_experts + int(fold)
            if getattr(self.w, "packed_moe", None):  # packed experts: into the scratch stack mw points at
                self.w.dequantise_experts(layer)
            ny_grid = min(e_all, n * kk)  # at most this many experts have pairs: CTAs past it would only exit
            tg = max(1, min(8, SMEM_DEFAULT // (H * self.es)))
            tg_d = max(1, min(8, SMEM_DEFAULT // (inter * self.es)))
            self._launch("moe_gate_up", (-(-inter // MOE_ROWS_PER_CTA), ny_grid, 1), 256,
                         [("ptr", h.ptr), ("ptr", mw.gate_up.ptr), ("i32", H), ("i32", inter), ("i32", kk),
                          ("i32", e_all), ("ptr", off.ptr), ("ptr", pl.ptr), ("ptr", act_l.ptr),
                          ("ptr", moe_act.ptr), ("i32", tg)], smem=tg * H * self.es)
            self._launch("moe_down", (-(-H // MOE_ROWS_PER_CTA), ny_grid, 1), 256,
                         [("ptr", moe_act.ptr), ("ptr", mw.down.ptr), ("ptr", pw.ptr), ("i32", H), ("i32", inter),
                          ("i32", kk), ("i32", self.ny), ("i32", e_all), ("ptr", off.ptr), ("ptr", pl.ptr),
                          ("ptr", act_l.ptr), ("ptr", y.ptr), ("i32", tg_d)], smem=tg_d * inter * self.es)
        if mw.fold and not fold and mw.shared_gate_up is None:  # the folded shared expert run as two GEMMs on its
            # slices of the stacks (a packed-experts layer keeps its own dequantised copy: mw.shared_gate_up)
            sgu = DeviceArray(mw.gate_up.row_ptr(cfg.num_experts), (2 * inter, H), self.dtype, self.dev.ordinal)
            sdn = DeviceArray(mw.down.row_ptr(cfg.num_experts), (H, inter), self.dtype, self.dev.ordinal)
        else:
            sgu, sdn = mw.shared_gate_up, mw.shared_down
        if not fold and sgu is not None:  # a shared expert as GEMMs into the last slot, gated in the next add
            assert sdn is not None
            si = sgu.shape[0] // 2
            gu, act = A.mat("gu", n, 2 * si), A.mat("act", n, si, dense=True)
            self._gemm(h, sgu, gu, decode=ctx.phase == Phase.DECODE)
            self._launch("swiglu", (n, -(-si // 256), 1), 256,
                         [("ptr", gu.ptr), ("i64", gu.ld), ("ptr", act.ptr), ("i32", n), ("i32", si)])
            slot = Mat(y.ptr + k * H * ITEMSIZE[ydt], n, H, self.ny * H, ydt)  # cuBLASLt rounds to ydt once
            self._gemm(act, sdn, slot, decode=ctx.phase == Phase.DECODE)
            return MoEOut(y.ptr, self.ny, router.ptr + cfg.num_experts * 4, router.ld, dtype=ydt)
        return MoEOut(y.ptr, self.ny, dtype=ydt)

    def _packed_prefill_ok(self, layer: int, pk: Any, fold: bool) -> bool:
        """Whether layer ``layer``'s packed experts run on the packed grouped GEMMs (asked once per layer and fold;
        a refusal is logged once with its reasons)."""
        memo = self.__dict__.setdefault("_packed_prefill_memo", {})
        key = (layer, fold)
        if key not in memo:
            assert self.moe_prefill is not None
            cfg = self.cfg
            bad = self.moe_prefill.packed_problems(*pk.sources, cfg.hidden_size, cfg.moe_intermediate_size,
                                                   cfg.num_experts + int(fold), pk.zeros)
            if bad:
                log.info("layer %d: packed experts are dequantised before each prefill step: %s", layer, "; ".join(bad))
            memo[key] = not bad
        return memo[key]

    def head(self, ctx: CudaCtx, x: Mat) -> Mat | None:
        if ctx.R == 0:
            return None
        h = self.arena.mat("h_out", ctx.R)
        self._rmsnorm(x, self.w["final_norm"], h, ctx.R, rows_ptr=self._ptr(self.in_layout.logit_rows))
        logits = self.arena.mat("logits", ctx.R)
        self._gemm(h, _linear_weight(self.w, "lm_head"), logits, decode=ctx.phase == Phase.DECODE)
        return logits

    def _sample(self, ctx: CudaCtx, logits: Mat | None) -> None:
        if logits is None or ctx.rows is None:
            return
        o, L = self.out.ptr, self.out_layout
        self.sampler.launch(ctx.R, logits.ptr, logits.ld, self._ptr(self.in_layout.sample_params), o + L.tokens,
                            o + L.logprobs, o + L.top_ids, o + L.top_logprobs)

    # ------------------------------------------------------------------ one step

    def _fill_random(self, a: DeviceArray, seed: int, scale: float, offset: float = 0.0) -> None:
        fill_random(self.dev, self.fused, a, seed, scale, offset)

    def inject_fault(self, kind: str) -> None:
        """Test-only: make the next step fail. "sticky": a kernel writes to an illegal address before the
        step (CUDA_ERROR_ILLEGAL_ADDRESS poisons the context: the step raises :class:`DeviceLost`, and so
        does every later one); "launch": a launch the driver refuses (too many threads per block; the
        context stays usable, only that step fails)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r}: one of {FAULT_KINDS}")
        self._fault = kind

    def _inject(self, kind: str) -> None:
        k = self.fused.kernel("fill_f32")
        if kind == "sticky":  # an unmapped address in the first page: never a valid allocation
            k.launch(self.dev, (1, 1, 1), (32, 1, 1), 0, [("ptr", 0x100), ("f32", 1.0), ("i64", 1 << 20)])
        else:  # 2048 threads per block: past every GPU's limit, so the driver refuses it (not the guard)
            code = k.launch_unchecked(self.dev, (1, 1, 1), (2048, 1, 1), 0,
                                      [("ptr", 0), ("f32", 0.0), ("i64", 0)])
            from .driver import error_name

            raise CudaError("cuLaunchKernelEx(fill_f32, injected)", code, error_name(code))

    def device_health(self) -> CudaError | None:
        """None while the device works; the sticky error that poisoned its context otherwise."""
        return self.dev.health()

    # Async scheduling (serving.py): the next decode step is prepared while this one runs, launched once its
    # token ids are known (patch_ids), or thrown away (abandon).
    supports_ahead = True

    def prepare_ahead(self, phase: Phase, steps: list[SeqStep], rows: Sequence[SampleRow] | None) -> CudaCtx:
        """:meth:`prepare` of the step after the one in flight, whose token ids are placeholders: packed into the
        other pinned input buffer (the step in flight may not have been uploaded yet), with the metric counters it
        touches remembered so that :meth:`abandon` can take its counts back."""
        counters = (self.graph_stats.replays.copy(), self.graph_stats.eager.copy(), self.dispatcher.plans.copy(),
                    self.dispatcher.fallbacks.copy(), self.dispatcher.errors.copy())
        self.host_in, self._host_in_spare = self._host_in_spare, self.host_in
        ctx = self.prepare(phase, steps, rows, False)
        ctx.counters = counters
        return ctx

    def patch_ids(self, ctx: CudaCtx, ids: np.ndarray) -> None:
        """Write the decode step's token ids (``[n_real]``, one per sequence, in step order) over the placeholders
        :meth:`prepare_ahead` packed. ValueError for a count or id :meth:`prepare` would have refused."""
        if ctx.phase != Phase.DECODE or ctx.launched or len(ids) != ctx.n_real:
            raise ValueError(f"patch_ids: {len(ids)} ids for a {ctx.phase.name} step of {ctx.n_real} sequences"
                             f"{' (already launched)' if ctx.launched else ''}")
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            raise ValueError(f"token id outside the vocabulary 0..{self.cfg.vocab_size - 1}")
        L = self.in_layout
        ctx.host_in.array.view(np.uint8)[L.ids:L.ids + 4 * len(ids)].view(np.int32)[:] = ids

    def abandon(self, ctx: CudaCtx) -> None:
        """Forget a step :meth:`prepare_ahead` made and nobody launched: its metric counts are taken back."""
        if ctx.launched or ctx.counters is None:
            return
        g, d = self.graph_stats, self.dispatcher
        g.replays, g.eager, d.plans, d.fallbacks, d.errors = ctx.counters
        ctx.counters = None

    def execute(self, ctx: CudaCtx, forward: Callable[[CudaCtx], Any]) -> StepResult:
        """:meth:`launch`, then :meth:`finish`."""
        self.launch(ctx, forward)
        return self.finish(ctx)

    def launch(self, ctx: CudaCtx, forward: Callable[[CudaCtx], Any]) -> None:
        """Enqueue the step: the upload, the graph replay (or the eager kernels and the sampler), the download of
        the sampled ids. Returns without waiting for the device (:meth:`finish` waits)."""
        self._guarded(self._launch_step, ctx, forward)

    def finish(self, ctx: CudaCtx) -> StepResult:
        """Wait for a launched step and unpack its sampled ids (and logprobs, logits)."""
        return self._guarded(self._finish_step, ctx)

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except DeviceLost:
            raise
        except Exception as e:
            # A sticky error (any launch of this step, or an earlier one) shows up here at the latest, at
            # the step's synchronise; after one, nothing on this context works again.
            health = e if is_sticky(e) else self.dev.health()
            if health is not None:
                raise DeviceLost(f"{self.device} is lost: {e}", health) from e
            raise

    def _upload(self, ctx: CudaCtx) -> None:
        """The step's one host-to-device copy: the packed inputs (pinned) to the input region."""
        host = ctx.host_in if ctx.host_in is not None else self.host_in
        self.dev.copy_htod(self.inp.ptr, host.array[:ctx.upload_bytes])

    def _launch_step(self, ctx: CudaCtx, forward: Callable[[CudaCtx], Any]) -> None:
        dev = self.dev
        ctx.launched, ctx.counters = True, None
        if self._fault is not None:
            fault, self._fault = self._fault, None
            self._inject(fault)
        ctx.t0 = time.perf_counter()
        self._upload(ctx)
        if ctx.graph is not None:
            ctx.graph.launch()
            logits = self.arena.mat("logits", ctx.R)
        else:
            logits = forward(ctx)
            self._sample(ctx, logits)
        if ctx.rows is not None and ctx.R:
            dev.copy_dtoh(self.host_out.ptr, self.out.ptr, self.out_layout.used(ctx.R, ctx.want_top))
        if ctx.want_logits:
            ctx.host_logits = np.empty((ctx.R_real, self.cfg.vocab_size), np.float32)
            if ctx.R_real:
                assert logits is not None
                dev.copy_dtoh(ctx.host_logits.ctypes.data, logits.ptr, ctx.host_logits.nbytes)

    def _finish_step(self, ctx: CudaCtx) -> StepResult:
        self.dev.synchronize()
        self.timings["step"] += time.perf_counter() - ctx.t0
        host_logits, ctx.host_logits = ctx.host_logits, None
        if ctx.rows is None or ctx.R == 0:
            return StepResult(np.zeros(0, np.int64), [None] * len(ctx.rows or ()), host_logits)
        tok, lp, ti, tl = self.out_layout.unpack(self.host_out.array, ctx.R)
        lps: list[TokenLogprobs | None] = []
        for r, sr in enumerate(ctx.rows):
            if sr.logprobs is None:
                lps.append(None)
                continue
            m = min(int(sr.logprobs), MAX_TOP_LOGPROBS)
            top = tuple((int(ti[r, j]), float(tl[r, j])) for j in range(m) if ti[r, j] >= 0)
            lps.append(TokenLogprobs(float(lp[r]), top))
        return StepResult(tok[:ctx.R_real].astype(np.int64), lps, host_logits)

    # ------------------------------------------------------------------ graphs

    def _template(self, bucket: int, blocks: int) -> CudaCtx | None:
        """A decode step of ``bucket`` padding rows whose attention plan is class ``blocks``, for warm-up and
        capture; None (counted) when the guard refuses the class plan on this device."""
        from ..ops.dispatcher import fixed_grid_plan, sequence_plan

        cfg, lim = self.cfg, self.lim
        plan_ = None
        batch = None
        if cfg.attention_layers:
            seq = self.dispatcher.batch_invariant and self.dispatcher.mode != "off"
            L = min(lim.max_seq_len, 64 if seq else max(1, blocks * 64))
            tbl = np.full(-(-L // lim.page_size), self.sink_page, np.int64)
            batch = DecodeBatch(tuple([L] * bucket), tuple([tbl] * bucket), cfg.num_heads, cfg.num_kv_heads,
                                cfg.head_dim, lim.page_size, self.dtype, self.num_pages + 1)
            plan_ = (sequence_plan(batch, self.dispatcher.limits, blocks) if seq
                     else fixed_grid_plan(batch, blocks, self.dispatcher.limits))
            if reasons := validate(plan_, batch, self.dispatcher.limits, self.dispatcher.workspace_capacity):
                for r in reasons:
                    self.graph_stats.refused[r] += 1
                log.warning("decode graph b%d x%d not captured: the guard refused its plan (%s)", bucket, blocks,
                            ", ".join(reasons))
                return None
            attn_lens, tables = [L] * bucket, [tbl] * bucket
        else:
            attn_lens, tables = [1] * bucket, [np.array([0])] * bucket
        sink = self.state_layout.sink
        params = np.zeros((bucket, ROW_WORDS), np.int32)
        params[:, 0], params[:, 7] = 1, -1
        rows = [SampleRow(SamplingParams())] * bucket
        inputs = StepInputs(np.zeros(bucket, np.int64), np.zeros(bucket, np.int64),
                            np.full(bucket, self.sink_page * lim.page_size, np.int64), np.arange(bucket + 1),
                            np.full(bucket, sink, np.int64), np.arange(bucket), params, attn_lens, tables,
                            plan_.chunk_len if plan_ is not None else 0,
                            seq_chunks=plan_.seq_chunks if plan_ is not None else None)
        upload = pack(self.in_layout, self.host_in.array, inputs)
        return CudaCtx(Phase.DECODE, bucket, bucket, bucket, bucket, bucket, 1, plan_, batch, bucket, rows, False,
                       upload)

    def dense_decode_shapes(self) -> dict[tuple[int, int], list[int]]:
        """(N, K) -> weight pointers of every decode GEMM the dense kernel takes (the segments' linear ops and
        lm_head; within dense_decode_max_mb), but those with a packed form the int4 / int8 decode GEMM reads."""
        shapes: dict[tuple[int, int], list[int]] = {}
        for _, program in self.programs:
            for op in program:
                if op.kind != "linear":
                    continue
                w = _linear_weight(self.w, op.weights[0])
                if not isinstance(w, PackedLinear) and w.ptr not in self._nbits_ops:  # (packed ones: nbits_decode)
                    N, K = w.shape[0], w.shape[-1]
                    if self.dense_max_bytes is None or N * K * self.es <= self.dense_max_bytes:
                        shapes.setdefault((N, K), []).append(w.ptr)
        return shapes

    def tune_dense_decode(self) -> None:
        """Time the dense decode GEMM's builds on this model's decode shapes at 1 and max-batch rows (<= 16) and
        keep the fastest per shape (DenseDecode.tune; the builds differ in loads in flight and rows per CTA, not
        in results). Logged; the choice is :attr:`DenseDecode.choice`."""
        assert self.dense is not None
        shapes = {k: v for k, v in self.dense_decode_shapes().items()
                  if not dense_problems(self.dtype, 1, k[0], k[1], -(-k[1] // 8) * 8)}
        if not shapes:
            return
        t0 = time.perf_counter()
        ldx = max(-(-K // 8) * 8 for _, K in shapes)
        x = self.dev.zeros((DENSE_MAX_ROWS, ldx), self.dtype)
        out = self.dev.empty((DENSE_MAX_ROWS, max(N for N, _ in shapes)), "float32")
        rows = sorted({1, min(DENSE_MAX_ROWS, max(self.buckets))})
        times = self.dense.tune(shapes, x.ptr, ldx, out.ptr, rows=rows)
        self.dev.synchronize()
        del x, out
        names = {kn: name for name, kn in DENSE_KNOB_SETS.items()}
        for (N, K), t in times.items():
            kn = self.dense.choice[(N, K)]
            log.info("decode GEMM %dx%d (%d weights): dense_decode build %s, %.1f us per call (default %.1f)", N, K,
                     len(shapes[(N, K)]), names.get(kn, kn), t[kn] * 1e6, t[self.dense.knobs] * 1e6)
        self.dense_tune_seconds = time.perf_counter() - t0

    def tune_nbits_decode(self) -> None:
        """Time the int4 / int8 decode GEMM's builds on this model's packed linears at 1 and max-batch rows
        (<= 16) and keep the fastest per (N, K, bits) (NBitsDecode.tune; the candidates differ in loads in flight,
        rows per CTA and when activations are loaded, not in results). Logged; the choice is
        :attr:`NBitsDecode.choice`."""
        assert self.nbits is not None
        shapes: dict[tuple[int, int, int], list[NBitsOperand]] = {}
        for op in self._nbits_ops.values():
            shapes.setdefault((op.N, op.K, op.bits), []).append(op)
        if not shapes:
            return
        t0 = time.perf_counter()
        ldx = max(-(-op.k_in // 8) * 8 for ops in shapes.values() for op in ops)
        shapes = {k: v for k, v in shapes.items() if not nbits_problems(self.dtype, 1, ldx, 0, v[0])}
        if not shapes:
            return
        x = self.dev.zeros((NBITS_MAX_ROWS, ldx), self.dtype)
        out = self.dev.empty((NBITS_MAX_ROWS, max(N for N, _, _ in shapes)), "float32")
        rows = sorted({1, min(NBITS_MAX_ROWS, max(self.buckets))})
        times = self.nbits.tune(shapes, x.ptr, ldx, out.ptr, rows=rows)
        self.dev.synchronize()
        del x, out
        for (N, K, bits), t in times.items():
            kn = self.nbits.choice[(N, K, bits)]
            log.info("packed decode GEMM %dx%d int%d (%d weights): nbits_decode build %s, %.1f us per call (default "
                     "%.1f)", N, K, bits, len(shapes[(N, K, bits)]), nbits_build_name(kn), t[kn] * 1e6,
                     t[self.nbits.knobs] * 1e6)
        self.nbits_tune_seconds = time.perf_counter() - t0

    def capture_graphs(self, forward: Callable[[CudaCtx], Any], buckets: Sequence[int] | None = None) -> None:
        """Warm up and capture one graph per (bucket, plan class), largest bucket first (``buckets``: only these;
        default all). A class whose plan the guard refuses, or whose capture fails, is left out (its steps run
        eagerly, counted)."""
        t0 = time.perf_counter()
        free0 = self.dev.mem_info()[0]
        cfg, lim = self.cfg, self.lim
        if self.dense is not None and len(self.dense.modules) > 1 and not self.dense.choice:
            try:
                self.tune_dense_decode()
            except Exception as e:  # a timing run is an optimisation: the default build serves without it
                self.dense.choice.clear()
                log.warning("dense decode GEMM build timing failed, every shape keeps the default build: %s", e)
        if self.nbits is not None and len(self.nbits.builds) > 1 and not self.nbits.choice:
            try:
                self.tune_nbits_decode()
            except Exception as e:  # as above: the default build serves without it
                self.nbits.choice.clear()
                log.warning("int4 / int8 decode GEMM build timing failed, every shape keeps the default build: %s", e)
        for bucket in reversed([b for b in self.buckets if buckets is None or b in buckets]):
            if cfg.attention_layers:
                L = lim.max_seq_len
                tbl = np.full(-(-L // lim.page_size), self.sink_page, np.int64)
                at_max = DecodeBatch(tuple([L] * bucket), tuple([tbl] * bucket), cfg.num_heads, cfg.num_kv_heads,
                                     cfg.head_dim, lim.page_size, self.dtype, self.num_pages + 1)
                classes = class_blocks(self.dispatcher, at_max)
            else:
                classes = [1]
            for blocks in classes:
                ctx = self._template(bucket, blocks)
                if ctx is None:
                    continue

                def body(ctx: CudaCtx = ctx) -> None:
                    self._sample(ctx, forward(ctx))

                self.execute(ctx, forward)  # warm-up, eager: loads kernels, plans GEMMs, checks every launch
                try:
                    g = CudaGraph(self.dev, body)
                except Exception as e:  # the launch guard (LaunchRejected) or the driver refused: stay eager
                    self.graph_stats.refused[type(e).__name__] += 1
                    log.warning("decode graph b%d x%d not captured: %s", bucket, blocks, e)
                    continue
                self.graphs[(bucket, blocks)] = g
                self.graph_stats.captured[(bucket, blocks)] = g.num_nodes
        self.dev.synchronize()
        self.graphs_on = True
        self.capture_seconds = time.perf_counter() - t0
        # what warm-up and capture took from the device (graph nodes, cuBLASLt plans and workspaces): it
        # comes out of the reserve of the memory plan (cuda/memory.py DEFAULT_RESERVE_BYTES)
        self.capture_bytes = free0 - self.dev.mem_info()[0]
        log.info("captured %d decode graphs (buckets %s) in %.2f s, %.0f MiB of device memory", len(self.graphs),
                 self.buckets, self.capture_seconds, self.capture_bytes / 2**20)
