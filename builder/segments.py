"""Turn each :class:`hybrid_runtime.pipeline.SegmentPlan` into a stateless ONNX graph.

Stateless means token-parallel: every output row depends only on the same input row (projections,
norms, gates, RoPE from explicit positions, dense MLP, lm_head). The stateful parts (conv window and
delta rule, paged attention, MoE routing) run in the runtime between segments.
"""

from __future__ import annotations

import numpy as np
import onnx

from hybrid_runtime.config import DENSE, LINEAR, ModelConfig
from hybrid_runtime.pipeline import SegmentPlan
from hybrid_runtime.reference import rope_tables

from .onnx_graph import GraphBuilder

Weights = dict[str, np.ndarray]


def _rope(g: GraphBuilder, x3: str, cos: str, sin: str, rd: int, hd: int) -> str:
    """Rotate-half RoPE on the first ``rd`` dims of ``x3 [T, heads, hd]``; cos/sin are ``[T, 1, rd]``."""
    if rd == 0:
        return x3
    sl = lambda x, a, b: g.op("Slice", x, g.const_i64([a]), g.const_i64([b]), g.const_i64([2]))  # noqa: E731
    xr = sl(x3, 0, rd) if rd < hd else x3
    rot = g.op("Concat", g.op("Neg", sl(xr, rd // 2, rd)), sl(xr, 0, rd // 2), axis=2)
    out = g.op("Add", g.op("Mul", xr, cos), g.op("Mul", rot, sin))
    return g.op("Concat", out, sl(x3, rd, hd), axis=2) if rd < hd else out


def _pre_mixer(g: GraphBuilder, cfg: ModelConfig, w: Weights, i: int, x: str, positions: str | None,
               rope_len: int) -> dict[str, str]:
    h = g.rmsnorm1p(x, w[f"layers.{i}.input_layernorm"], cfg.rms_norm_eps, f"layers.{i}.input_layernorm")
    if cfg.layer_types[i] == LINEAR:
        p = f"layers.{i}.linear_attn."
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        fused = np.concatenate([w[p + n] for n in names], axis=0)
        u, z, b, a = g.split(g.linear(h, fused, p + "in_proj"), [w[p + n].shape[0] for n in names])
        neg_a = g.weight(p + "neg_exp_A_log", (-np.exp(w[p + "A_log"])).astype(np.float32))
        gate = g.op("Mul", g.op("Softplus", g.op("Add", a, g.weight(p + "dt_bias", w[p + "dt_bias"]))), neg_a)
        return {"u": u, "z": z, "g": gate, "beta": g.op("Sigmoid", b)}
    p = f"layers.{i}.self_attn."
    H, Hkv, hd, rd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim
    ws = [w[p + n] for n in ("q_proj", "k_proj", "v_proj")]
    bias = (np.concatenate([w[p + n + "_bias"] for n in ("q_proj", "k_proj", "v_proj")])
            if cfg.attention_bias else None)
    qg, k, v = g.split(g.linear(h, np.concatenate(ws, axis=0), p + "qkv_proj", bias), [m.shape[0] for m in ws])
    q3, gate3 = g.split(g.reshape(qg, [-1, H, 2 * hd]), [hd, hd], axis=2)
    q3 = g.rmsnorm1p(q3, w[p + "q_norm"], cfg.rms_norm_eps, p + "q_norm")
    k3 = g.rmsnorm1p(g.reshape(k, [-1, Hkv, hd]), w[p + "k_norm"], cfg.rms_norm_eps, p + "k_norm")
    assert positions is not None
    cos_t, sin_t = rope_tables(np.arange(rope_len), rd, cfg.rope_theta)
    axes1 = g.const_i64([1])
    cos = g.op("Unsqueeze", g.op("Gather", g.weight(p + "rope_cos", cos_t), positions, axis=0), axes1)
    sin = g.op("Unsqueeze", g.op("Gather", g.weight(p + "rope_sin", sin_t), positions, axis=0), axes1)
    q = g.reshape(_rope(g, q3, cos, sin, rd, hd), [-1, H * hd])
    k = g.reshape(_rope(g, k3, cos, sin, rd, hd), [-1, Hkv * hd])
    return {"q": q, "k": k, "v": v, "gate": g.reshape(gate3, [-1, H * hd])}


def _post_mixer(g: GraphBuilder, cfg: ModelConfig, w: Weights, i: int, ins: dict[str, str]) -> str:
    x = ins["x"]
    if cfg.layer_types[i] == LINEAR:
        p = f"layers.{i}.linear_attn."
        nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        core = g.reshape(ins["mix_core"], [-1, nv, dv])
        o = g.op("Mul", g.rms(core, cfg.rms_norm_eps), g.weight(p + "norm", w[p + "norm"]))
        o = g.op("Mul", o, g.silu(g.reshape(ins["mix_z"], [-1, nv, dv])))
        out = g.linear(g.reshape(o, [-1, nv * dv]), w[p + "out_proj"], p + "out_proj")
    else:
        p = f"layers.{i}.self_attn."
        o = g.op("Mul", ins["mix_attn"], g.op("Sigmoid", ins["mix_gate"]))
        out = g.linear(o, w[p + "o_proj"], p + "o_proj", w.get(p + "o_proj_bias") if cfg.attention_bias else None)
    x = g.op("Add", x, out, hint="residual")
    if cfg.ffn_types[i] == DENSE:
        h = g.rmsnorm1p(x, w[f"layers.{i}.post_attention_layernorm"], cfg.rms_norm_eps,
                        f"layers.{i}.post_attention_layernorm")
        p = f"layers.{i}.mlp."
        x = g.op("Add", x, g.swiglu(h, w[p + "gate_proj"], w[p + "up_proj"], w[p + "down_proj"], p.rstrip(".")))
    return x


def build_segment(cfg: ModelConfig, w: Weights, plan: SegmentPlan, rope_len: int) -> onnx.ModelProto:
    """The ONNX graph of one segment (see :mod:`hybrid_runtime.pipeline` for its inputs and outputs)."""
    g = GraphBuilder(plan.name)
    ins = {n: g.input(n, dt, width) for n, dt, width in plan.inputs}
    kind, i = plan.entry
    if kind == "embed":
        x = g.op("Gather", g.weight("embed_tokens", w["embed_tokens"]), ins["input_ids"], axis=0)
    elif kind == "mixer":
        x = _post_mixer(g, cfg, w, i, ins)
    elif kind == "moe":
        x = g.op("Add", ins["x"], ins["ffn_out"], hint="residual")
    else:  # final -> head
        hn = g.rmsnorm1p(ins["x"], w["norm"], cfg.rms_norm_eps, "norm")
        g.output(g.linear(hn, w["lm_head"], "lm_head"), "logits", "float32", cfg.vocab_size)
        return g.model(f"{plan.name}: final norm + lm_head")
    ekind, j = plan.exit
    outs: dict[str, str] = {"x_next": x}
    if ekind == "mixer":
        outs.update(_pre_mixer(g, cfg, w, j, x, ins.get("positions"), rope_len))
    elif ekind == "moe":
        outs["h"] = g.rmsnorm1p(x, w[f"layers.{j}.post_attention_layernorm"], cfg.rms_norm_eps,
                                f"layers.{j}.post_attention_layernorm")
    for name, dt, width in plan.outputs:
        g.output(outs[name], name, dt, width)
    return g.model(f"{plan.name}: entry={plan.entry} exit={plan.exit}")
