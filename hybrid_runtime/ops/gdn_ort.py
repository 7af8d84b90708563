"""The Gated DeltaNet mixer through onnxruntime's kernels: conv window + gated delta rule of a whole batch
in one session run, for every linear-attention layer of a model (the conv weight is an input).

Math and buffers as in :mod:`.gdn` (whose numpy functions stay the oracle of the tests): ``u = [q | k | v]``
pre-conv channels, ``g``/``beta`` per value head; conv buffer ``[rows, K-1, C]`` (oldest first), recurrent
buffer ``[rows, nv, dk, dv]``. Two graphs:

* DECODE (one token per sequence): ``CausalConvWithState`` (channels-last state, the buffer's layout),
  l2-normalised q/k, k repeated per value head, ``LinearAttention`` (``gated_delta``; query head
  ``j // (nv/nk)`` serves value head ``j``, the model's grouping).
* PREFILL (ragged chunks): ``VarlenCausalConvWithState`` over the packed tokens (channels-first state: the
  batch's few conv rows are transposed in and out), then the tokens are laid out ``[B, Tmax]`` with
  inert zero padding (q = k = v = 0, g = beta = 0 leaves a state exactly as it was) for the chunked
  ``LinearAttention``, and gathered back to packed order.

The recurrent state is updated in place: when the batch's slots, sorted, are one contiguous range, the
session reads and writes that range of the pool directly (the batch's token rows are put in slot order
instead, which costs a few KB); otherwise only the batch's rows are gathered into a scratch block and
scattered back. ``LinearAttention`` handles each (sequence, head) state on its own, reading it before
writing it, so input and output may be the same memory (``tests/unit/test_gdn_ort.py`` checks the result
against the numpy oracle, in place and not).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..config import ModelConfig
from ..engine.ort_session import Binding, cpu_session, session_options
from .gdn import _check, _check_slots

_F, _I64, _I32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32


def _vi(name: str, elem: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


class _Graph:
    """Node list with constants; names are unique per call site by construction."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def op(self, op_type: str, inputs: list[str], outputs: list[str], **attrs) -> None:
        domain = "com.microsoft" if op_type in ("LinearAttention", "CausalConvWithState",
                                                "VarlenCausalConvWithState") else ""
        self.nodes.append(helper.make_node(op_type, inputs, outputs, domain=domain, **attrs))

    def const(self, name: str, arr: np.ndarray) -> str:
        self.inits.append(onnx.numpy_helper.from_array(np.asarray(arr), name))
        return name

    def model(self, name: str, ins: list, outs: list) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, name, ins, outs, self.inits)
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        m = helper.make_model(g, opset_imports=opsets, producer_name="hybrid-runtime")
        m.ir_version = 8
        return m


