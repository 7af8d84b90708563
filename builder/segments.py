"""Lower each segment program (:mod:`hybrid_runtime.program`) to a stateless ONNX graph.

Stateless means token-parallel: every output row depends only on the same input row (projections,
norms, gates, RoPE from explicit positions, dense MLP, lm_head). The stateful parts (conv window and
delta rule, paged attention, MoE routing) run in the runtime between segments. The program is the one
description of what a segment computes; the ``cuda`` backend executes the same ops on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx

from hybrid_runtime.config import ModelConfig
from hybrid_runtime.pipeline import SegmentPlan
from hybrid_runtime.program import Op, derive_weight, output_names, segment_program

from .onnx_graph import GraphBuilder

Weights = Mapping[str, np.ndarray]


def _rope(g: GraphBuilder, x3: str, cos: str, sin: str, rd: int, hd: int) -> str:
    """Rotate-half RoPE on the first ``rd`` dims of ``x3 [T, heads, hd]``; cos/sin are ``[T, 1, rd]``."""
    if rd == 0:
        return x3
    sl = lambda x, a, b: g.op("Slice", x, g.const_i64([a]), g.const_i64([b]), g.const_i64([2]))  # noqa: E731
    xr = sl(x3, 0, rd) if rd < hd else x3
    rot = g.op("Concat", g.op("Neg", sl(xr, rd // 2, rd)), sl(xr, 0, rd // 2), axis=2)
    out = g.op("Add", g.op("Mul", xr, cos), g.op("Mul", rot, sin))
    return g.op("Concat", out, sl(x3, rd, hd), axis=2) if rd < hd else out


def _lower(g: GraphBuilder, op: Op, env: dict[str, str], weight: Callable[[str], str],
           matrix: Callable[[str], np.ndarray]) -> None:
    """Append the ONNX nodes of one program op (``env``: program tensor -> ONNX value name)."""
    a, ins = op.attrs, [env[n] for n in op.inputs]
    norm = lambda x, wname: g.op("Mul", g.rms(x, a["eps"]), weight(wname))  # noqa: E731
    if op.kind == "embed":
        outs = [g.op("Gather", weight(op.weights[0]), ins[0], axis=0)]
    elif op.kind == "rmsnorm":
        outs = [norm(ins[0], op.weights[0])]
    elif op.kind == "add":
        outs = [g.op("Add", ins[0], ins[1], hint="residual")]
    elif op.kind == "add_rmsnorm":
        x2 = g.op("Add", ins[0], ins[1], hint="residual")
        outs = [x2, norm(x2, op.weights[0])]
    elif op.kind == "linear":
        name = op.weights[0]
        bias = matrix(op.weights[1]) if len(op.weights) > 1 else None
        y = g.linear(ins[0], matrix(name), name, bias)
        outs = [g.op("Add", y, ins[1], hint="residual") if len(ins) > 1 else y]
    elif op.kind == "gdn_gates":
        C, vd, nv = a["conv_dim"], a["value_dim"], a["nv"]
        u, z, b, aa = g.split(ins[0], [C, vd, nv, nv])
        gate = g.op("Mul", g.op("Softplus", g.op("Add", aa, weight(op.weights[1]))), weight(op.weights[0]))
        outs = [u, z, gate, g.op("Sigmoid", b)]
    elif op.kind == "attn_qkv":
        H, Hkv, hd, rd = a["num_heads"], a["num_kv_heads"], a["head_dim"], a["rotary_dim"]
        qg, k, v = g.split(ins[0], [2 * H * hd, Hkv * hd, Hkv * hd])
        q3, gate3 = g.split(g.reshape(qg, [-1, H, 2 * hd]), [hd, hd], axis=2)
        q3 = norm(q3, op.weights[0])
        k3 = norm(g.reshape(k, [-1, Hkv, hd]), op.weights[1])
        axes1 = g.const_i64([1])
        cos = g.op("Unsqueeze", g.op("Gather", weight(op.weights[2]), ins[1], axis=0), axes1)
        sin = g.op("Unsqueeze", g.op("Gather", weight(op.weights[3]), ins[1], axis=0), axes1)
        outs = [g.reshape(_rope(g, q3, cos, sin, rd, hd), [-1, H * hd]),
                g.reshape(_rope(g, k3, cos, sin, rd, hd), [-1, Hkv * hd]), v, g.reshape(gate3, [-1, H * hd])]
    elif op.kind == "gated_rmsnorm":
        nv, dv = a["nv"], a["dv"]
        o = g.op("Mul", norm(g.reshape(ins[0], [-1, nv, dv]), op.weights[0]), g.silu(g.reshape(ins[1], [-1, nv, dv])))
        outs = [g.reshape(o, [-1, nv * dv])]
    elif op.kind == "sigmoid_mul":
        outs = [g.op("Mul", ins[0], g.op("Sigmoid", ins[1]))]
    elif op.kind == "swiglu":
        gate, up = g.split(ins[0], [a["inter"], a["inter"]])
        outs = [g.op("Mul", g.silu(gate), up)]
    else:  # pragma: no cover - Op validates its kind
        raise ValueError(op.kind)
    env.update(zip(op.outputs, outs))


def build_segment(cfg: ModelConfig, w: Weights, plan: SegmentPlan, rope_len: int,
                  accuracy_level: int = 0) -> onnx.ModelProto:
    """The ONNX graph of one segment, from canonical checkpoint weights ``w`` (see :mod:`builder.checkpoint`);
    quantized linears become MatMulNBits with ``accuracy_level`` (:mod:`hybrid_runtime.quant`)."""
    g = GraphBuilder(plan.name)
    g.accuracy_level = accuracy_level
    program = segment_program(cfg, plan)
    env = {n: g.input(n, dt, width) for n, dt, width in plan.inputs}
    cache: dict[str, np.ndarray] = {}
    added: set[str] = set()

    def matrix(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = derive_weight(cfg, name, w.__getitem__, rope_len)
        return cache[name]

    def weight(name: str) -> str:
        if name not in added:
            g.weight(name, matrix(name))
            added.add(name)
        return name

    for op in program:
        _lower(g, op, env, weight, matrix)
    dtypes = {n: (dt, width) for n, dt, width in plan.outputs}
    for out, src in output_names(plan, program).items():
        g.output(env[src], out, *dtypes[out])
    return g.model(f"{plan.name}: entry={plan.entry} exit={plan.exit}")
