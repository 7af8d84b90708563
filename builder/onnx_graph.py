"""A small ONNX graph builder over ``onnx.helper`` (opset 17): just the ops the segments need."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from hybrid_runtime.quant import LinearParts, QuantLinear, to_nbits

OPSET = 17
_ONNX_TYPES = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "float16": TensorProto.FLOAT16}


class GraphBuilder:
    """Accumulates nodes and initializers; every method returns the name of its output."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._ids = itertools.count()
        self._consts: dict[tuple, str] = {}
        self.accuracy_level = 0  # MatMulNBits: 0 = float32 activations, 4 = int8 (hybrid_runtime.quant)
        self._ms_domain = False  # whether a com.microsoft op was used

    def _tmp(self, hint: str) -> str:
        return f"{hint}_{next(self._ids)}"

    # ---- graph interface -------------------------------------------------------------------------
    def input(self, name: str, dtype: str, width: int) -> str:
        shape: list[str | int] = ["num_tokens"] if width == 0 else ["num_tokens", width]
        self.inputs.append(helper.make_tensor_value_info(name, _ONNX_TYPES[dtype], shape))
        return name

    def output(self, src: str, name: str, dtype: str, width: int) -> None:
        self.nodes.append(helper.make_node("Identity", [src], [name]))
        shape: list[str | int] = ["num_tokens"] if width == 0 else ["num_tokens", width]
        self.outputs.append(helper.make_tensor_value_info(name, _ONNX_TYPES[dtype], shape))

    def weight(self, name: str, arr: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def const_i64(self, values: list[int] | tuple[int, ...]) -> str:
        key = ("i64", tuple(values))
        if key not in self._consts:
            self._consts[key] = self.weight(self._tmp("shape"), np.asarray(values, dtype=np.int64))
        return self._consts[key]

    def const_f32(self, value: float) -> str:
        key = ("f32", float(value))
        if key not in self._consts:
            self._consts[key] = self.weight(self._tmp("c"), np.asarray(value, dtype=np.float32))
        return self._consts[key]

    def op(self, op_type: str, *inputs: str, hint: str | None = None, n_out: int = 1, domain: str = "",
           **attrs) -> str:
        outs = [self._tmp(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, domain=domain or None, **attrs))
        self._ms_domain |= domain == "com.microsoft"
        return outs[0] if n_out == 1 else outs  # type: ignore[return-value]

    def model(self, doc: str = "") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits, doc_string=doc)
        opsets = [helper.make_opsetid("", OPSET)]
        if self._ms_domain:
            opsets.append(helper.make_opsetid("com.microsoft", 1))
        m = helper.make_model(graph, opset_imports=opsets, producer_name="hybrid-llm-builder")
        m.ir_version = 8
        return m

    # ---- layers ---------------------------------------------------------------------------------
    def linear(self, x: str, w: np.ndarray | QuantLinear | LinearParts, name: str,
               bias: np.ndarray | None = None) -> str:
        """``x [T, in] @ w.T`` with ``w [out, in]`` as stored by nn.Linear; a quantized ``w`` becomes
        ``com.microsoft.MatMulNBits`` (row blocks of a :class:`LinearParts` one op each, concatenated)."""
        if isinstance(w, LinearParts):
            parts = [self._matmul(x, p, f"{name}.part{j}") for j, p in enumerate(w.parts)]
            y = self.op("Concat", *parts, axis=1)
        else:
            y = self._matmul(x, w, name)
        if bias is not None:
            y = self.op("Add", y, self.weight(name + ".bias", bias))
        return y

    def _matmul(self, x: str, w: np.ndarray | QuantLinear, name: str) -> str:
        hint = name.split(".")[-1]
        if not isinstance(w, QuantLinear):
            return self.op("MatMul", x, self.weight(name, np.ascontiguousarray(w.T)), hint=hint)
        nb = to_nbits(w)
        if nb.perm is not None:  # act order: the op reads x[:, perm] (perm == k_in: a zero column)
            if np.any(nb.perm == nb.k_in):
                x = self.op("Pad", x, self.const_i64([0, 0, 0, 1]))
            x = self.op("Gather", x, self.weight(name + ".perm", nb.perm), axis=1, hint=hint + "_perm")
        ins = [x, self.weight(name + ".qB", nb.B), self.weight(name + ".qscales", nb.scales)]
        if nb.zero_points is not None:
            ins.append(self.weight(name + ".qzeros", nb.zero_points))
        return self.op("MatMulNBits", *ins, domain="com.microsoft", hint=hint, K=nb.K, N=nb.N, bits=nb.bits,
                       block_size=nb.block_size, accuracy_level=self.accuracy_level)

    def split(self, x: str, sizes: list[int], axis: int = -1) -> list[str]:
        return self.op("Split", x, self.const_i64(sizes), n_out=len(sizes), axis=axis)  # type: ignore[return-value]

    def reshape(self, x: str, shape: list[int]) -> str:
        return self.op("Reshape", x, self.const_i64(shape))

    def rms(self, x: str, eps: float) -> str:
        """``x / sqrt(mean(x^2, -1) + eps)``."""
        ms = self.op("ReduceMean", self.op("Mul", x, x), axes=[-1], keepdims=1)
        return self.op("Div", x, self.op("Sqrt", self.op("Add", ms, self.const_f32(eps))))

    def rmsnorm1p(self, x: str, w: np.ndarray, eps: float, name: str) -> str:
        """Zero-centred RMSNorm: the stored ``w`` scales by ``1 + w``."""
        return self.op("Mul", self.rms(x, eps), self.weight(name, (1.0 + w).astype(np.float32)))

    def silu(self, x: str) -> str:
        return self.op("Mul", x, self.op("Sigmoid", x))

    def swiglu(self, h: str, gate: np.ndarray, up: np.ndarray, down: np.ndarray, name: str) -> str:
        gu = self.linear(h, np.concatenate([gate, up], axis=0), name + ".gate_up")
        g, u = self.split(gu, [gate.shape[0], up.shape[0]])
        return self.linear(self.op("Mul", self.silu(g), u), down, name + ".down_proj")
