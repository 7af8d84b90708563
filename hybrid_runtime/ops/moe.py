"""Sparse MoE FFN on the host: one onnxruntime session per MoE layer around the ``com.microsoft.MoE`` kernel.

Only the routed experts run, so the cost grows with top-k, not with the expert count: the kernel gathers
each expert's tokens and runs one GEMM per expert over all of them (MLAS, every core, no Python loop).
The router (softmax over all experts, top-k, renormalised when ``norm_topk_prob``) is the kernel's; the
gated shared expert runs in the same session. Weights are the bundle's
memory-mapped state weights, handed to the session as external initializers that it reads in place,
so there is no second host copy: pages come from the file mapping.

Expert gate/up weights are stored interleaved, ``experts.gate_up_interleaved [E, 2I, H]`` with row
``2j`` = gate row ``j`` and ``2j+1`` = up row ``j``: the layout of the kernel's fused SwiGLU
(``swiglu_fusion=1``). :func:`interleave_gate_up` builds it (the builder writes it into the bundle).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from ..config import ModelConfig
from ..engine.ort_session import Binding, cpu_session, session_options
from ..weights_io import SafetensorsFile

# Outputs up to this many tokens go to a buffer the layer keeps (a decode step allocates nothing);
# larger ones (prefill chunks) are allocated per call, so no layer holds a prefill-sized buffer.
_KEEP_TOKENS = 64


def interleave_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``gate``, ``up`` ``[E, I, H]`` -> ``[E, 2I, H]`` with gate row j at 2j and up row j at 2j+1."""
    E, inter, hidden = gate.shape
    return np.stack([gate, up], axis=2).reshape(E, 2 * inter, hidden)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _external(name: str, shape: list[int]) -> TensorProto:
    """An initializer whose data the session gets from ``SessionOptions.add_external_initializers``."""
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape, data_location=TensorProto.EXTERNAL)
    t.external_data.add(key="location", value="added-at-session-creation")
    return t


