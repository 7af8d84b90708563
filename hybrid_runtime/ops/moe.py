"""Sparse MoE FFN on the host: one onnxruntime session per MoE layer, routing and experts in one run.

The graph routes every token (softmax over all experts, top-k, renormalised when ``norm_topk_prob``),
sorts the (token, expert) pairs by expert, splits them into one group per expert and runs each group
through that expert's SwiGLU as two GEMMs against constant weights, then weights, un-sorts and sums the
k results per token and adds the gated shared expert. Only the routed experts do work: an expert
without tokens gets an empty group (its nodes run on zero rows and read no weights), so the cost grows
with top-k and not with the expert count; there is no Python loop over experts or tokens.

Why not onnxruntime's ``com.microsoft.MoE`` kernel (measured on the 334M benchmark model): it does not
prepack its weights, so every expert GEMM of two or more rows re-packs 3 MB of weights (3.6 ms per layer
at 16 tokens), and a one-row GEMM takes a GEMV path whose last bits differ, so a token's output
depended on how many other tokens shared its expert (batch invariance of sampled tokens broke). Constant
weights are prepacked once by MLAS, whose GEMMs give every row the same bits whatever the row count.

Weights come from the bundle's state weights: ``experts.gate_up_proj [E, 2I, H]`` (per expert the gate
rows, then the up rows: transformers' fused layout), ``experts.down_proj [E, H, I]``, the router
``gate [E, H]`` and the shared expert. With a :class:`SafetensorsFile` the session reads them from the
file as ONNX external data (no Python-side copy; after prepacking onnxruntime keeps only its packed copy).

GPTQ bundles store the experts' and the shared expert's projections in ``com.microsoft.MatMulNBits``
layout (``<weight>.nbits_B`` / ``nbits_scales`` / ``nbits_zp`` / ``nbits_perm`` / ``nbits_meta``, see
:mod:`hybrid_runtime.quant`); their GEMMs become MatMulNBits nodes over the same external data (an act-order
weight first gathers its input columns). The router and the shared-expert gate stay float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from .. import onnx_proto as helper
from ..config import BundleError, ModelConfig
from ..engine.ort_session import Binding, cpu_session, session_options
from ..quant import nbits_dequantize
from ..weights_io import SafetensorsFile

# Outputs up to this many tokens go to a buffer the layer keeps (a decode step allocates nothing);
# larger ones (prefill chunks) are allocated per call, so no layer holds a prefill-sized buffer.
_KEEP_TOKENS = 64


def fuse_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``gate``, ``up`` ``[E, I, H]`` -> ``[E, 2I, H]``: per expert the gate rows, then the up rows."""
    return np.concatenate([gate, up], axis=1)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _external(name: str, shape: list[int], dtype: int = helper.FLOAT) -> helper.Tensor:
    """An initializer whose data comes from outside the graph (a file range, or an in-memory array)."""
    return helper.external_tensor(name, shape, dtype)


def _const(name: str, values: list, dtype: type = np.int64) -> helper.Tensor:
    return helper.from_array(np.array(values, dtype), name)


_QUANT_DTYPES = {"B": helper.UINT8, "s": helper.FLOAT, "z": helper.UINT8, "p": helper.INT64}
_FILE_DTYPES = {helper.FLOAT: "F32", helper.UINT8: "U8", helper.INT64: "I64"}
_QUANT_STORED = {"B": "nbits_B", "s": "nbits_scales", "z": "nbits_zp", "p": "nbits_perm"}


