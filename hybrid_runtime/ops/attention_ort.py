"""Causal attention over the paged KV cache through onnxruntime: every query of a step in one run.

One graph serves decode (one query per sequence, behind the guarded dispatcher with the numpy kernels'
``kernel(plan, q, k_buf, v_buf, page_tables, context_lens)`` signature) and prefill (the chunks of all
sequences of a step, padded to the longest). Keys are cut into fixed chunks of :data:`CHUNK` positions
counted from position 0; each chunk gives a partial (row max, sum-exp, normalised output) and the partials
are merged by log-sum-exp, as split-KV decode computes them. Because the chunks are fixed by position, a
query's result does not depend on the plan, on the other queries of the step or on how its prompt was
split into prefill chunks: a token's attention has the same bits alone and in any batch (batch invariance
of sampled tokens needs that). The dispatcher's plan (single-block or split-KV, and how many blocks) is
validated and counted as on a GPU; on the CPU it changes how work would be split, not the arithmetic.

K and V rows are gathered from the pools head by head, ``[B, Hkv, L, hd]``, so no transpose of them is
needed; scores are computed keys x queries (``K Q^T``), 64 key rows against the step's queries. MLAS
gives a GEMM row or column different last bits when the other side has a single row or column, so a
query group of one head (no GQA) is fed twice. Positions past a sequence's context or after a query are
masked with a large finite negative number, so a fully masked chunk has merge weight exactly 0 (no NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import onnx_proto as helper
from ..engine.ort_session import Binding, cpu_session, session_options
from .dispatcher import MULTI, SINGLE, Kernel, LaunchPlan

CHUNK = 64  # key positions per partial
_MASKED = np.float32(-1e30)
# Bounds on the largest intermediates of one run (all come from the process's shared onnxruntime arena):
# the per-chunk outputs B * Hkv * (L / CHUNK) * queries * G * hd floats (longer prefills run in blocks of
# queries; a query's result does not depend on its block), and the keys and values gathered for B sequences,
# B * Hkv * L * hd floats each (a decode step of many long sequences runs in blocks of sequences), 2 MB each.
# Unbounded, a b16 decode step at 192 tokens gathered 2 x 6 MB per layer, and each new batch size extended the
# arena by a region of its own (+47 MB at 128-token prefill chunks of the 334M model); partials of 4 MB put
# 8 MB on the peak RSS of a 4 x 256 prefill.
_MAX_PARTIALS = 1 << 19
_MAX_GATHER = 1 << 19


def _graph(H: int, Hkv: int, hd: int, G2: int) -> helper.Model:
    """q ``[B, Tq, H, hd]``, scale, k_rows/v_rows ``[rows, hd]`` (pool rows (page*ps + offset)*Hkv + head),
    kidx ``[B, Hkv, L]``, mask ``[B, 1, nc, CHUNK, Tq*G2]``, kv_shape = (B, Hkv, nc, CHUNK, hd),
    q_shape = (B, Tq, Hkv, G, hd) -> out ``[B, Tq, H, hd]``. ``G2`` = G, or 2G when G == 1 (queries doubled)."""
    G = H // Hkv
    nodes: list[helper.Node] = []
    inits = [helper.from_array(np.array(v, np.int64), n) for n, v in
             (("axis3", [3]), ("axis2", [2]), ("flat_g", [0, 0, 1, hd, -1]), ("out_shape", [0, 0, H, hd]))]

    def op(op_type: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op_type, inputs, [output], **attrs))
        return output

    op("Mul", ["q", "scale"], "qs")
    op("Reshape", ["qs", "q_shape"], "q5")  # [B, Tq, Hkv, G, hd]
    if G2 != G:
        op("Concat", ["q5", "q5"], "q5d", axis=3)  # [B, Tq, Hkv, 2, hd]
    op("Transpose", ["q5d" if G2 != G else "q5"], "qt", perm=[0, 2, 4, 1, 3])  # [B, Hkv, hd, Tq, G2]
    op("Reshape", ["qt", "flat_g"], "qcols")  # [B, Hkv, 1, hd, Tq*G2]
    for name in ("k", "v"):
        op("Gather", [f"{name}_rows", "kidx"], f"{name}_g", axis=0)  # [B, Hkv, L, hd]
        op("Reshape", [f"{name}_g", "kv_shape"], f"{name}c")  # [B, Hkv, nc, CHUNK, hd]
    op("MatMul", ["kc", "qcols"], "st")  # [B, Hkv, nc, CHUNK, Tq*G2]: scores, keys x queries
    op("Add", ["st", "mask"], "sm")
    op("ReduceMax", ["sm"], "m", axes=[3], keepdims=1)  # [B, Hkv, nc, 1, TqG2] per-chunk max
    op("Sub", ["sm", "m"], "sc")
    op("Exp", ["sc"], "p")
    op("ReduceSum", ["p", "axis3"], "l", keepdims=1)  # sum-exp per chunk
    op("Transpose", ["p"], "pt", perm=[0, 1, 2, 4, 3])  # [B, Hkv, nc, TqG2, CHUNK]
    op("MatMul", ["pt", "vc"], "ov")  # [B, Hkv, nc, TqG2, hd]
    op("ReduceMax", ["m"], "mm", axes=[2], keepdims=1)  # merge over chunks
    op("Sub", ["m", "mm"], "dm")
    op("Exp", ["dm"], "edm")
    op("Transpose", ["edm"], "edm_t", perm=[0, 1, 2, 4, 3])  # [B, Hkv, nc, TqG2, 1]: e^(m_c - M)
    op("Mul", ["ov", "edm_t"], "wov")  # each chunk's unnormalised output, rescaled to the common max
    op("ReduceSum", ["wov", "axis2"], "num", keepdims=0)  # [B, Hkv, TqG2, hd], chunks in order
    op("Mul", ["l", "edm"], "w")  # sum-exp rescaled; exactly 0 for a fully masked chunk
    op("Transpose", ["w"], "wt", perm=[0, 1, 2, 4, 3])
    op("ReduceSum", ["wt", "axis2"], "den", keepdims=0)  # [B, Hkv, TqG2, 1]
    op("Div", ["num", "den"], "o4")
    op("Reshape", ["o4", "o_shape"], "o5")  # [B, Hkv, Tq, G2, hd]
    if G2 != G:
        op("Slice", ["o5", "zero", "one", "axis3"], "o5s")
        inits += [helper.from_array(np.array(v, np.int64), n) for n, v in (("zero", [0]), ("one", [1]))]
    op("Transpose", ["o5s" if G2 != G else "o5"], "ot", perm=[0, 2, 1, 3, 4])  # [B, Tq, Hkv, G, hd]
    op("Reshape", ["ot", "out_shape"], "out")
    vi = helper.make_tensor_value_info
    f, i64 = helper.FLOAT, helper.INT64
    ins = [vi("q", f, ["B", "Tq", H, hd]), vi("scale", f, []), vi("k_rows", f, ["R", hd]), vi("v_rows", f, ["R", hd]),
           vi("kidx", i64, ["B", Hkv, "L"]), vi("mask", f, ["B", 1, "nc", CHUNK, "TqG"]), vi("kv_shape", i64, [5]),
           vi("q_shape", i64, [5]), vi("o_shape", i64, [5])]
    graph = helper.make_graph(nodes, "paged_attention", ins, [vi("out", f, ["B", "Tq", H, hd])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


class OrtAttention:
    """Paged causal attention for one head layout (``H`` query heads over ``Hkv`` kv heads of ``hd``).
    :meth:`kernels` is what :class:`~.dispatcher.DecodeAttentionDispatcher` takes; :meth:`prefill`
    serves the prefill chunks of a step. Owned by one engine thread, like the caches it reads."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, intra_op_threads: int | None = None) -> None:
        self.H, self.Hkv, self.hd = num_heads, num_kv_heads, head_dim
        self.G = num_heads // num_kv_heads
        self.G2 = self.G if self.G > 1 else 2
        self._bd = Binding(cpu_session(_graph(self.H, self.Hkv, self.hd, self.G2), session_options(intra_op_threads)))
        self._scale = np.array(1.0 / np.sqrt(head_dim), np.float32)
        self._last: tuple | None = None  # (key, blocks) of the last call: the layers of a step share them
        self._outs: dict[tuple[int, int], np.ndarray] = {}  # (B, 1) -> decode output, valid until the next call
        self._decode_out = np.empty((0, num_heads, head_dim), np.float32)  # decode outputs are views of this
        self._prefill_out = np.empty(0, np.float32)  # prefill outputs are views of this (grown, never shrunk)

    def kernels(self) -> dict[str, Kernel]:
        """Both dispatcher kernels; they compute the same fixed-chunk partials whatever the plan."""
        return {SINGLE: self._decode_kernel, MULTI: self._decode_kernel}

    def _decode_kernel(self, plan: LaunchPlan, q: np.ndarray, k_buf: np.ndarray, v_buf: np.ndarray,
                       page_tables: Sequence, context_lens: Sequence[int]) -> np.ndarray:
        """``q [B, H, hd]`` (the newest token of each sequence, already in the cache) -> ``[B, H, hd]``."""
        lens = np.asarray(context_lens, np.int64)
        return self.attend(q[:, None], k_buf, v_buf, page_tables, lens, lens - 1, np.ones(len(lens), np.int64))[:, 0]

    def prefill(self, q: np.ndarray, k_buf: np.ndarray, v_buf: np.ndarray, page_tables: Sequence,
                start_pos: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """Packed chunk queries ``q [T, H, hd]`` (sequence i: rows ``bounds[i]:bounds[i+1]`` at positions
        ``start_pos[i]..``), their K/V already written -> ``[T, H, hd]``."""
        lens = np.diff(bounds)
        B, Tmax = len(lens), int(lens.max())
        t = np.arange(Tmax)[None, :]
        rows = np.minimum(bounds[:-1, None] + t, bounds[-1] - 1)  # padded query rows (padding repeats a row)
        qp = q[rows]  # [B, Tmax, H, hd]
        out = np.empty_like(q, dtype=np.float32)
        done = 0
        chunks = -(-int((start_pos + lens).max()) // CHUNK)
        block = max(1, min(Tmax, _MAX_PARTIALS // (B * self.Hkv * chunks * self.G2 * self.hd)))
        while done < Tmax:
            n = min(block, Tmax - done)
            cnt = np.clip(lens - done, 0, n)  # real queries of each sequence in this block
            o = self.attend(qp[:, done:done + n], k_buf, v_buf, page_tables, start_pos + done + cnt,
                            start_pos + done, cnt)
            valid = t[:, :n] < cnt[:, None]
            out[rows[:, done:done + n][valid]] = o[valid]
            done += n
        return out

    def _indices(self, B: int, Tq: int, ps: int, page_tables: Sequence, key_lens: np.ndarray, first_pos: np.ndarray,
                 num_q: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """(kidx ``[B, Hkv, L]`` pool rows of the keys, mask ``[B, 1, nc, CHUNK, Tq*G2]``, the shape inputs)."""
        Hkv = self.Hkv
        nc = max(1, -(-int(key_lens.max()) // CHUNK))
        L = nc * CHUNK
        pages = -(-L // ps)
        table = np.zeros((B, pages), np.int64)  # past a table's end: page 0, masked below
        for b, pt in enumerate(page_tables):  # bookkeeping only: B small lists into one array
            n = min(len(pt), pages)
            table[b, :n] = pt[:n]
        pos = np.arange(L)
        tok = np.take(table, pos // ps, axis=1) * ps + pos % ps  # [B, L] pool token of each key position
        kidx = np.ascontiguousarray(tok[:, None, :] * Hkv + np.arange(Hkv)[None, :, None])  # [B, Hkv, L]
        qpos = first_pos[:, None] + np.arange(Tq)[None, :]  # [B, Tq]
        visible = (pos[None, :, None] <= qpos[:, None, :]) & (pos[None, :, None] < key_lens[:, None, None])
        visible &= np.arange(Tq)[None, None, :] < num_q[:, None, None]  # padding queries see nothing
        mask = np.where(visible, np.float32(0), _MASKED)  # [B, L, Tq]
        mask = np.repeat(mask, self.G2, axis=2).reshape(B, 1, nc, CHUNK, Tq * self.G2)
        shapes = {"kv_shape": np.array([B, Hkv, nc, CHUNK, self.hd], np.int64),
                  "q_shape": np.array([B, Tq, Hkv, self.G, self.hd], np.int64),
                  "o_shape": np.array([B, Hkv, Tq, self.G2, self.hd], np.int64)}
        return kidx, np.ascontiguousarray(mask), shapes

    def _blocks(self, B: int, Tq: int, ps: int, page_tables: Sequence, key_lens: np.ndarray, first_pos: np.ndarray,
                num_q: np.ndarray) -> list[tuple[int, int, np.ndarray, np.ndarray, dict[str, np.ndarray]]]:
        """The sequences of a call in runs of consecutive ones whose gathered keys (``[b, Hkv, L, hd]``, L their
        longest context in whole chunks) stay within :data:`_MAX_GATHER` floats, each with its indices."""
        per_pos = self.Hkv * self.hd
        chunks = np.maximum(1, -(-key_lens // CHUNK))
        out, b0 = [], 0
        while b0 < B:
            b1, longest = b0 + 1, int(chunks[b0])
            while b1 < B and (b1 + 1 - b0) * max(longest, int(chunks[b1])) * CHUNK * per_pos <= _MAX_GATHER:
                longest = max(longest, int(chunks[b1]))
                b1 += 1
            out.append((b0, b1, *self._indices(b1 - b0, Tq, ps, page_tables[b0:b1], key_lens[b0:b1],
                                               first_pos[b0:b1], num_q[b0:b1])))
            b0 = b1
        return out

    def attend(self, q: np.ndarray, k_buf: np.ndarray, v_buf: np.ndarray, page_tables: Sequence,
               key_lens: np.ndarray, first_pos: np.ndarray, num_q: np.ndarray) -> np.ndarray:
        """Queries ``q [B, Tq, H, hd]``: query ``t < num_q[b]`` of sequence b sits at ``first_pos[b] + t`` and
        sees keys ``0..min(its position, key_lens[b]-1)``; pools ``[pages, ps, Hkv, hd]`` -> ``[B, Tq, H, hd]``, a
        buffer valid until the next call. One run per block of sequences (:meth:`_blocks`): a sequence's
        result does not depend on the others of its run, so the blocks change no bit."""
        B, Tq = q.shape[:2]
        ps, Hkv, hd = k_buf.shape[1], self.Hkv, self.hd
        key = (B, Tq, ps, key_lens.tobytes(), first_pos.tobytes(), num_q.tobytes(),
               tuple(len(t) for t in page_tables), b"".join(np.asarray(t, np.int64).tobytes() for t in page_tables))
        if self._last is None or self._last[0] != key:  # the layers of a step share these
            self._last = (key, self._blocks(B, Tq, ps, list(page_tables), key_lens, first_pos, num_q))
        out = self._outs.get((B, Tq))
        if out is None and Tq > 1:  # prefill: a view of one buffer grown to the largest step (a buffer per
            n = B * Tq * self.H * hd  # (batch, chunk) shape would only grow over a server's life)
            if self._prefill_out.size < n:
                self._prefill_out = np.empty(n, np.float32)
            out = self._prefill_out[:n].reshape(B, Tq, self.H, hd)
        elif out is None:  # decode: a view per batch size of one buffer (the same object every call: no rebinding)
            if len(self._decode_out) < B:  # grown by doubling; the views of the old buffer are dropped
                self._decode_out = np.empty((max(B, 2 * len(self._decode_out)), self.H, hd), np.float32)
                self._outs.clear()
            out = self._outs[(B, Tq)] = self._decode_out[:B].reshape(B, Tq, self.H, hd)
        bd = self._bd
        rows = (k_buf.shape[0] * ps * Hkv, hd)
        q = np.ascontiguousarray(q, np.float32)
        for b0, b1, kidx, mask, shapes in self._last[1]:
            whole = b0 == 0 and b1 == B  # (the very arrays: nothing to rebind in a decode step of one block)
            for name, arr in (("q", q if whole else q[b0:b1]), ("scale", self._scale),
                              ("k_rows", k_buf.reshape(rows)), ("v_rows", v_buf.reshape(rows)),
                              ("kidx", kidx), ("mask", mask), *shapes.items()):
                bd.input(name, arr)
            bd.output("out", out if whole else out[b0:b1])
            bd.run()
        return out
