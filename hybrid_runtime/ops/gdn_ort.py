"""The Gated DeltaNet mixer through onnxruntime's kernels: conv window + gated delta rule of a whole batch
in one session run, for every linear-attention layer of a model (the conv weight is an input).

Math and buffers as in :mod:`.gdn` (whose numpy functions stay the oracle of the tests): ``u = [q | k | v]``
pre-conv channels, ``g``/``beta`` per value head; conv buffer ``[rows, K-1, C]`` (oldest first), recurrent
buffer ``[rows, nv, dk, dv]``. Two graphs:

* DECODE (one token per sequence): the conv as K multiply-adds over window ++ token, l2-normalised q/k,
  k repeated per value head, ``LinearAttention`` (``gated_delta``; query head ``j // (nv/nk)`` serves value
  head ``j``, the model's grouping).
* PREFILL (ragged chunks): each sequence's window ++ chunk laid out ``[B, K-1+Tmax]`` by one Gather, one
  depthwise ``Conv``, the new windows gathered from the same rows, and the chunked ``LinearAttention`` over
  ``[B, Tmax]`` with inert zero padding (q = k = v = 0, g = beta = 0 leave a state exactly as it was); the
  output is gathered back to packed order.

onnxruntime's own ``CausalConvWithState`` / ``VarlenCausalConvWithState`` (4-17x slower here) and
``GatedDeltaNet`` (10.5 ms vs 1.4 ms per b16 decode layer) were measured and are not used.

The recurrent state is updated in place: when the batch's slots, sorted, are one contiguous range, the
session reads and writes that range of the pool directly (the batch's token rows are put in slot order
instead, which costs a few KB); otherwise only the batch's rows are gathered into a scratch block and
scattered back. ``LinearAttention`` handles each (sequence, head) state on its own, reading it before
writing it, so input and output may be the same memory (``tests/unit/test_gdn_ort.py`` checks the result
against the numpy oracle, in place and not). The slot layout of a step is validated once and shared by
all its layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import onnx_proto as helper
from ..config import ModelConfig
from ..engine.ort_session import Binding, cpu_session, session_options
from .gdn import _check, _check_slots

_F, _I64 = helper.FLOAT, helper.INT64


def _vi(name: str, elem: int, shape: list) -> helper.ValueInfo:
    return helper.make_tensor_value_info(name, elem, shape)


class _Graph:
    """Node list with constants; names are unique per call site by construction."""

    def __init__(self) -> None:
        self.nodes: list[helper.Node] = []
        self.inits: list[helper.Tensor] = []

    def op(self, op_type: str, inputs: list[str], outputs: list[str], **attrs) -> None:
        domain = "com.microsoft" if op_type == "LinearAttention" else ""
        self.nodes.append(helper.make_node(op_type, inputs, outputs, domain=domain, **attrs))

    def const(self, name: str, arr: np.ndarray) -> str:
        self.inits.append(helper.from_array(np.asarray(arr), name))
        return name

    def model(self, name: str, ins: list, outs: list) -> helper.Model:
        g = helper.make_graph(self.nodes, name, ins, outs, self.inits)
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        return helper.make_model(g, opset_imports=opsets, ir_version=8)


def _silu(g: _Graph, x: str, out: str) -> None:
    g.op("Sigmoid", [x], [x + "_sig"])
    g.op("Mul", [x, x + "_sig"], [out])


def _qkv_and_attention(g: _Graph, cfg: ModelConfig, x3: str, gate3: str, beta3: str) -> None:
    """x3 ``[B, T, C]`` post-conv channels, gate3/beta3 ``[B, T, nv]`` -> node outputs ``o`` ``[B, T, nv*dv]``
    and ``rec_out`` (the updated state of input ``rec``)."""
    nk, dk, nv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads
    kd, vd, r = nk * dk, cfg.value_dim, nv // nk
    g.op("Split", [x3, g.const("split_qkv", np.array([2 * kd, vd], np.int64))], ["qk_raw", "v"], axis=2)
    # q and k heads side by side: x / sqrt(sum(x^2) + 1e-6) per head, as in ops.gdn._l2norm
    g.op("Reshape", ["qk_raw", g.const("qk_heads", np.array([0, 0, 2 * nk, dk], np.int64))], ["qk_h"])
    g.op("ReduceSumSquare", ["qk_h"], ["qk_ss"], axes=[-1], keepdims=1)
    g.op("Add", ["qk_ss", g.const("l2_eps", np.array(1e-6, np.float32))], ["qk_sse"])
    g.op("Sqrt", ["qk_sse"], ["qk_norm"])
    g.op("Div", ["qk_h", "qk_norm"], ["qk_n"])
    g.op("Split", ["qk_n", g.const("split_qk", np.array([nk, nk], np.int64))], ["q_n", "k_n"], axis=2)
    flat = g.const("flat_keys", np.array([0, 0, kd], np.int64))
    g.op("Reshape", ["q_n", flat], ["q"])
    if r > 1:  # key head j // r serves value head j: [B, T, nk, 1, dk] -> [B, T, nk, r, dk] -> [B, T, nv*dk]
        g.op("Unsqueeze", ["k_n", g.const("axis3", np.array([3], np.int64))], ["k_u"])
        g.op("Expand", ["k_u", g.const("rep_shape", np.array([1, 1, 1, r, 1], np.int64))], ["k_e"])
        g.op("Reshape", ["k_e", g.const("flat_rep", np.array([0, 0, nv * dk], np.int64))], ["k"])
    else:
        g.op("Reshape", ["k_n", flat], ["k"])
    # chunk_size 64 = scheduler.PREFILL_ALIGN: prompts are cut at chunk boundaries, so a token's result does not
    # depend on where its prompt was split (the chunks of a call start at its first token)
    g.op("LinearAttention", ["q", "k", "v", "rec", gate3, beta3], ["o", "rec_out"], q_num_heads=nk, kv_num_heads=nv,
         update_rule="gated_delta", scale=float(1.0 / np.sqrt(dk)), chunk_size=64)


def _dims(cfg: ModelConfig) -> tuple[int, int, int, int, int]:
    return (cfg.conv_dim, cfg.conv_kernel, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim)


def decode_graph(cfg: ModelConfig) -> helper.Model:
    """u ``[B, 1, C]``, g/beta ``[B, 1, nv]``, conv_wt ``[K, C]``, conv_in ``[B, K-1, C]``, rec ``[B, nv, dk, dv]``
    -> o ``[B, 1, nv*dv]``, conv_out ``[B, K-1, C]``, rec_out (= rec's shape).

    The conv of one new token is K multiply-adds per channel: window ++ token, times the taps, summed
    (onnxruntime's CausalConvWithState took 66 us at B=1 and 0.7 ms at B=16 for this; these nodes ~10 us)."""
    C, K, nv, dk, dv = _dims(cfg)
    g = _Graph()
    g.op("Concat", ["conv_in", "u"], ["win"], axis=1)  # [B, K, C], oldest first
    g.op("Mul", ["win", "conv_wt"], ["taps"])
    g.op("ReduceSum", ["taps", g.const("axis1", np.array([1], np.int64))], ["pre"], keepdims=1)
    _silu(g, "pre", "x3")
    g.op("Slice", ["win", g.const("one", np.array([1], np.int64)), g.const("kk", np.array([K], np.int64)),
                   g.const("axis1b", np.array([1], np.int64))], ["conv_out"])
    _qkv_and_attention(g, cfg, "x3", "g", "beta")
    ins = [_vi("u", _F, ["B", 1, C]), _vi("g", _F, ["B", 1, nv]), _vi("beta", _F, ["B", 1, nv]),
           _vi("conv_wt", _F, [K, C]), _vi("conv_in", _F, ["B", K - 1, C]), _vi("rec", _F, ["B", nv, dk, dv])]
    outs = [_vi("o", _F, ["B", 1, nv * dv]), _vi("conv_out", _F, ["B", K - 1, C]),
            _vi("rec_out", _F, ["B", nv, dk, dv])]
    return g.model("gdn_decode", ins, outs)


def prefill_graph(cfg: ModelConfig) -> helper.Model:
    """Ragged chunks laid out ``[B, W = K-1+Tmax]`` by index (rows: ``conv_in`` rows, then the tokens, then a
    zero row): u ``[T, C]``, g/beta ``[T, nv]``, conv_w ``[C, 1, K]``, conv_in ``[B, K-1, C]``, rec, win_idx
    ``[B*W]`` (each sequence's window then tokens then zeros), state_idx ``[B*(K-1)]`` (its new window),
    pad_idx ``[B*Tmax]`` (rows of g/beta, T = zero), shapes ``win_shape [B, W, C]``, ``pad_shape
    [B, Tmax, 2nv]``, ``state_shape [B, K-1, C]``, out_idx ``[T]`` (padded row of each token) -> out
    ``[T, nv*dv]``, conv_out ``[B, K-1, C]``, rec_out. The conv is one depthwise Conv over the padded
    windows (onnxruntime's VarlenCausalConvWithState took 3.9 ms for 128 tokens of the benchmark model,
    this 0.9 ms)."""
    C, K, nv, dk, dv = _dims(cfg)
    g = _Graph()
    g.op("Reshape", ["conv_in", g.const("rows_shape", np.array([-1, C], np.int64))], ["win_rows"])
    g.op("Concat", ["win_rows", "u", g.const("zero_u", np.zeros((1, C), np.float32))], ["rows"], axis=0)
    g.op("Gather", ["rows", "win_idx"], ["win_flat"], axis=0)
    g.op("Reshape", ["win_flat", "win_shape"], ["win"])  # [B, W, C]
    g.op("Transpose", ["win"], ["win_t"], perm=[0, 2, 1])
    g.op("Conv", ["win_t", "conv_w"], ["pre_t"], group=C, kernel_shape=[K])  # [B, C, Tmax]
    g.op("Transpose", ["pre_t"], ["pre"], perm=[0, 2, 1])
    _silu(g, "pre", "x3")
    g.op("Gather", ["rows", "state_idx"], ["state_flat"], axis=0)
    g.op("Reshape", ["state_flat", "state_shape"], ["conv_out"], allowzero=1)  # K = 1: a [B, 0, C] window
    g.op("Concat", ["g", "beta", ], ["gb"], axis=1)
    g.op("Concat", ["gb", g.const("zero_gb", np.zeros((1, 2 * nv), np.float32))], ["gb_rows"], axis=0)
    g.op("Gather", ["gb_rows", "pad_idx"], ["gb_flat"], axis=0)
    g.op("Reshape", ["gb_flat", "pad_shape"], ["gb3"])
    g.op("Split", ["gb3", g.const("split_gb", np.array([nv, nv], np.int64))], ["g3", "beta3"], axis=2)
    _qkv_and_attention(g, cfg, "x3", "g3", "beta3")
    g.op("Reshape", ["o", g.const("flat_out", np.array([-1, nv * dv], np.int64))], ["o_rows"])
    g.op("Gather", ["o_rows", "out_idx"], ["out"], axis=0)
    ins = [_vi("u", _F, ["T", C]), _vi("g", _F, ["T", nv]), _vi("beta", _F, ["T", nv]), _vi("conv_w", _F, [C, 1, K]),
           _vi("conv_in", _F, ["B", K - 1, C]), _vi("rec", _F, ["B", nv, dk, dv]), _vi("win_idx", _I64, ["BW"]),
           _vi("state_idx", _I64, ["BK"]), _vi("pad_idx", _I64, ["BT"]), _vi("win_shape", _I64, [3]),
           _vi("pad_shape", _I64, [3]), _vi("state_shape", _I64, [3]), _vi("out_idx", _I64, ["T"])]
    outs = [_vi("out", _F, ["T", nv * dv]), _vi("conv_out", _F, ["B", K - 1, C]), _vi("rec_out", _F, ["B", nv, dk, dv])]
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
        # decode outputs per (B, pool shape): (o [B, nv*dv], o as [B, 1, nv*dv], conv_out [B, K-1, C]), views of
        # one (o, conv_out) pair per pool shape (a buffer per batch size held 7 MiB for the 334M model's 16)
        self._out_views: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._out_base: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._last: _Plan | None = None  # the previous call's slot plan (every layer of a step shares it)
        # id(conv_w) -> (conv_w, [C, 1, K], [K, C]); holding conv_w keeps its id from being reused
        self._taps_cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _taps(self, conv_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """conv_w ``[C, K]`` as ``[C, 1, K]`` (prefill's Conv) and ``[K, C]`` (decode's taps), made once per layer."""
        hit = self._taps_cache.get(id(conv_w))
        if hit is None or hit[0] is not conv_w:
            w = np.ascontiguousarray(conv_w, np.float32)
            hit = self._taps_cache[id(conv_w)] = (conv_w, w.reshape(w.shape[0], 1, -1), np.ascontiguousarray(w.T))
        return hit[1], hit[2]

    def _plan(self, rows: int, slots: np.ndarray, bounds: np.ndarray | None) -> _Plan:
        """The layout of this batch's slots (and chunks), validated once and reused by every layer of a step:
        the runner calls each layer with the same slots."""
        key = (rows, tuple(slots.tolist()) if isinstance(slots, np.ndarray) else tuple(slots),
               None if bounds is None else tuple(np.asarray(bounds).tolist()))
        if self._last is not None and self._last.key == key:
            return self._last
        B = len(key[1]) if bounds is None else len(key[2]) - 1
        idx = _check_slots(np.asarray(slots), rows, B)
        order = np.argsort(idx, kind="stable")
        s = idx[order]
        lo = int(s[0]) if B and int(s[-1]) - int(s[0]) + 1 == B and (B == 1 or (np.diff(s) == 1).all()) else None
        plan = _Plan(key, s, None if (order == np.arange(B)).all() else order, lo)
        if bounds is not None:
            plan.prefill_indices(np.asarray(bounds, np.int64), order, self.cfg.conv_kernel, self.cfg.conv_dim)
        self._last = plan
        return plan

    @staticmethod
    def _gather(buf: np.ndarray, plan: _Plan) -> np.ndarray:
        """The batch's rows of a state buffer in slot order: a view of the pool when they are one range."""
        return buf[plan.lo:plan.lo + len(plan.s)] if plan.lo is not None else buf[plan.s]

    @staticmethod
    def _scatter(buf: np.ndarray, plan: _Plan, rows: np.ndarray) -> None:
        if plan.lo is not None:
            buf[plan.lo:plan.lo + len(plan.s)] = rows
        else:
            buf[plan.s] = rows

    def decode(self, conv_buf: np.ndarray, rec_buf: np.ndarray, slots: np.ndarray, u: np.ndarray, g: np.ndarray,
               beta: np.ndarray, conv_w: np.ndarray) -> np.ndarray:
        """One token for each of B sequences; same contract as :func:`.gdn.gdn_decode` (returns o ``[B, nv*dv]``,
        a buffer valid until the next decode call)."""
        u, g, beta = (np.asarray(x, np.float32) for x in (u, g, beta))
        _check(conv_buf, rec_buf, u, g, beta, np.asarray(conv_w), *self.dims)
        plan = self._plan(conv_buf.shape[0], slots, None)
        B, order = len(plan.s), plan.order
        if order is not None:  # token rows into slot order (a few KB), so the states can stay in place
            u, g, beta = u[order], g[order], beta[order]
        rec = self._gather(rec_buf, plan)
        o = self._out_views.get((B, *conv_buf.shape))
        if o is None:  # views of one buffer per pool shape, the same objects every call: no rebinding
            base = self._out_base.get(conv_buf.shape)
            if base is None:  # as many rows as the pool (B <= its slots): one buffer for every batch size
                rows = conv_buf.shape[0]
                base = self._out_base[conv_buf.shape] = (np.empty((rows, self.cfg.value_dim), np.float32),
                                                         np.empty(conv_buf.shape, np.float32))
            o = self._out_views[(B, *conv_buf.shape)] = (base[0][:B], base[0][:B].reshape(B, 1, -1), base[1][:B])
        conv_out = o[2]
        bd = self._decode
        for name, arr in (("u", u), ("g", g), ("beta", beta)):
            bd.input(name, np.ascontiguousarray(arr).reshape(B, 1, -1))
        bd.input("conv_wt", self._taps(conv_w)[1])
        bd.input("conv_in", self._gather(conv_buf, plan))
        bd.input("rec", rec)
        bd.output("o", o[1])
        bd.output("conv_out", conv_out)
        bd.output("rec_out", rec)
        bd.run()
        self._scatter(conv_buf, plan, conv_out)
        if plan.lo is None:
            self._scatter(rec_buf, plan, rec)
        if order is not None:
            o[0][order] = o[0].copy()
        return o[0]

    def prefill(self, conv_buf: np.ndarray, rec_buf: np.ndarray, slots: np.ndarray, bounds: np.ndarray,
                u: np.ndarray, g: np.ndarray, beta: np.ndarray, conv_w: np.ndarray) -> np.ndarray:
        """Chunks of B sequences (sequence i: tokens ``bounds[i]:bounds[i+1]``, at least one each), each
        continuing from its slot's state, like :func:`.gdn.gdn_prefill` per sequence. Returns ``[T, nv*dv]``.

        Runs in blocks of at most :data:`_BLOCK_TOKENS` padded tokens (windows of whole 64-token chunks of
        a few sequences), which bounds the session's intermediates; a window boundary is a chunk boundary
        and the state carries over exactly, so blocking changes no bit of the result."""
        u, g, beta = (np.ascontiguousarray(x, np.float32) for x in (u, g, beta))
        _check(conv_buf, rec_buf, u, g, beta, np.asarray(conv_w), *self.dims)
        bounds = np.asarray(bounds, np.int64)
        if len(bounds) < 2 or (np.diff(bounds) < 1).any() or bounds[0] != 0 or bounds[-1] != len(u):
            raise ValueError(f"bounds {bounds.tolist()} must split the {len(u)} tokens into non-empty chunks")
        plan = self._plan(conv_buf.shape[0], slots, bounds)
        rec = self._gather(rec_buf, plan)  # [B, ...] in slot order: the pool's rows or a copy of them
        conv = np.ascontiguousarray(self._gather(conv_buf, plan))  # working windows, slot order (small)
        out = np.empty((len(u), self.cfg.value_dim), np.float32)
        bp = self._prefill
        taps = self._taps(conv_w)[0]
        for blk in plan.blocks:
            for name, arr in (("u", u), ("g", g), ("beta", beta), ("conv_w", taps)):
                bp.input(name, arr)  # rebound only when a large input was let go after the last run
            j0, j1 = blk.rows
            conv_in = conv[j0:j1] if blk.seqs is None else conv[blk.seqs]
            rec_in = rec[j0:j1] if blk.seqs is None else rec[blk.seqs]
            conv_out, o = np.empty_like(conv_in), np.empty((len(blk.tokens), self.cfg.value_dim), np.float32)
            bp.input("conv_in", conv_in)
            bp.input("rec", rec_in)
            for name, arr in blk.indices.items():
                bp.input(name, arr)
            bp.output("out", o)
            bp.output("conv_out", conv_out)
            bp.output("rec_out", rec_in)
            bp.run()
            if blk.seqs is None:
                conv[j0:j1] = conv_out
            else:
                conv[blk.seqs], rec[blk.seqs] = conv_out, rec_in
            out[blk.tokens] = o
        self._scatter(conv_buf, plan, conv)
        if plan.lo is None:
            self._scatter(rec_buf, plan, rec)
        return out


# Padded tokens (sequences x window) of one prefill run: bounds the session's intermediates (about 80 MB
# for 4 x 128 tokens of the 334M benchmark model in one run; about 20 MB per 128).
_BLOCK_TOKENS = 128
_WINDOW = 128  # tokens of a sequence per block: whole 64-token delta-rule chunks


@dataclass(slots=True)
class _Block:
    """One prefill run: padded rows ``rows`` = (j0, j1) of the slot-ordered batch, or ``seqs`` (their
    indices) when not one range; ``tokens`` = packed rows of its outputs; ``indices`` = index inputs."""

    rows: tuple[int, int]
    seqs: np.ndarray | None
    tokens: np.ndarray
    indices: dict[str, np.ndarray]


@dataclass(slots=True)
class _Plan:
    """Slots of one batch: ``s`` in slot order (state row j is slot ``s[j]``); ``order[j]`` = the caller's
    row of slot row j (None: already in order); ``lo`` = first slot when ``s`` is one range (state rows
    then used in place), else None; ``blocks``: the prefill runs."""

    key: tuple
    s: np.ndarray
    order: np.ndarray | None
    lo: int | None
    blocks: list[_Block] = field(default_factory=list)

    def prefill_indices(self, bounds: np.ndarray, order: np.ndarray, K: int, C: int) -> None:
        """The blocks of :meth:`OrtGdn.prefill` for chunks ``bounds`` (caller's order), rows in slot order:
        token windows of :data:`_WINDOW`, each over groups of the sequences that have tokens in it."""
        lens = np.diff(bounds)[order]  # slot order
        start = bounds[:-1][order]
        T = int(bounds[-1])
        group = max(1, _BLOCK_TOKENS // _WINDOW)
        for w0 in range(0, int(lens.max()), _WINDOW):
            active = np.flatnonzero(lens > w0)
            for a in range(0, len(active), group):
                js = active[a:a + group]
                n = np.minimum(lens[js] - w0, _WINDOW)[:, None]  # tokens of each sequence in the window
                first = (start[js] + w0)[:, None]  # packed row of each one's first token in the window
                contiguous = bool(js[-1] - js[0] + 1 == len(js))
                self.blocks.append(_Block((int(js[0]), int(js[-1]) + 1), None if contiguous else js,
                                          *_block_indices(n, first, T, K, C)))


def _block_indices(n: np.ndarray, first: np.ndarray, T: int, K: int, C: int
                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Index inputs of :func:`prefill_graph` for b sequences with ``n [b, 1]`` tokens starting at packed rows
    ``first [b, 1]`` (inputs: their windows, then all T tokens, then a zero row), and the packed rows of
    the block's outputs."""
    b, Tmax = len(n), int(n.max())
    first_tok, zero = b * (K - 1), b * (K - 1) + T  # rows of [window rows | tokens | zero row]
    j = np.arange(b)[:, None]

    def row(p: np.ndarray) -> np.ndarray:  # row index of position p of (window ++ chunk) of padded row j
        return np.where(p < K - 1, j * (K - 1) + p, np.where(p < K - 1 + n, first_tok + first + p - (K - 1), zero))

    t = np.arange(Tmax)[None, :]
    valid = t < n
    tokens = (first + t)[valid]
    return tokens, {
        "win_idx": row(np.arange(K - 1 + Tmax)[None, :]).reshape(-1),
        "state_idx": row(n + np.arange(K - 1)[None, :]).reshape(-1),  # the last K-1 of window ++ chunk
        "pad_idx": np.where(valid, first + t, T).reshape(-1),
        "win_shape": np.array([b, K - 1 + Tmax, -1], np.int64),
        "pad_shape": np.array([b, Tmax, -1], np.int64),
        "state_shape": np.array([b, K - 1, C], np.int64),
        "out_idx": (j * Tmax + t)[valid],
    }