def _qkv_and_attention(g: _Graph, cfg: ModelConfig, x3: str, gate3: str, beta3: str) -> None:
    """x3 ``[B, T, C]`` post-conv channels, gate3/beta3 ``[B, T, nv]`` -> node outputs ``o`` ``[B, T, nv*dv]``
    and ``rec_out`` (the updated state of input ``rec``)."""
    nk, dk, nv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads
    kd, vd, r = nk * dk, cfg.value_dim, nv // nk
    g.op("Split", [x3, g.const("split_qkv", np.array([kd, kd, vd], np.int64))], ["q_raw", "k_raw", "v"], axis=2)
    heads = g.const("heads_shape", np.array([0, 0, nk, dk], np.int64))
    flat = g.const("flat_keys", np.array([0, 0, kd], np.int64))
    eps = g.const("l2_eps", np.array(1e-6, np.float32))
    for name in ("q", "k"):  # x / sqrt(sum(x^2) + 1e-6) per head, as in ops.gdn._l2norm
        g.op("Reshape", [f"{name}_raw", heads], [f"{name}_h"])
        g.op("ReduceSumSquare", [f"{name}_h"], [f"{name}_ss"], axes=[-1], keepdims=1)
        g.op("Add", [f"{name}_ss", eps], [f"{name}_sse"])
        g.op("Sqrt", [f"{name}_sse"], [f"{name}_norm"])
        g.op("Div", [f"{name}_h", f"{name}_norm"], [f"{name}_n"])
    g.op("Reshape", ["q_n", flat], ["q"])
    if r > 1:  # key head j // r serves value head j: [B, T, nk, 1, dk] -> [B, T, nk, r, dk] -> [B, T, nv*dk]
        g.op("Unsqueeze", ["k_n", g.const("axis3", np.array([3], np.int64))], ["k_u"])
        g.op("Expand", ["k_u", g.const("rep_shape", np.array([1, 1, 1, r, 1], np.int64))], ["k_e"])
        g.op("Reshape", ["k_e", g.const("flat_rep", np.array([0, 0, nv * dk], np.int64))], ["k"])
    else:
        g.op("Reshape", ["k_n", flat], ["k"])
    g.op("LinearAttention", ["q", "k", "v", "rec", gate3, beta3], ["o", "rec_out"], q_num_heads=nk, kv_num_heads=nv,
         update_rule="gated_delta", scale=float(1.0 / np.sqrt(dk)))


def decode_graph(cfg: ModelConfig) -> onnx.ModelProto:
    """u ``[B, C]``, g/beta ``[B, nv]``, conv_w ``[C, 1, K]``, conv_in ``[B, K-1, C]``, rec ``[B, nv, dk, dv]``
    -> o ``[B, 1, nv*dv]``, conv_out ``[B, K-1, C]``, rec_out (= rec's shape)."""
    C, K, nv, dk, dv = cfg.conv_dim, cfg.conv_kernel, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    g = _Graph()
    ax1 = g.const("axis1", np.array([1], np.int64))
    g.op("Unsqueeze", ["u", ax1], ["u3"])
    g.op("Unsqueeze", ["g", ax1], ["g3"])
    g.op("Unsqueeze", ["beta", ax1], ["beta3"])
    g.op("CausalConvWithState", ["u3", "conv_w", "", "conv_in"], ["x3", "conv_out"], activation="silu",
         channels_last=1)
    _qkv_and_attention(g, cfg, "x3", "g3", "beta3")
    ins = [_vi("u", _F, ["B", C]), _vi("g", _F, ["B", nv]), _vi("beta", _F, ["B", nv]), _vi("conv_w", _F, [C, 1, K]),
           _vi("conv_in", _F, ["B", K - 1, C]), _vi("rec", _F, ["B", nv, dk, dv])]
    outs = [_vi("o", _F, ["B", 1, nv * dv]), _vi("conv_out", _F, ["B", K - 1, C]),
            _vi("rec_out", _F, ["B", nv, dk, dv])]
    return g.model("gdn_decode", ins, outs)


