"""Gated DeltaNet stateful operators on the GPU (the twins of :mod:`hybrid_runtime.ops.gdn`).

:class:`CudaGdn` holds the compiled kernels of one layer shape on one device and runs, on that device's
stream, against the buffers of a :class:`~hybrid_runtime.cuda.state.DeviceStateCache` layer:

* :meth:`CudaGdn.decode`: one token for each of B rows: conv window update + causal conv + SiLU, then
  the gated delta rule on the rows' slots (padding rows may name the sink; live slots must be distinct).
* :meth:`CudaGdn.prefill`: several sequences of T_i >= 1 tokens, packed: conv over all tokens in parallel,
  window update, then the delta rule, by one of two paths (``prefill_mode``):

  - ``"chunked"`` (``gdn_chunk.cu``, the default whenever a workspace is given): the WY / UT-transform
    form on 64-token chunks aligned to each sequence's token 0. ``gdn_chunk_prep`` does the intra-chunk
    work of every chunk of every sequence in parallel (grid ``(ceil(max_len/64), nv, S)``), then
    ``gdn_chunk_state`` carries the state from chunk to chunk (grid ``(ceil(dv/cols), nv, S)``, cols 32 or 64, one
    sequential step of small matmuls per chunk) and writes o. Builds (``precision``):
    ``"fp32"`` (default) is float32 SIMT, so float32 bundles keep their CPU parity (the CPU twin is the
    same float32 chunked form); ``"tf32"`` runs the products (K K^T, Q K^T, W S, Q S, Aqk V, K^T V) on
    tensor cores, mma.sync m16n8k8 tf32 with float32 accumulation and a float32 state, ~1e-3 relative to
    float64: for bf16 / fp16 bundles; its prep inverts I + A blockwise (float32 SIMT, 16 x 16 diagonal
    blocks, then off-diagonal blocks) and forms u, w as two tensor-core products with T (the fp32 build and
    ``"tf32_v1"`` run a float32 SIMT forward substitution instead), and its state pass runs 64 value columns
    per CTA (grid ``(ceil(dv/64), nv, S)``: half the W / Q / K reloads of the 32-column CTAs of
    ``"tf32_v2"``, the same numerics). The build is fixed per object; the "tf32" object runs its state pass
    on the 32-column twin for steps too small to fill the GPU (``state_cols_for``: the same bits, so batch
    invariance holds).
  - ``"scan"`` (``gdn_prefill`` in ``gdn.cu``): token by token, state in registers, one CTA per 32
    columns of a value head of a sequence. Used when no workspace is given.

  Selection rule: the mode alone, never the step's composition or lengths. Every sequence of a step takes
  the same path, and the chunked path computes a sequence's 64-token chunks identically whatever else
  shares the step and wherever the backend cut the prompt (cuts are at multiples of 64, the state
  crosses a cut through the float32 slot exactly), so prefill stays batch invariant. A length threshold
  (scan below it) would not: a prompt tail could go through either path depending on where the token
  budget cut the prompt.

* :meth:`CudaGdn.conv_gates_decode` + :meth:`CudaGdn.delta_norm_decode`: the fused decode pair of the ``cuda``
  backend. ``gdn_conv_gates_decode`` is ``gdn_conv_decode`` plus one CTA per row computing the gates
  (``g = neg_exp_a * softplus(a + dt_bias)``, ``beta = sigmoid(b)``: ``fused.cu``'s ``gdn_gates``, the same bits);
  ``gdn_decode_norm`` is ``gdn_decode`` with one CTA per value head of a sequence (``ceil(dv/32)`` groups of 128
  threads, each doing what a ``gdn_decode`` CTA does, so the state bits are the same) followed by
  ``fused.cu``'s ``gated_rmsnorm`` on the head (``o = rmsnorm(core) * w * silu(z)`` in ``out_dtype``). Both are
  launched as programmatic dependents (PDL) and wait for the previous kernel before touching memory. Available
  when :func:`fused_decode_fits` (``dk, dv <= 128``: at most 512 threads per CTA); ``fused_decode_ok`` says.

Inputs: u ``[N, C]`` (float16 / bfloat16 / float32 activations), g and beta ``[N, nv]`` float32, conv_w
``[C, K]`` float32. Output o ``[N, nv*dv]`` in the activation dtype. Slots are checked on the host
(``ops.gdn._check_slots``: in range, live ones distinct) and every launch is validated against the
device limits before it reaches the driver (:meth:`Kernel.launch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..ops.gdn import _check_slots
from ..state_cache import StateLayout
from .driver import CudaDevice, DeviceArray
from .kernels import load_module

SOURCE = "gdn.cu"
CHUNK_SOURCE = "gdn_chunk.cu"
DT_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
CONV_THREADS = 128
PREFILL_TOK_TILE = 64  # tokens per CTA of the prefill conv
CHUNK = 64  # tokens per chunk of the chunked delta rule (CH in gdn_chunk.cu)
CHUNK_THREADS = 256  # NT in gdn_chunk.cu
CHUNK_COLS = 32  # value columns per gdn_chunk_state CTA (BV in gdn_chunk.cu; "tf32": CHUNK_COLS_WIDE)
CHUNK_COLS_WIDE = 64  # value columns per gdn_chunk_state CTA of the "tf32" build (BW in gdn_chunk.cu)
PREFILL_MODES = ("chunked", "scan")
# builds of gdn_chunk.cu: "fp32" -DTC=0 (float32 SIMT), "tf32" -DTC=3 (tensor cores, (I + A)^-1 prep, 64-column
# state CTAs), "tf32_v2" -DTC=2 (the same with 32-column state CTAs), "tf32_v1" -DTC=1 (the first tensor-core
# build: SIMT forward substitution); v2 and v1 are kept for benchmark comparison; "bf16" -DTC=4 (tf32 prep, then
# the state pass split in two on bf16 tensor cores: gdn_chunk_h carries the state, gdn_chunk_o forms o per chunk)
PRECISIONS = ("fp32", "tf32", "tf32_v2", "tf32_v1", "bf16")
TC_BUILD = {"fp32": 0, "tf32": 3, "tf32_v2": 2, "tf32_v1": 1, "bf16": 4}
H_COLS = 32  # value columns per gdn_chunk_h CTA (HB in gdn_chunk.cu)


FUSED_MAX_DK = 128  # gdn_decode_norm (FUSED_OK in gdn.cu): one CTA of fused_threads(dv) threads per value head
FUSED_MAX_DV = 128  # ... at most 4 groups of 128 threads (512), registers for dk <= 128 rows at that size


def fused_decode_fits(dk: int, dv: int) -> bool:
    """Whether a head shape has the fused decode pair (gdn.cu compiles ``gdn_decode_norm`` under the same rule)."""
    return dk <= FUSED_MAX_DK and dv <= FUSED_MAX_DV


def fused_threads(dv: int) -> int:
    """Threads of a ``gdn_decode_norm`` CTA (NTF in gdn.cu): 128 per 32 value columns, 512 at dv = 128."""
    return 128 * (-(-dv // 32))


def chunk_cols(precision: str) -> int:
    """Value columns per state CTA of a build (gdn_chunk_state; "bf16": gdn_chunk_h): 64 for ``"tf32"``, else 32."""
    if precision == "bf16":
        return H_COLS
    return CHUNK_COLS_WIDE if precision == "tf32" else CHUNK_COLS


def chunk_prep_smem(dk: int, precision: str = "fp32", dv: int | None = None) -> int:
    """Dynamic shared memory of gdn_chunk_prep (PREP_SMEM). fp32 / tf32_v1: q, k ``[64][dk+1]`` (tf32_v1:
    ``[64][dk+4]``), A ``[64][64]``, G ``[64]`` float64 and four ``[64]`` float32 rows: 83,968 bytes at dk = 128
    (tf32_v1: 85,504). tf32: q-then-v ``[64][max(dk+4, dvp+8)]`` (dvp = dv rounded up to 8), k ``[64][dk+4]``,
    A and T ``[64][68]``, the same rows: 104,960 bytes at dk = dv = 128 (two CTAs per SM); tf32_v2 the same.
    ``dv`` defaults to dk."""
    if precision in ("tf32", "tf32_v2", "bf16"):
        dvp = -(-(dk if dv is None else dv) // 8) * 8
        return 4 * (CHUNK * max(dk + 4, dvp + 8) + CHUNK * (dk + 4) + 2 * CHUNK * (CHUNK + 4) + 6 * CHUNK)
    dkp = dk + (4 if precision == "tf32_v1" else 1)
    return 4 * (2 * CHUNK * dkp + CHUNK * CHUNK + 2 * CHUNK + 4 * CHUNK)


def chunk_state_smem(dk: int, precision: str = "fp32") -> int:
    """Dynamic shared memory of gdn_chunk_state (STATE_SMEM). fp32: S ``[dk][32]``, W, Q, K ``[64][dk]``, Aqk
    ``[64][64]``, U, V, sk*V ``[64][32]``, scales ``[2][64][4]``: 157,696 bytes at dk = 128. tf32 (rows padded
    for conflict-free mma fragments): S ``[dk][40]``, W, Q ``[64][dk+4]``, K ``[64][dk+8]``, Aqk ``[64][68]``,
    U, V, sk*V ``[64][40]``, scales: 173,056 bytes at dk = 128 (tf32_v2 and tf32_v1). tf32 (64 columns): S^T
    ``[64][dk+4]``, W, Q ``[64][dk+4]``, K ``[64][dk+8]``, Aqk ``[64][68]``, U ``[64][72]``, V^T, (sk*V)^T
    ``[64][68]``, scales: 208,896 bytes at dk = 128 (dk = 192 does not fit 227 KB: that shape runs tf32_v2).
    bf16 (gdn_chunk_h, H_SMEM): W, K ``[2][64][dk+8]`` bf16, U ``[2][64][40]`` float32, scales ``[2][64][4]``, S
    ``[dk][40]`` and sk*V ``[64][40]`` bf16: 107,520 bytes at dk = 128 (two CTAs per SM)."""
    if precision == "bf16":
        hb = H_COLS + 8
        return 2 * (4 * CHUNK * (dk + 8) + 4 * CHUNK * hb + 4 * CHUNK * 4 + dk * hb + CHUNK * hb)
    if precision == "tf32":
        bw = CHUNK_COLS_WIDE
        return 4 * (bw * (dk + 4) + 2 * CHUNK * (dk + 4) + CHUNK * (dk + 8) + CHUNK * (CHUNK + 4)
                    + CHUNK * (bw + 8) + 2 * bw * (CHUNK + 4) + 2 * CHUNK * 4)
    if precision in ("tf32_v2", "tf32_v1"):  # one layout for both 32-column tensor-core builds
        vst = CHUNK_COLS + 8
        return 4 * (dk * vst + 2 * CHUNK * (dk + 4) + CHUNK * (dk + 8) + CHUNK * (CHUNK + 4) + 3 * CHUNK * vst
                    + 2 * CHUNK * 4)
    return 4 * (dk * CHUNK_COLS + 3 * CHUNK * dk + CHUNK * CHUNK + 3 * CHUNK * CHUNK_COLS + 2 * CHUNK * 4)


def chunk_out_smem(dk: int, dv: int) -> int:
    """Dynamic shared memory of gdn_chunk_o (build "bf16", O_SMEM): Q ``[64][dk+8]``, H ``[dk][dv+8]``, Aqk
    ``[64][72]``, V ``[64][dv+8]`` bf16 and the scales ``[64][4]`` float32: 79,872 bytes at dk = dv = 128."""
    return 2 * (CHUNK * (dk + 8) + dk * (dv + 8) + CHUNK * (CHUNK + 8) + CHUNK * (dv + 8)) + 4 * CHUNK * 4


class CudaGdn:
    """Kernels of one GDN layer shape on one device. ``layout`` is the state layout of the buffers the
    calls will receive (its conv shape ``(K-1, C)`` and recurrent shape ``(nv, dk, dv)`` must agree).

    ``precision`` picks the chunked prefill's build: ``"fp32"`` (float32 SIMT, within float32 rounding of
    the scan: float32 bundles) or ``"tf32"`` (tensor cores, ~1e-3 relative: fp16 bundles);
    ``"tf32_v2"`` (the same numerics, 32-column state CTAs) and ``"tf32_v1"`` (SIMT forward substitution)
    are the previous tensor-core builds, kept so that benchmarks can compare; ``"bf16"`` (the tf32 prep, then the
    state pass split in two on bf16 tensor cores, ~2.3e-3: the backend's build for bf16 bundles) needs
    dv % 32 == 0 (else ``"tf32"``). The tf32 builds need
    dk % 16 == 0 and their shared memory on the device; ``"tf32"`` that does not fit runs ``"tf32_v2"``
    (dk = 192), otherwise the fp32 build is used, and ``self.precision`` says which one runs (the state
    grid follows it). Decode and the scan do not depend on it.

    ``out_dtype`` (default ``act_dtype``) is the dtype of the fused decode's gated-norm output o (the ``cuda``
    backend: float32 activations and core, o in the bundle dtype for the out_proj GEMM)."""

    def __init__(self, device: CudaDevice, layout: StateLayout, nk: int, act_dtype: str = "bfloat16",
                 prefill_mode: str = "chunked", precision: str = "fp32", out_dtype: str | None = None) -> None:
        nv, dk, dv = layout.recurrent_shape
        km1, C = layout.conv_shape
        if nk <= 0 or nv % nk or 2 * nk * dk + nv * dv != C:
            raise ValueError(f"layout {layout} does not fit nk={nk}")
        if dv % 4:
            raise ValueError(f"value head dim {dv} must be a multiple of 4 (float4 state access)")
        if act_dtype not in DT_CODES:
            raise ValueError(f"activation dtype {act_dtype} not in {sorted(DT_CODES)}")
        self.device, self.layout = device, layout
        self.nk, self.nv, self.dk, self.dv, self.K, self.C = nk, nv, dk, dv, km1 + 1, C
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode {prefill_mode!r} not in {PREFILL_MODES}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} not in {PRECISIONS}")
        out_dtype = out_dtype or act_dtype
        if out_dtype not in DT_CODES:
            raise ValueError(f"output dtype {out_dtype} not in {sorted(DT_CODES)}")
        self.act_dtype, self.out_dtype, self.prefill_mode = act_dtype, out_dtype, prefill_mode
        self.module = load_module(SOURCE, (f"-DDT={DT_CODES[act_dtype]}", f"-DOT={DT_CODES[out_dtype]}", f"-DDK={dk}",
                                           f"-DDV={dv}", f"-DKW={self.K}"), device.arch)
        self.fused_decode_ok = fused_decode_fits(dk, dv)
        # Chunked prefill: both kernels need more than the default 48 KB of shared memory (opted in here).
        optin = device.limits.max_shared_mem_optin

        def fits(p: str) -> bool:
            if p == "bf16" and (dv % 32 or chunk_out_smem(dk, dv) > optin):
                return False
            return dk % 16 == 0 and max(chunk_prep_smem(dk, p, dv), chunk_state_smem(dk, p)) <= optin

        if precision == "bf16" and not fits(precision):
            precision = "tf32"
        if precision == "tf32" and not fits(precision):
            precision = "tf32_v2"
        if precision != "fp32" and not fits(precision):
            precision = "fp32"
        self.precision = precision
        self.chunk_cols = chunk_cols(precision)
        self.chunk_smem = (chunk_prep_smem(dk, precision, dv), chunk_state_smem(dk, precision))
        self.chunk_module = None
        if dk % 4 == 0 and max(self.chunk_smem) <= optin:
            self.chunk_module = load_module(CHUNK_SOURCE, (f"-DDT={DT_CODES[act_dtype]}", f"-DDK={dk}",
                                                           f"-DDV={dv}", f"-DTC={TC_BUILD[precision]}"),
                                            device.arch)
            names = ("gdn_chunk_prep", "gdn_chunk_h" if precision == "bf16" else "gdn_chunk_state")
            for name, nbytes in zip(names, self.chunk_smem):
                self.chunk_module.kernel(name).set_max_dynamic_smem(device, nbytes)
            if precision == "bf16":
                self.chunk_module.kernel("gdn_chunk_o").set_max_dynamic_smem(device, chunk_out_smem(dk, dv))
        # "tf32" also loads the 32-column state pass ("tf32_v2": the same prep, workspace and bits) for steps whose
        # 64-column grid would leave SMs idle (state_cols_for): a single long prompt runs nv CTAs per 64 columns.
        self.narrow_module = None
        self.narrow_smem = chunk_state_smem(dk, "tf32_v2")
        if self.chunk_module is not None and precision == "tf32" and fits("tf32_v2"):
            self.narrow_module = load_module(CHUNK_SOURCE, (f"-DDT={DT_CODES[act_dtype]}", f"-DDK={dk}",
                                                            f"-DDV={dv}", f"-DTC={TC_BUILD['tf32_v2']}"),
                                             device.arch)
            self.narrow_module.kernel("gdn_chunk_state").set_max_dynamic_smem(device, self.narrow_smem)
        self.narrow_below = device.limits.sm_count  # state_cols_for's threshold (0: never the 32-column twin)
        self.conv_row = layout.conv_row_bytes // layout.itemsize  # element strides from the same layout
        self.rec_row = layout.recurrent_row_bytes // layout.itemsize
        # Prefill scan: tokens staged per chunk, as many as fit the default 48 KB of shared memory.
        per_tok = (2 * dk + 32 + 3) * 4
        self.chunk = max(1, min(64, device.limits.max_shared_mem_per_block // per_tok))

    # ------------------------------------------------------------------ checks

    def _check_state(self, conv: DeviceArray, rec: DeviceArray) -> None:
        L = self.layout
        if conv.shape != (L.rows, *L.conv_shape) or rec.shape != (L.rows, *L.recurrent_shape):
            raise ValueError(f"state buffers {conv.shape}, {rec.shape} do not match the layout {L}")
        if conv.dtype.name != "float32" or rec.dtype.name != "float32":
            raise ValueError("state buffers must be float32")
        for a in (conv, rec):
            if a.device != self.device.ordinal:
                raise ValueError(f"state buffer on device {a.device}, kernels on {self.device.ordinal}")

    def _check_inputs(self, n: int, u: DeviceArray, g: DeviceArray, beta: DeviceArray, conv_w: DeviceArray) -> None:
        want = {"u": (u, (n, self.C), self.act_dtype), "g": (g, (n, self.nv), "float32"),
                "beta": (beta, (n, self.nv), "float32"), "conv_w": (conv_w, (self.C, self.K), "float32")}
        for name, (a, shape, dt) in want.items():
            if a.shape != shape or a.dtype.name != dt:
                raise ValueError(f"{name} is {a.shape} {a.dtype}, expected {shape} {dt}")
            if a.device != self.device.ordinal:
                raise ValueError(f"{name} on device {a.device}, kernels on {self.device.ordinal}")

    # ------------------------------------------------------------------ decode

    def decode(self, conv: DeviceArray, rec: DeviceArray, slots: Sequence[int] | np.ndarray, u: DeviceArray,
               g: DeviceArray, beta: DeviceArray, conv_w: DeviceArray, out: DeviceArray | None = None,
               x_work: DeviceArray | None = None) -> DeviceArray:
        """One token per row; rows' states updated in place. Returns o ``[B, nv*dv]`` (act dtype).
        ``out`` / ``x_work`` (float32 ``[B, C]``) may be passed to avoid per-call allocations."""
        B = int(np.asarray(slots).shape[0]) if np.ndim(slots) == 1 else -1
        if B < 1:
            raise ValueError("decode needs a 1-D slot array of at least one row")
        self._check_state(conv, rec)
        self._check_inputs(B, u, g, beta, conv_w)
        idx = _check_slots(np.asarray(slots), self.layout.rows, B)
        d = self.device
        slots_dev = d.upload(idx.astype(np.int32), stream_ordered=True)
        x = x_work if x_work is not None else d.empty((B, self.C), "float32", stream_ordered=True)
        o = out if out is not None else d.empty((B, self.nv * self.dv), self.act_dtype, stream_ordered=True)
        if x.shape != (B, self.C) or o.shape != (B, self.nv * self.dv) or o.dtype.name != self.act_dtype:
            raise ValueError("x_work / out have the wrong shape or dtype")
        self.conv_decode(conv, slots_dev.ptr, u, conv_w, x, B)
        self.delta_decode(rec, slots_dev.ptr, x, g, beta, o, B)
        return o

    def conv_decode(self, conv: DeviceArray, slots_ptr: int, u: DeviceArray, conv_w: DeviceArray, x: DeviceArray,
                    B: int, u_stride: int | None = None) -> None:
        """Launch only the conv step (slots already on the device and checked). ``u_stride``: elements
        between u's rows (default C; larger when u is the first C columns of a fused projection)."""
        self.module.kernel("gdn_conv_decode").launch(
            self.device, (-(-self.C // CONV_THREADS), B, 1), (CONV_THREADS, 1, 1), 0,
            [("ptr", u.ptr), ("ptr", conv_w.ptr), ("ptr", conv.ptr), ("i64", self.conv_row), ("ptr", slots_ptr),
             ("ptr", x.ptr), ("i32", B), ("i32", self.C), ("i64", u_stride or self.C)])

    def delta_decode(self, rec: DeviceArray, slots_ptr: int, x: DeviceArray, g: DeviceArray, beta: DeviceArray,
                     o: DeviceArray, B: int) -> None:
        """Launch only the delta-rule step on post-conv ``x`` (slots already on the device and checked)."""
        self.module.kernel("gdn_decode").launch(
            self.device, (-(-self.dv // 32), self.nv, B), (128, 1, 1), 0,
            [("ptr", x.ptr), ("ptr", g.ptr), ("ptr", beta.ptr), ("ptr", slots_ptr), ("ptr", rec.ptr),
             ("i64", self.rec_row), ("ptr", o.ptr), ("i32", B), ("i32", self.nk), ("i32", self.nv)])

    def conv_gates_decode(self, conv: DeviceArray, slots_ptr: int, u_ptr: int, u_stride: int, conv_w: DeviceArray,
                          x_ptr: int, B: int, p_ptr: int, p_stride: int, off_b: int, off_a: int, neg_exp_a_ptr: int,
                          dt_bias_ptr: int, g_ptr: int, beta_ptr: int) -> None:
        """The conv step and the gates in one launch (``gdn_conv_gates_decode``, PDL), slots on the device and
        checked: u rows of ``u_stride`` elements (act dtype), x float32 ``[B, C]``; the gates of row b from the
        float32 projection row ``p + b * p_stride`` (b at column ``off_b + j``, a at ``off_a + j``), neg_exp_a and
        dt_bias float32 ``[nv]``, into g and beta float32 ``[B, nv]`` (dense). Grid ``(ceil(C/128) + 1, B)``."""
        self.module.kernel("gdn_conv_gates_decode").launch(
            self.device, (-(-self.C // CONV_THREADS) + 1, B, 1), (CONV_THREADS, 1, 1), 0,
            [("ptr", u_ptr), ("ptr", conv_w.ptr), ("ptr", conv.ptr), ("i64", self.conv_row), ("ptr", slots_ptr),
             ("ptr", x_ptr), ("i32", B), ("i32", self.C), ("i64", u_stride), ("ptr", p_ptr), ("i64", p_stride),
             ("i32", off_b), ("i32", off_a), ("ptr", neg_exp_a_ptr), ("ptr", dt_bias_ptr), ("ptr", g_ptr),
             ("ptr", beta_ptr), ("i32", self.nv)], pdl=True)

    def delta_norm_decode(self, rec: DeviceArray, slots_ptr: int, x_ptr: int, g_ptr: int, beta_ptr: int, z_ptr: int,
                          z_stride: int, norm_w_ptr: int, eps: float, o_ptr: int, B: int, core_ptr: int = 0) -> None:
        """The delta rule and the gated RMSNorm in one launch (``gdn_decode_norm``, PDL; grid ``(1, nv, B)``,
        :func:`fused_threads` threads), slots on the device and checked: post-conv x float32 ``[B, C]``, g / beta
        float32 ``[B, nv]``, z float32 rows of ``z_stride`` elements (``[B, nv*dv]`` at their start), the norm
        weight float32 ``[dv]``; writes o ``[B, nv*dv]`` (``out_dtype``) and, when ``core_ptr`` is given, the
        ungated core ``[B, nv*dv]`` (act dtype). Needs ``fused_decode_ok``."""
        if not self.fused_decode_ok:
            raise ValueError(f"no fused decode kernel for dk={self.dk}, dv={self.dv} (dk, dv <= {FUSED_MAX_DK})")
        self.module.kernel("gdn_decode_norm").launch(
            self.device, (1, self.nv, B), (fused_threads(self.dv), 1, 1), 0,
            [("ptr", x_ptr), ("ptr", g_ptr), ("ptr", beta_ptr), ("ptr", slots_ptr), ("ptr", rec.ptr),
             ("i64", self.rec_row), ("ptr", z_ptr), ("i64", z_stride), ("ptr", norm_w_ptr), ("f32", eps),
             ("ptr", o_ptr), ("ptr", core_ptr), ("i32", B), ("i32", self.nk), ("i32", self.nv)], pdl=True)

    # ------------------------------------------------------------------ prefill

    def prefill(self, conv: DeviceArray, rec: DeviceArray, slots: Sequence[int] | np.ndarray,
                seq_lens: Sequence[int] | np.ndarray, u: DeviceArray, g: DeviceArray, beta: DeviceArray,
                conv_w: DeviceArray, mode: str | None = None) -> DeviceArray:
        """Prefill chunks of S sequences packed along the token axis (``sum(seq_lens)`` rows, each
        sequence contiguous, in order), each continuing from its slot's state. Returns o ``[N, nv*dv]``.
        ``mode`` overrides ``prefill_mode`` for this call (tests compare the two paths); the chunked
        path's workspace is allocated per call here (the backend passes a resident one instead)."""
        lens = np.asarray(seq_lens, np.int64).reshape(-1)
        S = lens.size
        if S < 1 or lens.min() < 1:
            raise ValueError(f"prefill needs >= 1 sequence of >= 1 token, got lengths {lens.tolist()}")
        idx = _check_slots(np.asarray(slots), self.layout.rows, S)
        if np.unique(idx).size != S:
            raise ValueError(f"prefill sequences need distinct slots, got {idx.tolist()}")
        N = int(lens.sum())
        self._check_state(conv, rec)
        self._check_inputs(N, u, g, beta, conv_w)
        d = self.device
        meta = np.concatenate([np.concatenate([[0], np.cumsum(lens)]), idx]).astype(np.int32)
        meta_dev = d.upload(meta, stream_ordered=True)
        x = d.empty((N, self.C), "float32", stream_ordered=True)
        o = d.empty((N, self.nv * self.dv), self.act_dtype, stream_ordered=True)
        ws = None
        if (mode or self.prefill_mode) == "chunked" and self.chunk_module is not None:
            ws = d.empty((self.workspace_bytes(N, S),), "uint8", stream_ordered=True)
        self.prefill_launch(conv, rec, meta_dev.ptr, meta_dev.ptr + 4 * (S + 1), S, int(lens.max()), u.ptr, self.C,
                            g.ptr, beta.ptr, conv_w, x.ptr, o.ptr, workspace=ws, n_tokens=N, mode=mode)
        return o

    def state_cols_for(self, S: int) -> int:
        """Value columns per ``gdn_chunk_state`` CTA for a step of ``S`` sequences: ``self.chunk_cols``, except
        that the "tf32" build takes its 32-column twin when that grid, ``ceil(dv/32) * nv * S`` CTAs, still
        fits one wave of one CTA per SM (one 8192-token prompt of Qwen3.5-35B-A3B: 128 CTAs on 132 SMs instead of
        64; H200, 30 layers: 43.9 -> 41.6 ms of GDN. Two prompts: 256 narrow CTAs were slower than 128 wide
        ones, 8 x 4k GDN 32 -> 42 ms). The two state passes round the same operands in the same k order, so the
        choice changes no bit (``tests/gpu/test_gdn_chunk_gpu.py``) and prefill stays batch invariant."""
        if self.narrow_module is not None and -(-self.dv // 32) * self.nv * S <= self.narrow_below:
            return 32
        return self.chunk_cols

    def workspace_bytes(self, max_tokens: int, max_seqs: int = 1) -> int:
        """Bytes of the chunked prefill's workspace for steps of up to ``max_tokens`` packed tokens in up to
        ``max_seqs`` sequences: ``4 * max_tokens * nv * (dk + dv + 64 + 4)`` (w ``[N, nv, dk]``, u ``[N, nv, dv]``,
        Aqk rows ``[N, nv, 64]``, scales ``[N, nv, 4]``, float32). Qwen3.5-35B-A3B (nv = 32, dk = dv = 128):
        40.5 KiB per token, 324 MiB at 8192 tokens. The "bf16" build (``max_seqs`` counts only there): w and Aqk
        in bf16, u and the scales float32, then bf16 q / k rows ``[N, 2, nk, dk]``, V ``[N, nv, dv]`` and one
        starting state per chunk ``[ceil(N / 64) + max_seqs, nv, dk, dv]``: 44.5 KiB per token + 1 MiB per
        chunk at that shape (485 MiB at 8192 tokens, one sequence). One workspace serves every GDN layer
        (they run one after another on one stream)."""
        N = int(max_tokens)
        if self.precision == "bf16":
            chunks = -(-N // CHUNK) + int(max_seqs)
            return (N * (2 * self.nv * self.dk + 4 * self.nv * self.dv + 2 * self.nv * CHUNK + 16 * self.nv
                         + 4 * self.nk * self.dk + 2 * self.nv * self.dv)
                    + 2 * chunks * self.nv * self.dk * self.dv)
        return 4 * N * self.nv * (self.dk + self.dv + CHUNK + 4)

    def workspace_views(self, ptr: int, max_tokens: int) -> tuple[int, ...]:
        """Device pointers of w, u, Aqk and the scales inside a workspace of ``workspace_bytes(max_tokens)``
        bytes at ``ptr`` (each region a multiple of 16 bytes, so 16-byte aligned when ``ptr`` is); the "bf16"
        build adds the q / k rows, V and the per-chunk states (last: their count depends on ``max_seqs``)."""
        N = int(max_tokens)
        if self.precision == "bf16":
            w = ptr
            u = w + 2 * N * self.nv * self.dk
            a = u + 4 * N * self.nv * self.dv
            sc = a + 2 * N * self.nv * CHUNK
            qk = sc + 16 * N * self.nv
            vn = qk + 4 * N * self.nk * self.dk
            return w, u, a, sc, qk, vn, vn + 2 * N * self.nv * self.dv
        per = 4 * N * self.nv
        w = ptr
        u = w + per * self.dk
        a = u + per * self.dv
        return w, u, a, a + per * CHUNK

    def prefill_launch(self, conv: DeviceArray, rec: DeviceArray, starts_ptr: int, slots_ptr: int, S: int,
                       max_len: int, u_ptr: int, u_stride: int, g_ptr: int, beta_ptr: int, conv_w: DeviceArray,
                       x_ptr: int, o_ptr: int, workspace: DeviceArray | None = None, n_tokens: int = 0,
                       mode: str | None = None) -> None:
        """The prefill launches on data already on the device (checked by the caller): ``starts``
        int32 ``[S+1]`` token offsets, ``slots`` int32 ``[S]`` (distinct), u rows of ``u_stride`` elements,
        g/beta float32 ``[N, nv]``, x a float32 ``[N, C]`` work area, o ``[N, nv*dv]`` (act dtype).

        Conv + window update, then the delta rule: chunked (``gdn_chunk_prep`` + ``gdn_chunk_state``) when
        the mode is ``"chunked"`` and a ``workspace`` of at least ``workspace_bytes(n_tokens)`` is given
        (``n_tokens`` = N, the packed tokens of this call), else the token scan ``gdn_prefill``. x, o and
        the workspace must be 16-byte aligned (device allocations are)."""
        d = self.device
        cblocks = -(-self.C // CONV_THREADS)
        self.module.kernel("gdn_conv_prefill").launch(
            d, (cblocks, -(-max_len // PREFILL_TOK_TILE), S), (CONV_THREADS, 1, 1), 0,
            [("ptr", u_ptr), ("ptr", conv_w.ptr), ("ptr", conv.ptr), ("i64", self.conv_row), ("ptr", starts_ptr),
             ("ptr", slots_ptr), ("ptr", x_ptr), ("i32", S), ("i32", self.C), ("i32", PREFILL_TOK_TILE),
             ("i64", u_stride)])
        self.module.kernel("gdn_conv_window").launch(
            d, (cblocks, S, 1), (CONV_THREADS, 1, 1), 0,
            [("ptr", u_ptr), ("ptr", conv.ptr), ("i64", self.conv_row), ("ptr", starts_ptr), ("ptr", slots_ptr),
             ("i32", S), ("i32", self.C), ("i64", u_stride)])
        if (mode or self.prefill_mode) == "chunked" and workspace is not None and self.chunk_module is not None:
            self.delta_prefill_chunked(rec, starts_ptr, slots_ptr, S, max_len, g_ptr, beta_ptr, x_ptr, o_ptr,
                                       workspace, n_tokens)
            return
        smem = self.chunk * (2 * self.dk + 32 + 3) * 4
        self.module.kernel("gdn_prefill").launch(
            d, (-(-self.dv // 32), self.nv, S), (128, 1, 1), smem,
            [("ptr", x_ptr), ("ptr", g_ptr), ("ptr", beta_ptr), ("ptr", starts_ptr), ("ptr", slots_ptr),
             ("ptr", rec.ptr), ("i64", self.rec_row), ("ptr", o_ptr), ("i32", S), ("i32", self.nk), ("i32", self.nv),
             ("i32", self.chunk)])

    def delta_prefill_chunked(self, rec: DeviceArray, starts_ptr: int, slots_ptr: int, S: int, max_len: int,
                              g_ptr: int, beta_ptr: int, x_ptr: int, o_ptr: int, workspace: DeviceArray,
                              n_tokens: int) -> None:
        """The chunked delta rule on post-conv x (two launches, both programmatic dependents that wait in
        the kernel before touching memory): intra-chunk prep of every chunk, then the state pass + output.
        ``n_tokens`` sizes the workspace regions; the packed N of this call must not exceed it."""
        if self.chunk_module is None:
            raise ValueError(f"no chunked prefill for dk={self.dk} on {self.device.limits.name}")
        if n_tokens < 1 or workspace.nbytes < self.workspace_bytes(n_tokens, S):
            raise ValueError(f"workspace of {workspace.nbytes} bytes, {self.workspace_bytes(n_tokens, S)} needed "
                             f"for {n_tokens} tokens in {S} sequences")
        if workspace.device != self.device.ordinal:
            raise ValueError(f"workspace on device {workspace.device}, kernels on {self.device.ordinal}")
        if (workspace.ptr | x_ptr) % 16:
            raise ValueError("the chunked prefill needs 16-byte aligned x and workspace (cp.async)")
        views = self.workspace_views(workspace.ptr, n_tokens)
        ws_w, ws_u, ws_a, ws_s = views[:4]
        m, d = self.chunk_module, self.device
        qk_rows = [("ptr", views[4])] if self.precision == "bf16" else []  # the bf16 prep also writes q / k rows
        m.kernel("gdn_chunk_prep").launch(
            d, (-(-max_len // CHUNK), self.nv, S), (CHUNK_THREADS, 1, 1), self.chunk_smem[0],
            [("ptr", x_ptr), ("ptr", g_ptr), ("ptr", beta_ptr), ("ptr", starts_ptr), ("ptr", ws_w), ("ptr", ws_u),
             ("ptr", ws_a), ("ptr", ws_s), ("i32", S), ("i32", self.nk), ("i32", self.nv), *qk_rows], pdl=True)
        if self.precision == "bf16":
            ws_qk, ws_vn, ws_hb = views[4:]
            m.kernel("gdn_chunk_h").launch(
                d, (-(-self.dv // H_COLS), self.nv, S), (CHUNK_THREADS, 1, 1), self.chunk_smem[1],
                [("ptr", starts_ptr), ("ptr", slots_ptr), ("ptr", rec.ptr), ("i64", self.rec_row), ("ptr", ws_w),
                 ("ptr", ws_u), ("ptr", ws_s), ("ptr", ws_qk), ("ptr", ws_vn), ("ptr", ws_hb), ("i32", S),
                 ("i32", self.nk), ("i32", self.nv)], pdl=True)
            m.kernel("gdn_chunk_o").launch(
                d, (-(-max_len // CHUNK), self.nv, S), (CHUNK_THREADS, 1, 1), chunk_out_smem(self.dk, self.dv),
                [("ptr", starts_ptr), ("ptr", ws_a), ("ptr", ws_s), ("ptr", ws_qk), ("ptr", ws_vn), ("ptr", ws_hb),
                 ("ptr", o_ptr), ("i32", S), ("i32", self.nk), ("i32", self.nv)], pdl=True)
            return
        cols = self.state_cols_for(S)
        sm, smem = (self.narrow_module, self.narrow_smem) if cols != self.chunk_cols else (m, self.chunk_smem[1])
        assert sm is not None
        sm.kernel("gdn_chunk_state").launch(
            d, (-(-self.dv // cols), self.nv, S), (CHUNK_THREADS, 1, 1), smem,
            [("ptr", x_ptr), ("ptr", starts_ptr), ("ptr", slots_ptr), ("ptr", rec.ptr), ("i64", self.rec_row),
             ("ptr", ws_w), ("ptr", ws_u), ("ptr", ws_a), ("ptr", ws_s), ("ptr", o_ptr), ("i32", S),
             ("i32", self.nk), ("i32", self.nv)], pdl=True)