def moe_graph(cfg: ModelConfig, layer: int) -> onnx.ModelProto:
    """``h [T, H]`` -> ``y [T, H]``. Weights are external initializers (:data:`_NAMES`): constant weights
    are the kernel's fast path (as graph inputs it re-lays them out on every call, ~10x slower at T=1)."""
    H, E, inter, si = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    f = TensorProto.FLOAT
    inits = [_external("router", [E, H]), _external("fc1", [E, 2 * inter, H]), _external("fc2", [E, H, inter])]
    nodes = [helper.make_node("Gemm", ["h", "router"], ["logits"], transB=1),
             helper.make_node("MoE", ["h", "logits", "fc1", "", "fc2"], ["routed" if si else "y"],
                              domain="com.microsoft", k=cfg.num_experts_per_tok, activation_type="swiglu",
                              swiglu_fusion=1, normalize_routing_weights=int(cfg.norm_topk_prob),
                              activation_alpha=1.0, activation_beta=0.0)]  # plain SiLU(g) * u
    if si:
        inits += [_external(n, s) for n, s in
                  (("s_gate", [si, H]), ("s_up", [si, H]), ("s_down", [H, si]), ("s_gate_w", [1, H]))]
        nodes += [helper.make_node("Gemm", ["h", "s_gate"], ["sg"], transB=1),
                  helper.make_node("Gemm", ["h", "s_up"], ["su"], transB=1),
                  helper.make_node("Sigmoid", ["sg"], ["sg_sig"]),
                  helper.make_node("Mul", ["sg", "sg_sig"], ["sg_act"]),
                  helper.make_node("Mul", ["sg_act", "su"], ["s_mid"]),
                  helper.make_node("Gemm", ["s_mid", "s_down"], ["s_out"], transB=1),
                  helper.make_node("Gemm", ["h", "s_gate_w"], ["s_logit"], transB=1),
                  helper.make_node("Sigmoid", ["s_logit"], ["s_scale"]),
                  helper.make_node("Mul", ["s_out", "s_scale"], ["shared"]),
                  helper.make_node("Add", ["routed", "shared"], ["y"])]
    graph = helper.make_graph(nodes, f"moe{layer}", [helper.make_tensor_value_info("h", f, ["T", H])],
                              [helper.make_tensor_value_info("y", f, ["T", H])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="hybrid-runtime")
    model.ir_version = 8
    return model


_NAMES = {"router": "gate", "fc1": "experts.gate_up_interleaved", "fc2": "experts.down_proj",
          "s_gate": "shared_expert.gate_proj", "s_up": "shared_expert.up_proj", "s_down": "shared_expert.down_proj",
          "s_gate_w": "shared_expert_gate"}  # graph initializer -> state weight name after "layers.{i}.mlp."


class MoE:
    """One MoE layer: its onnxruntime session over the layer's ``layers.{i}.mlp.*`` state weights.

    ``weights`` is the bundle's :class:`SafetensorsFile`: the session's initializers are external data
    pointing into that file, which onnxruntime maps (no copy; only the pages of experts in use become
    resident). A plain mapping of arrays (tests; bundles without ``experts.gate_up_interleaved``, which
    is then interleaved here) is handed over as in-memory initializers, which onnxruntime copies.
    ``intra_op_threads``: None = the process's onnxruntime pool as it is.
    """

    def __init__(self, cfg: ModelConfig, weights: SafetensorsFile | Mapping[str, np.ndarray], layer: int,
                 intra_op_threads: int | None = None) -> None:
        p = f"layers.{layer}.mlp."
        self.cfg, self.layer = cfg, layer
        self.top_k, self.renorm = cfg.num_experts_per_tok, cfg.norm_topk_prob
        names = {k: p + v for k, v in _NAMES.items() if cfg.shared_expert_intermediate_size or not k.startswith("s_")}
        get = weights.get
        stored = set(weights.keys())
        if names["fc1"] not in stored:
            names.pop("fc1")
        file_backed = isinstance(weights, SafetensorsFile) and "fc1" in names and all(
            weights.dtype(n) == "F32" for n in names.values())
        # Views of the state weights (memory-mapped for a bundle) for numpy_forward; never copied here.
        self.weights: dict[str, np.ndarray] = {k: get(n) for k, n in names.items()}
        if "fc1" not in self.weights:  # a bundle from before the interleaved layout
            self.weights["fc1"] = interleave_gate_up(get(p + "experts.gate_proj"), get(p + "experts.up_proj"))
        fc1 = self.weights["fc1"]
        self.gate, self.up, self.down = fc1[:, 0::2], fc1[:, 1::2], self.weights["fc2"]  # [E, I, H] x2, [E, H, I]
        self.router = self.weights["router"]  # [E, H]
        self.shared = cfg.shared_expert_intermediate_size > 0
        opts = session_options(intra_op_threads)
        model = moe_graph(cfg, layer)
        if file_backed:
            assert isinstance(weights, SafetensorsFile)
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                          str(weights.path.parent))
            for init in model.graph.initializer:
                offset, length = weights.data_range(names[init.name])
                del init.external_data[:]
                for key, value in (("location", weights.path.name), ("offset", offset), ("length", length)):
                    init.external_data.add(key=key, value=str(value))
        else:
            values = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(self.weights[i.name], np.float32))
                      for i in model.graph.initializer]
            opts.add_external_initializers([i.name for i in model.graph.initializer], values)
        self._session = cpu_session(model, opts)
        self._binding = Binding(self._session)
        self._keep = np.empty((_KEEP_TOKENS, cfg.hidden_size), np.float32)

    def __call__(self, h: np.ndarray) -> np.ndarray:
        """``h [T, H]`` (post-attention-normed) -> FFN output ``[T, H]`` float32, a buffer valid until
        this layer's next call."""
        h = np.ascontiguousarray(h, np.float32)
        T = h.shape[0]
        out = self._keep[:T] if T <= _KEEP_TOKENS else np.empty((T, self.cfg.hidden_size), np.float32)
        if T == 0:
            return out
        self._binding.input("h", h)
        self._binding.output("y", out)
        self._binding.run()
        return out

    # ---- the numpy form of the same computation (tests compare the kernel with it) ---------------
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
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            for e, w in zip(top[t], wts[t]):
                x = h[t:t + 1]
                out[t] += w * ((_silu(x @ self.gate[e].T) * (x @ self.up[e].T)) @ self.down[e].T)[0]
        if self.shared:
            wi = self.weights
            y = (_silu(h @ wi["s_gate"].T) * (h @ wi["s_up"].T)) @ wi["s_down"].T
            out += y / (1.0 + np.exp(-(h @ wi["s_gate_w"].T)))
        return out