def prefill_graph(cfg: ModelConfig) -> onnx.ModelProto:
    """u ``[T, C]`` (packed in slot order), g/beta ``[T, nv]``, conv_w, cu ``[B+1]`` int32, conv_in
    ``[B, C, K-1]``, rec, pad_idx ``[B*Tmax]`` (a packed row, or T for padding), pad_shape ``[B, Tmax, -1]``,
    out_idx ``[T]`` (padded row of each packed token, in the caller's order) -> o ``[T, nv*dv]``,
    conv_out ``[B, C, K-1]``, rec_out."""
    C, K, nv, dk, dv = cfg.conv_dim, cfg.conv_kernel, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    g = _Graph()
    g.op("VarlenCausalConvWithState", ["u", "conv_w", "cu", "", "conv_in"], ["x", "conv_out"], activation="silu")
    g.op("Concat", ["x", "g", "beta"], ["feat"], axis=1)
    g.op("Concat", ["feat", g.const("zero_row", np.zeros((1, C + 2 * nv), np.float32))], ["rows"], axis=0)
    g.op("Gather", ["rows", "pad_idx"], ["padded"], axis=0)
    g.op("Reshape", ["padded", "pad_shape"], ["p3"])
    g.op("Split", ["p3", g.const("split_feat", np.array([C, nv, nv], np.int64))], ["x3", "g3", "beta3"], axis=2)
    _qkv_and_attention(g, cfg, "x3", "g3", "beta3")
    g.op("Reshape", ["o", g.const("flat_out", np.array([-1, nv * dv], np.int64))], ["o_rows"])
    g.op("Gather", ["o_rows", "out_idx"], ["out"], axis=0)
    ins = [_vi("u", _F, ["T", C]), _vi("g", _F, ["T", nv]), _vi("beta", _F, ["T", nv]), _vi("conv_w", _F, [C, 1, K]),
           _vi("cu", _I32, ["B1"]), _vi("conv_in", _F, ["B", C, K - 1]), _vi("rec", _F, ["B", nv, dk, dv]),
           _vi("pad_idx", _I64, ["P"]), _vi("pad_shape", _I64, [3]), _vi("out_idx", _I64, ["T"])]
    outs = [_vi("out", _F, ["T", nv * dv]), _vi("conv_out", _F, ["B", C, K - 1]), _vi("rec_out", _F, ["B", nv, dk, dv])]
    return g.model("gdn_prefill", ins, outs)