@dataclass(frozen=True, slots=True)
class QuantGemm:
    """How one (per-expert) projection is stored in MatMulNBits layout: from ``<weight>.nbits_meta`` and
    which optional tensors exist. ``parts``: the graph initializer suffixes (``B``, ``s``, ``z``, ``p``)."""

    K: int
    N: int
    bits: int
    block_size: int
    accuracy_level: int
    k_in: int
    parts: tuple[str, ...]
    zp_len: int

    @property
    def n_blocks(self) -> int:
        return -(-self.K // self.block_size)

    def shapes(self) -> dict[str, list[int]]:
        return {"B": [self.N, self.n_blocks, self.block_size * self.bits // 8], "s": [self.N * self.n_blocks],
                "z": [self.zp_len], "p": [self.K]}


def _gemm(nodes: list, inits: list, x: str, w: str, out: str, q: QuantGemm | None) -> None:
    """``out = x @ W.T`` for the weight initializer(s) named ``w`` (float ``[N, K]``, or MatMulNBits parts)."""
    if q is None:
        nodes.append(helper.make_node("Gemm", [x, w], [out], transB=1))
        return
    inits += [_external(f"{w}_{part}", q.shapes()[part], _QUANT_DTYPES[part]) for part in q.parts]
    if "p" in q.parts:  # act order: the op reads x[:, perm]; perm == k_in names a zero column
        if q.k_in < q.K:
            nodes.append(helper.make_node("Pad", [x, "pad_one_col"], [f"{out}_xpad"]))
            x = f"{out}_xpad"
        nodes.append(helper.make_node("Gather", [x, f"{w}_p"], [f"{out}_xperm"], axis=1))
        x = f"{out}_xperm"
    ins = [x, f"{w}_B", f"{w}_s"] + ([f"{w}_z"] if "z" in q.parts else [])
    nodes.append(helper.make_node("MatMulNBits", ins, [out], domain="com.microsoft", K=q.K, N=q.N, bits=q.bits,
                                  block_size=q.block_size, accuracy_level=q.accuracy_level))


def moe_graph(cfg: ModelConfig, layer: int, quant: Mapping[str, QuantGemm] | None = None) -> helper.Model:
    """``h [T, H]``, ``pair_r`` = 0..T*k-1, ``num_pairs`` = [T*k] -> ``y [T, H]``. Weights are external
    initializers: ``router``, ``w1_{e}`` / ``w2_{e}`` per expert, ``s_*`` for the shared expert; a weight
    kind in ``quant`` (``w1``, ``w2``, ``s_gate``, ``s_up``, ``s_down``) is MatMulNBits parts ``<name>_B``,
    ``_s`` and the optional ``_z`` (zero-points), ``_p`` (input permutation)."""
    H, E, inter, si = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    k = cfg.num_experts_per_tok
    quant = quant or {}
    n = helper.make_node
    inits = [_external("router", [E, H]), _const("k", [k]), _const("flat", [-1]), _const("col", [-1, 1]),
             _const("zero", [0]), _const("one", [1]), _const("depth", [E]), _const("per_token", [-1, k]),
             _const("halves", [inter, inter]), _const("onehot_values", [0, 1]), _const("pad_one_col", [0, 0, 0, 1])]
    nodes = [n("Gemm", ["h", "router"], ["logits"], transB=1)]
    if cfg.norm_topk_prob:  # softmax over all experts, renormalised over the top k = softmax over the top-k logits
        nodes += [n("TopK", ["logits", "k"], ["top_l", "top_e"], axis=-1),  # [T, k], descending
                  n("Softmax", ["top_l"], ["top_w"], axis=-1)]
    else:
        nodes += [n("Softmax", ["logits"], ["probs"], axis=-1),
                  n("TopK", ["probs", "k"], ["top_w", "top_e"], axis=-1)]
    # (token, expert) pairs r = t*k + j, sorted by expert (ties by r: keys are distinct), grouped per expert;
    # pair_r = 0..R-1 and num_pairs = [R] are inputs (R = T*k)
    nodes += [n("Reshape", ["top_e", "flat"], ["pair_e"]),  # [R]
              n("Mul", ["pair_e", "num_pairs"], ["e_major"]),
              n("Add", ["e_major", "pair_r"], ["sort_key"]),
              n("TopK", ["sort_key", "num_pairs"], ["_sorted", "order"], axis=0, largest=0),  # ascending
              n("Div", ["order", "k"], ["pair_tok"]),  # token of each sorted pair
              n("Reshape", ["top_w", "col"], ["pair_w"]),
              n("Gather", ["pair_w", "order"], ["sorted_w"], axis=0),  # [R, 1]
              n("OneHot", ["pair_e", "depth", "onehot_values"], ["pair_hot"], axis=-1),
              n("ReduceSum", ["pair_hot", "zero"], ["counts"], keepdims=0),  # [E] pairs per expert
              n("Gather", ["h", "pair_tok"], ["x_sorted"], axis=0),  # [R, H]
              n("Split", ["x_sorted", "counts"], [f"x{e}" for e in range(E)], axis=0),
              # position of pair r in the sorted order: the inverse permutation
              n("ScatterElements", ["pair_r", "order", "pair_r"], ["pos"], axis=0),
              n("Reshape", ["pos", "per_token"], ["pos_tk"])]  # [T, k]
    # per expert one GEMM up and one down; the SwiGLU between them runs once over all pairs
    for kind, shape in (("w1", [2 * inter, H]), ("w2", [H, inter])):
        if kind not in quant:
            inits += [_external(f"{kind}_{e}", shape) for e in range(E)]
    for e in range(E):
        _gemm(nodes, inits, f"x{e}", f"w1_{e}", f"a{e}", quant.get("w1"))  # [M_e, 2I]
    nodes += [n("Concat", [f"a{e}" for e in range(E)], ["a_sorted"], axis=0),
              n("Split", ["a_sorted", "halves"], ["g_sorted", "u_sorted"], axis=1),
              n("Sigmoid", ["g_sorted"], ["g_sig"]),
              n("Mul", ["g_sorted", "g_sig"], ["g_act"]),
              n("Mul", ["g_act", "u_sorted"], ["z_sorted"]),
              n("Split", ["z_sorted", "counts"], [f"z{e}" for e in range(E)], axis=0)]
    for e in range(E):
        _gemm(nodes, inits, f"z{e}", f"w2_{e}", f"y{e}", quant.get("w2"))  # [M_e, H]
    nodes += [n("Concat", [f"y{e}" for e in range(E)], ["y_sorted"], axis=0),
              n("Mul", ["y_sorted", "sorted_w"], ["y_weighted"]),
              n("Gather", ["y_weighted", "pos_tk"], ["y_tk"], axis=0),  # [T, k, H]
              n("ReduceSum", ["y_tk", "one"], ["routed" if si else "y"], keepdims=0)]  # j = 0..k-1, in order
    if si:
        inits += [_external(name, shape) for name, shape in
                  (("s_gate", [si, H]), ("s_up", [si, H]), ("s_down", [H, si]), ("s_gate_w", [1, H]))
                  if name not in quant]
        _gemm(nodes, inits, "h", "s_gate", "sg", quant.get("s_gate"))
        _gemm(nodes, inits, "h", "s_up", "su", quant.get("s_up"))
        nodes += [n("Sigmoid", ["sg"], ["sg_sig"]),
                  n("Mul", ["sg", "sg_sig"], ["sg_act"]),
                  n("Mul", ["sg_act", "su"], ["s_mid"])]
        _gemm(nodes, inits, "s_mid", "s_down", "s_out", quant.get("s_down"))
        nodes += [n("Gemm", ["h", "s_gate_w"], ["s_logit"], transB=1),
                  n("Sigmoid", ["s_logit"], ["s_scale"]),
                  n("Mul", ["s_out", "s_scale"], ["shared"]),
                  n("Add", ["routed", "shared"], ["y"])]
    ins = [helper.make_tensor_value_info("h", helper.FLOAT, ["T", H]),
           helper.make_tensor_value_info("pair_r", helper.INT64, ["R"]),
           helper.make_tensor_value_info("num_pairs", helper.INT64, [1])]
    outs = [helper.make_tensor_value_info("y", helper.FLOAT, ["T", H])]
    graph = helper.make_graph(nodes, f"moe{layer}", ins, outs, inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if quant else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _external_inits(model: helper.Model) -> list[helper.Tensor]:
    return [t for t in model.graph.initializers if t.is_external]


def _quant_gemm(get, stored: set[str], name: str) -> QuantGemm:
    """The :class:`QuantGemm` of state weight ``name`` (stored in MatMulNBits layout)."""
    K, N, bits, bs, level, k_in = (int(v) for v in np.asarray(get(name + ".nbits_meta")))
    parts = tuple(k for k, v in _QUANT_STORED.items() if f"{name}.{v}" in stored)
    if parts[:2] != ("B", "s"):
        raise BundleError(f"state weight {name}: MatMulNBits tensors nbits_B / nbits_scales are missing")
    zp_len = int(get(name + ".nbits_zp").shape[-1]) if "z" in parts else 0
    return QuantGemm(K, N, bits, bs, level, k_in, parts, zp_len)


_SHARED = {"s_gate": "shared_expert.gate_proj", "s_up": "shared_expert.up_proj", "s_down": "shared_expert.down_proj",
           "s_gate_w": "shared_expert_gate"}  # graph initializer -> state weight name after "layers.{i}.mlp."


class MoE:
    """One MoE layer: its onnxruntime session over the layer's ``layers.{i}.mlp.*`` state weights.

    ``weights`` is the bundle's :class:`SafetensorsFile` (initializers become external data pointing into
    the file) or a plain mapping of arrays (tests, and bundles that store ``experts.gate_proj`` /
    ``up_proj`` apart: those are fused here, a copy), handed over as in-memory initializers.
    ``intra_op_threads``: None = the process's onnxruntime pool as it is.
    """

    def __init__(self, cfg: ModelConfig, weights: SafetensorsFile | Mapping[str, np.ndarray], layer: int,
                 intra_op_threads: int | None = None) -> None:
        p = f"layers.{layer}.mlp."
        self.cfg, self.layer, self._p = cfg, layer, p
        self.top_k, self.renorm = cfg.num_experts_per_tok, cfg.norm_topk_prob
        stored = set(weights.keys())
        get = weights.get
        self._get, self._stored = get, stored
        self.shared = cfg.shared_expert_intermediate_size > 0
        kinds = {"w1": "experts.gate_up_proj", "w2": "experts.down_proj"}
        if self.shared:
            kinds.update({g: s for g, s in _SHARED.items() if g != "s_gate_w"})
        self.quant = {g: _quant_gemm(get, stored, p + s) for g, s in kinds.items() if p + s + ".nbits_meta" in stored}
        fused = p + "experts.gate_up_proj" in stored or "w1" in self.quant
        self._fused = fused
        self.router = get(p + "gate")  # [E, H]
        self._float: tuple | None = None  # numpy_forward's float experts, made on first use
        opts = session_options(intra_op_threads)
        model = moe_graph(cfg, layer, self.quant)
        if isinstance(weights, SafetensorsFile) and fused and self._dtypes_match(weights, model):
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                          str(weights.path.parent))
            ranges = self._file_ranges(weights, model)
            for init in _external_inits(model):
                offset, length = ranges[init.name]
                init.external = [("location", weights.path.name), ("offset", str(offset)), ("length", str(length))]
        else:
            ext = _external_inits(model)
            self._values = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(self._array(i.name)))
                            for i in ext]  # kept alive: the session may read them
            opts.add_external_initializers([i.name for i in ext], self._values)
        self._session = cpu_session(model, opts)
        self._binding = Binding(self._session)
        keep = np.empty((_KEEP_TOKENS, cfg.hidden_size), np.float32)
        self._keep_views = [keep[:t] for t in range(_KEEP_TOKENS + 1)]  # the same objects every call: no rebinding
        # T -> (0..T*k-1, [T*k]) for every step size up to _KEEP_TOKENS, made here: filled on first use, the
        # table grew for hours as new sizes arrived (issue 21's soak: +129 KB of the stub's traced heap)
        self._pairs = {T: (np.arange(T * self.top_k, dtype=np.int64), np.array([T * self.top_k], np.int64))
                       for T in range(_KEEP_TOKENS + 1)}

    def _source(self, init: str) -> tuple[str, int | None]:
        """State weight name and expert index (None: not per expert) of a graph initializer."""
        p = self._p
        if init.startswith(("w1_", "w2_")):
            kind, rest = init[:2], init[3:]
            e, _, part = rest.partition("_")
            name = p + ("experts.gate_up_proj" if kind == "w1" else "experts.down_proj")
            return (name + "." + _QUANT_STORED[part] if part else name), int(e)
        for g, s in _SHARED.items():
            if init == g:
                return p + s, None
            if init.startswith(g + "_") and init[len(g) + 1:] in _QUANT_STORED and g != "s_gate_w":
                return p + s + "." + _QUANT_STORED[init[len(g) + 1:]], None
        if init == "router":
            return p + "gate", None
        raise KeyError(init)

    def _array(self, init: str) -> np.ndarray:
        """The value of a graph initializer (tests, and bundles with unfused experts: a copy)."""
        name, e = self._source(init)
        if e is not None and not self._fused:  # experts.gate_proj / up_proj stored apart: fuse here
            p = self._p
            if init.startswith("w1_"):
                return np.concatenate([self._get(p + "experts.gate_proj")[e], self._get(p + "experts.up_proj")[e]])
        arr = self._get(name)
        arr = arr[e] if e is not None else arr
        return np.asarray(arr, np.float32) if arr.dtype.kind == "f" else np.asarray(arr)

    def _dtypes_match(self, sw: SafetensorsFile, model: helper.Model) -> bool:
        """Whether every initializer can be read from the file as stored (else they are copied, converted)."""
        return all(sw.dtype(self._source(i.name)[0]) == _FILE_DTYPES[i.data_type] for i in _external_inits(model))

    def _file_ranges(self, sw: SafetensorsFile, model: helper.Model) -> dict[str, tuple[int, int]]:
        """Byte ranges in the state-weights file of every initializer (one expert = one block of a tensor)."""
        E = self.cfg.num_experts
        ranges: dict[str, tuple[int, int]] = {}
        for init in _external_inits(model):
            name, e = self._source(init.name)
            off, length = sw.data_range(name)
            ranges[init.name] = (off + e * length // E, length // E) if e is not None else (off, length)
        return ranges

    def _float_weights(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Float32 gate, up ``[E, I, H]``, down ``[E, H, I]`` and shared weights (numpy_forward only)."""
        if self._float is None:
            p, get, inter = self._p, self._get, self.cfg.moe_intermediate_size

            def w(kind: str, name: str) -> np.ndarray:
                if kind not in self.quant:
                    return np.asarray(get(name), np.float32)
                parts = {k: (get(f"{name}.{v}") if f"{name}.{v}" in self._stored else None)
                         for k, v in _QUANT_STORED.items()}
                meta = get(name + ".nbits_meta")
                if kind in ("w1", "w2"):
                    return np.stack([nbits_dequantize(parts["B"][e], parts["s"][e],
                                                      None if parts["z"] is None else parts["z"][e],
                                                      None if parts["p"] is None else parts["p"][e], meta)
                                     for e in range(self.cfg.num_experts)])
                return nbits_dequantize(parts["B"], parts["s"], parts["z"], parts["p"], meta)

            if self._fused:
                gate_up = w("w1", p + "experts.gate_up_proj")
                gate, up = gate_up[:, :inter], gate_up[:, inter:]
            else:
                gate, up = get(p + "experts.gate_proj"), get(p + "experts.up_proj")
            down = w("w2", p + "experts.down_proj")
            shared = {g: w(g, p + s) for g, s in _SHARED.items()} if self.shared else {}
            self._float = (gate, up, down, shared)
        return self._float

    def __call__(self, h: np.ndarray) -> np.ndarray:
        """``h [T, H]`` (post-attention-normed) -> FFN output ``[T, H]`` float32, a buffer valid until
        this layer's next call."""
        h = np.ascontiguousarray(h, np.float32)
        T = h.shape[0]
        out = self._keep_views[T] if T <= _KEEP_TOKENS else np.empty((T, self.cfg.hidden_size), np.float32)
        if T == 0:
            return out
        self._binding.input("h", h)
        pairs = self._pairs.get(T)
        if pairs is None:  # prefill sizes: made per call (a cache per size would only grow)
            R = T * self.top_k
            pairs = (np.arange(R, dtype=np.int64), np.array([R], np.int64))
        self._binding.input("pair_r", pairs[0])
        self._binding.input("num_pairs", pairs[1])
        self._binding.output("y", out)
        self._binding.run()
        return out

    # ---- the numpy form of the same computation (tests compare the graph with it) -----------------
    def route(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-k expert ids ``[T, k]`` (descending probability) and their weights ``[T, k]``."""
        logits = h @ self.router.T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :self.top_k]
        wts = np.take_along_axis(probs, top, axis=-1)
        if self.renorm:
            wts = wts / wts.sum(-1, keepdims=True)
        return top, wts.astype(np.float32)

    def numpy_forward(self, h: np.ndarray) -> np.ndarray:
        """The same FFN in numpy, one expert at a time (slow; tests only)."""
        top, wts = self.route(h)
        gate, up, down, sw = self._float_weights()
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            for e, w in zip(top[t], wts[t]):
                x = h[t:t + 1]
                out[t] += w * ((_silu(x @ gate[e].T) * (x @ up[e].T)) @ down[e].T)[0]
        if self.shared:
            y = (_silu(h @ sw["s_gate"].T) * (h @ sw["s_up"].T)) @ sw["s_down"].T
            out += y / (1.0 + np.exp(-(h @ sw["s_gate_w"].T)))
        return out
