"""Gated DeltaNet stateful operators on the GPU (the twins of :mod:`hybrid_runtime.ops.gdn`).

:class:`CudaGdn` holds the compiled kernels of one layer shape on one device and runs, on that device's
stream, against the buffers of a :class:`~hybrid_runtime.cuda.state.DeviceStateCache` layer:

* :meth:`CudaGdn.decode`: one token for each of B rows: conv window update + causal conv + SiLU, then
  the gated delta rule on the rows' slots (padding rows may name the sink; live slots must be distinct).
* :meth:`CudaGdn.prefill`: several sequences of T_i >= 1 tokens, packed: conv over all tokens in parallel,
  window update, then the delta rule as a per-chunk scan (state in registers, one CTA per 32 columns of
  a value head of a sequence; chunks of tokens staged in shared memory).

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
DT_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
CONV_THREADS = 128
PREFILL_TOK_TILE = 64  # tokens per CTA of the prefill conv


class CudaGdn:
    """Kernels of one GDN layer shape on one device. ``layout`` is the state layout of the buffers the
    calls will receive (its conv shape ``(K-1, C)`` and recurrent shape ``(nv, dk, dv)`` must agree)."""

    def __init__(self, device: CudaDevice, layout: StateLayout, nk: int, act_dtype: str = "bfloat16") -> None:
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
        self.act_dtype = act_dtype
        self.module = load_module(SOURCE, (f"-DDT={DT_CODES[act_dtype]}", f"-DDK={dk}", f"-DDV={dv}",
                                           f"-DKW={self.K}"), device.arch)
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

    # ------------------------------------------------------------------ prefill

    def prefill(self, conv: DeviceArray, rec: DeviceArray, slots: Sequence[int] | np.ndarray,
                seq_lens: Sequence[int] | np.ndarray, u: DeviceArray, g: DeviceArray, beta: DeviceArray,
                conv_w: DeviceArray) -> DeviceArray:
        """Prefill chunks of S sequences packed along the token axis (``sum(seq_lens)`` rows, each
        sequence contiguous, in order), each continuing from its slot's state. Returns o ``[N, nv*dv]``."""
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
        self.prefill_launch(conv, rec, meta_dev.ptr, meta_dev.ptr + 4 * (S + 1), S, int(lens.max()), u.ptr, self.C,
                            g.ptr, beta.ptr, conv_w, x.ptr, o.ptr)
        return o

    def prefill_launch(self, conv: DeviceArray, rec: DeviceArray, starts_ptr: int, slots_ptr: int, S: int,
                       max_len: int, u_ptr: int, u_stride: int, g_ptr: int, beta_ptr: int, conv_w: DeviceArray,
                       x_ptr: int, o_ptr: int) -> None:
        """The three prefill launches on data already on the device (checked by the caller): ``starts``
        int32 ``[S+1]`` token offsets, ``slots`` int32 ``[S]`` (distinct), u rows of ``u_stride`` elements,
        g/beta float32 ``[N, nv]``, x a float32 ``[N, C]`` work area, o ``[N, nv*dv]`` (act dtype)."""
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
        smem = self.chunk * (2 * self.dk + 32 + 3) * 4
        self.module.kernel("gdn_prefill").launch(
            d, (-(-self.dv // 32), self.nv, S), (128, 1, 1), smem,
            [("ptr", x_ptr), ("ptr", g_ptr), ("ptr", beta_ptr), ("ptr", starts_ptr), ("ptr", slots_ptr),
             ("ptr", rec.ptr), ("i64", self.rec_row), ("ptr", o_ptr), ("i32", S), ("i32", self.nk), ("i32", self.nv),
             ("i32", self.chunk)])