class OrtGdn:
    """Both GDN graphs of one model; one instance serves every linear-attention layer (owned by the
    operators of one runner, called only from its engine thread)."""

    def __init__(self, cfg: ModelConfig, intra_op_threads: int | None = None) -> None:
        self.cfg = cfg
        self.dims = (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads,
                     cfg.linear_value_head_dim)
        opts = session_options(intra_op_threads)
        self._decode = Binding(cpu_session(decode_graph(cfg), opts))
        self._prefill = Binding(cpu_session(prefill_graph(cfg), opts))
        self._out = np.empty((0, cfg.value_dim), np.float32)  # decode output rows, grown on demand

    @staticmethod
    def _w(conv_w: np.ndarray) -> np.ndarray:
        """conv_w ``[C, K]`` as the kernels' ``[C, 1, K]`` (a view of a contiguous float32 array)."""
        return np.ascontiguousarray(conv_w, np.float32).reshape(conv_w.shape[0], 1, conv_w.shape[-1])

    @staticmethod
    def _rows(rec_buf: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """(slot order of the batch, the batch's recurrent rows in that order, whether those rows are a view
        of the pool). Sorted slots forming one range are used in place; anything else is gathered."""
        order = np.argsort(slots, kind="stable")
        s = slots[order]
        if len(s) and s[-1] - s[0] + 1 == len(s) and (len(s) == 1 or (np.diff(s) == 1).all()):
            return order, rec_buf[s[0]:s[-1] + 1], True
        return order, rec_buf[s], False  # fancy indexing: a copy of just these rows

    def decode(self, conv_buf: np.ndarray, rec_buf: np.ndarray, slots: np.ndarray, u: np.ndarray, g: np.ndarray,
               beta: np.ndarray, conv_w: np.ndarray) -> np.ndarray:
        """One token for each of B sequences; same contract as :func:`.gdn.gdn_decode` (returns o ``[B, nv*dv]``,
        a buffer valid until the next decode call)."""
        u, g, beta = (np.asarray(x, np.float32) for x in (u, g, beta))
        _check(conv_buf, rec_buf, u, g, beta, np.asarray(conv_w), *self.dims)
        idx = _check_slots(slots, conv_buf.shape[0], u.shape[0])
        B = len(idx)
        order, rec, in_place = self._rows(rec_buf, idx)
        s = idx[order]
        same = (order == np.arange(B)).all()
        u_, g_, b_ = (np.ascontiguousarray(x) if same else x[order] for x in (u, g, beta))
        conv_in = conv_buf[s]  # [B, K-1, C]: a small copy
        conv_out = np.empty_like(conv_in)
        if self._out.shape[0] < B:
            self._out = np.empty((B, self.cfg.value_dim), np.float32)
        o = self._out[:B]
        bd = self._decode
        for name, arr in (("u", u_), ("g", g_), ("beta", b_), ("conv_w", self._w(conv_w)), ("conv_in", conv_in),
                          ("rec", rec)):
            bd.input(name, arr)
        bd.output("o", o.reshape(B, 1, -1))
        bd.output("conv_out", conv_out)
        bd.output("rec_out", rec)
        bd.run()
        conv_buf[s] = conv_out
        if not in_place:
            rec_buf[s] = rec
        if not same:
            o[order] = o.copy()
        return o

    def prefill(self, conv_buf: np.ndarray, rec_buf: np.ndarray, slots: np.ndarray, bounds: np.ndarray,
                u: np.ndarray, g: np.ndarray, beta: np.ndarray, conv_w: np.ndarray) -> np.ndarray:
        """Chunks of B sequences (sequence i: tokens ``bounds[i]:bounds[i+1]``, at least one each), each
        continuing from its slot's state, like :func:`.gdn.gdn_prefill` per sequence. Returns ``[T, nv*dv]``."""
        u, g, beta = (np.asarray(x, np.float32) for x in (u, g, beta))
        _check(conv_buf, rec_buf, u, g, beta, np.asarray(conv_w), *self.dims)
        idx = _check_slots(slots, conv_buf.shape[0], len(bounds) - 1)
        bounds = np.asarray(bounds, np.int64)
        lens = np.diff(bounds)
        if (lens < 1).any() or bounds[0] != 0 or bounds[-1] != len(u):
            raise ValueError(f"bounds {bounds.tolist()} must split the {len(u)} tokens into non-empty chunks")
        B, T, Tmax = len(idx), len(u), int(lens.max())
        order, rec, in_place = self._rows(rec_buf, idx)
        s = idx[order]
        rank = np.empty(B, np.int64)
        rank[order] = np.arange(B)
        cu = np.concatenate([[0], np.cumsum(lens[order])]).astype(np.int32)
        seq = np.repeat(np.arange(B), lens)  # sequence (caller's order) of each packed token
        t = np.arange(T) - bounds[seq]  # position within its chunk
        packed = cu[rank[seq]] + t  # where each token goes in slot-ordered packing
        out_idx = rank[seq] * Tmax + t
        pad_idx = np.full(B * Tmax, T, np.int64)  # T = the zero row
        pad_idx[out_idx] = packed
        if (packed == np.arange(T)).all():
            u_, g_, b_ = (np.ascontiguousarray(x) for x in (u, g, beta))
        else:
            u_, g_, b_ = (np.empty_like(x) for x in (u, g, beta))
            u_[packed], g_[packed], b_[packed] = u, g, beta
        conv_in = np.ascontiguousarray(conv_buf[s].transpose(0, 2, 1))  # [B, C, K-1]
        conv_out = np.empty_like(conv_in)
        out = np.empty((T, self.cfg.value_dim), np.float32)
        bp = self._prefill
        for name, arr in (("u", u_), ("g", g_), ("beta", b_), ("conv_w", self._w(conv_w)), ("cu", cu),
                          ("conv_in", conv_in), ("rec", rec), ("pad_idx", pad_idx),
                          ("pad_shape", np.array([B, Tmax, -1], np.int64)), ("out_idx", out_idx)):
            bp.input(name, arr)
        bp.output("out", out)
        bp.output("conv_out", conv_out)
        bp.output("rec_out", rec)
        bp.run()
        conv_buf[s] = conv_out.transpose(0, 2, 1)
        if not in_place:
            rec_buf[s] = rec
        return out
