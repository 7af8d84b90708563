"""The segment programs: what each stateless segment computes, as a short list of ops.

One source of truth for every backend. The builder lowers a program to ONNX (``builder/segments.py``);
the ``cuda`` backend executes the same program with its fused kernels and cuBLASLt
(``hybrid_runtime/cuda/executor.py``); :func:`run_program` is a plain numpy interpreter of it (the
tests compare all three). A program reads the segment's inputs (:class:`~hybrid_runtime.pipeline.SegmentPlan`)
and the *runtime weights* (:func:`runtime_weight_specs`, derived once from the canonical checkpoint
weights by :func:`derive_weight`), and writes the segment's outputs.

Tensors are ``[T, width]`` rows (ids / positions ``[T]``); all math is float32. The ops:

===============  ===============================  ====================================================
op               inputs -> outputs                 meaning (weights in brackets)
===============  ===============================  ====================================================
embed            ids -> x                          ``x = table[ids]``                      [table]
rmsnorm          x -> h                            ``h = x / sqrt(mean(x^2) + eps) * w``   [w = 1 + w_ckpt]
add              x, y -> x2                        ``x2 = x + y``
add_rmsnorm      x, y -> x2, h                     ``x2 = x + y``; ``h = rmsnorm(x2)``     [w]
linear           h [, residual] -> y               ``y = h @ W.T (+ bias) (+ residual)``   [W [, bias]]
gdn_gates        p -> u, z, g, beta                split ``p = [u | z | b | a]``;
                                                   ``g = neg_exp_a * softplus(a + dt_bias)``,
                                                   ``beta = sigmoid(b)``        [neg_exp_a, dt_bias]
attn_qkv         p, positions -> q, k, v, gate     split ``p = [q|gate per head | k | v]``; q and k
                                                   get RMSNorm1p per head and partial RoPE
                                                   [q_norm, k_norm, rope_cos, rope_sin]
gated_rmsnorm    core, z -> o                      per value head ``rmsnorm(core) * w * silu(z)`` [w]
sigmoid_mul      a, gate -> o                      ``o = a * sigmoid(gate)``
swiglu           gu -> act                         ``act = silu(gu[:, :I]) * gu[:, I:]``
===============  ===============================  ====================================================

Fused layouts are built here once (and only here): the GDN input projection ``in_proj`` is
``[in_proj_qkv | in_proj_z | in_proj_b | in_proj_a]``, attention's ``qkv_proj`` is
``[q_proj | k_proj | v_proj]``, an MLP's ``gate_up`` is ``[gate_proj | up_proj]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import DENSE, LINEAR, MOE, ModelConfig
from .pipeline import SegmentPlan, plan_segments
from .quant import QuantExperts, as_float, concat_rows, is_quantized

PROGRAM_VERSION = 1
OPS = ("embed", "rmsnorm", "add", "add_rmsnorm", "linear", "gdn_gates", "attn_qkv", "gated_rmsnorm",
       "sigmoid_mul", "swiglu")


@dataclass(frozen=True, slots=True)
class Op:
    """One step of a segment program: ``kind`` (one of :data:`OPS`), tensor names in and out, runtime
    weight names, and the op's attributes (sizes, eps)."""

    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in OPS:
            raise ValueError(f"unknown op {self.kind!r}; ops: {', '.join(OPS)}")


# ---------------------------------------------------------------------------------------- weights


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """One runtime weight: ``name``, ``shape``; ``matrix`` weights (GEMM operands, embeddings, experts)
    take the bundle's precision, the others (norms, gates, RoPE tables, conv) stay float32."""

    name: str
    shape: tuple[int, ...]
    matrix: bool
    layer: int = -1  # -1: not a layer's (embeddings, head, RoPE tables)


def _layer_specs(cfg: ModelConfig, i: int) -> list[WeightSpec]:
    H, L = cfg.hidden_size, f"layers.{i}."
    s = [WeightSpec(L + "input_norm", (H,), False, i), WeightSpec(L + "post_norm", (H,), False, i)]
    if cfg.layer_types[i] == LINEAR:
        nv, C, vd = cfg.linear_num_value_heads, cfg.conv_dim, cfg.value_dim
        p = L + "linear_attn."
        s += [WeightSpec(p + "in_proj", (C + vd + 2 * nv, H), True, i), WeightSpec(p + "neg_exp_a", (nv,), False, i),
              WeightSpec(p + "dt_bias", (nv,), False, i),
              WeightSpec(p + "norm", (cfg.linear_value_head_dim,), False, i),
              WeightSpec(p + "out_proj", (H, vd), True, i), WeightSpec(p + "conv1d", (C, cfg.conv_kernel), False, i)]
    else:
        qd, kvd, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        p = L + "self_attn."
        s += [WeightSpec(p + "qkv_proj", (2 * qd + 2 * kvd, H), True, i), WeightSpec(p + "q_norm", (hd,), False, i),
              WeightSpec(p + "k_norm", (hd,), False, i), WeightSpec(p + "o_proj", (H, qd), True, i)]
        if cfg.attention_bias:
            s += [WeightSpec(p + "qkv_bias", (2 * qd + 2 * kvd,), False, i), WeightSpec(p + "o_bias", (H,), False, i)]
    p = L + "mlp."
    if cfg.ffn_types[i] == DENSE:
        inter = cfg.intermediate_size
        s += [WeightSpec(p + "gate_up", (2 * inter, H), True, i), WeightSpec(p + "down", (H, inter), True, i)]
    else:
        E, inter, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        s += [WeightSpec(p + "router", (E, H), True, i), WeightSpec(p + "experts.gate_up", (E, 2 * inter, H), True, i),
              WeightSpec(p + "experts.down", (E, H, inter), True, i)]
        if si:
            s += [WeightSpec(p + "shared.gate_up", (2 * si, H), True, i),
                  WeightSpec(p + "shared.down", (H, si), True, i), WeightSpec(p + "shared.gate", (1, H), True, i)]
    return s


def runtime_weight_specs(cfg: ModelConfig, rope_len: int) -> list[WeightSpec]:
    """Every runtime weight, in a stable order: embeddings, RoPE tables, then layer by layer, then the head.
    ``lm_head`` is listed even when tied (a backend may alias it to ``embed_tokens``)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    specs = [WeightSpec("embed_tokens", (V, H), True)]
    if cfg.attention_layers:
        specs += [WeightSpec("rope_cos", (rope_len, cfg.rotary_dim), False),
                  WeightSpec("rope_sin", (rope_len, cfg.rotary_dim), False)]
    for i in range(cfg.num_layers):
        specs += _layer_specs(cfg, i)
    specs += [WeightSpec("final_norm", (H,), False), WeightSpec("lm_head", (V, H), True)]
    return specs


def stored_weight_specs(cfg: ModelConfig, rope_len: int) -> list[WeightSpec]:
    """The runtime weights a ``cuda`` bundle stores: all of them, except ``lm_head`` when it is tied."""
    return [s for s in runtime_weight_specs(cfg, rope_len) if not (s.name == "lm_head" and cfg.tie_word_embeddings)]


def derive_weight(cfg: ModelConfig, name: str, get: Callable[[str], np.ndarray], rope_len: int) -> np.ndarray:
    """The runtime weight ``name`` (float32) from canonical checkpoint weights ``get(canonical_name)``
    (``builder.checkpoint`` names). Fused layouts and the ``1 + w`` of zero-centred norms happen here.
    A quantized canonical weight (:mod:`hybrid_runtime.quant`) gives a quantized runtime weight (fused
    by rows: :func:`~hybrid_runtime.quant.concat_rows`); the other weights are never quantized."""
    from .reference import rope_tables

    f32 = lambda a: a if is_quantized(a) else np.asarray(a, np.float32)  # noqa: E731
    cat = lambda *names: concat_rows([f32(get(n)) for n in names])  # noqa: E731
    if name in ("embed_tokens", "lm_head"):
        return f32(get(name))
    if name in ("rope_cos", "rope_sin"):
        cos, sin = rope_tables(np.arange(rope_len), cfg.rotary_dim, cfg.rope_theta)
        return cos if name == "rope_cos" else sin
    if name == "final_norm":
        return 1.0 + f32(get("norm"))
    _, i, rest = name.split(".", 2)
    L = f"layers.{i}."
    simple = {"input_norm": None, "post_norm": None}
    if rest in simple:
        return 1.0 + f32(get(L + ("input_layernorm" if rest == "input_norm" else "post_attention_layernorm")))
    la, sa, mlp = L + "linear_attn.", L + "self_attn.", L + "mlp."
    table: dict[str, Callable[[], np.ndarray]] = {
        "linear_attn.in_proj": lambda: cat(*(la + n for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))),
        "linear_attn.neg_exp_a": lambda: (-np.exp(f32(get(la + "A_log")))).astype(np.float32),
        "linear_attn.dt_bias": lambda: f32(get(la + "dt_bias")),
        "linear_attn.norm": lambda: f32(get(la + "norm")),
        "linear_attn.out_proj": lambda: f32(get(la + "out_proj")),
        "linear_attn.conv1d": lambda: f32(get(la + "conv1d")),
        "self_attn.qkv_proj": lambda: cat(sa + "q_proj", sa + "k_proj", sa + "v_proj"),
        "self_attn.qkv_bias": lambda: cat(sa + "q_proj_bias", sa + "k_proj_bias", sa + "v_proj_bias"),
        "self_attn.q_norm": lambda: 1.0 + f32(get(sa + "q_norm")),
        "self_attn.k_norm": lambda: 1.0 + f32(get(sa + "k_norm")),
        "self_attn.o_proj": lambda: f32(get(sa + "o_proj")),
        "self_attn.o_bias": lambda: f32(get(sa + "o_proj_bias")),
        "mlp.gate_up": lambda: cat(mlp + "gate_proj", mlp + "up_proj"),
        "mlp.down": lambda: f32(get(mlp + "down_proj")),
        "mlp.router": lambda: f32(get(mlp + "gate")),
        "mlp.experts.gate_up": lambda: experts_gate_up(f32(get(mlp + "experts.gate_proj")),
                                                        f32(get(mlp + "experts.up_proj"))),
        "mlp.experts.down": lambda: f32(get(mlp + "experts.down_proj")),
        "mlp.shared.gate_up": lambda: cat(mlp + "shared_expert.gate_proj", mlp + "shared_expert.up_proj"),
        "mlp.shared.down": lambda: f32(get(mlp + "shared_expert.down_proj")),
        "mlp.shared.gate": lambda: f32(get(mlp + "shared_expert_gate")),
    }
    if rest not in table:
        raise KeyError(f"unknown runtime weight {name!r}")
    out = table[rest]()
    return out if is_quantized(out) else np.ascontiguousarray(out)


# The canonical checkpoint weights each quantizable runtime weight is fused from (derive_weight's table, by rows).
_LINEAR_SOURCES: dict[str, tuple[str, ...]] = {
    "linear_attn.in_proj": tuple(f"linear_attn.{n}" for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    "linear_attn.out_proj": ("linear_attn.out_proj",),
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down": ("mlp.down_proj",),
    "mlp.experts.gate_up": ("mlp.experts.gate_proj", "mlp.experts.up_proj"),
    "mlp.experts.down": ("mlp.experts.down_proj",),
    "mlp.shared.gate_up": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    "mlp.shared.down": ("mlp.shared_expert.down_proj",),
}


def linear_sources(name: str) -> tuple[str, ...]:
    """The canonical weights a runtime weight is fused from, in row order, when it is one a GPTQ checkpoint may
    quantize (the projections, the experts, ``lm_head``); () for the others (embeddings, router, shared-expert
    gate, norms, conv, gates, RoPE tables: never quantized)."""
    if name == "lm_head":
        return ("lm_head",)
    if not name.startswith("layers."):
        return ()
    _, i, rest = name.split(".", 2)
    return tuple(f"layers.{i}.{c}" for c in _LINEAR_SOURCES.get(rest, ()))


def experts_gate_up(gate, up):
    """``[E, I, H]`` gate and up -> ``[E, 2I, H]``, per expert the gate rows, then the up rows."""
    if isinstance(gate, QuantExperts) or isinstance(up, QuantExperts):
        E = gate.shape[0]
        item = lambda w, e: w.items[e] if isinstance(w, QuantExperts) else w[e]  # noqa: E731
        return QuantExperts(tuple(concat_rows([item(gate, e), item(up, e)]) for e in range(E)))
    return np.concatenate([gate, up], axis=1)


def runtime_weights(cfg: ModelConfig, canonical: Mapping[str, np.ndarray], rope_len: int,
                    names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """The runtime weights (all, or ``names``) from a dict of canonical weights."""
    wanted = [s.name for s in runtime_weight_specs(cfg, rope_len)] if names is None else list(names)
    return {n: derive_weight(cfg, n, canonical.__getitem__, rope_len) for n in wanted}


# ---------------------------------------------------------------------------------------- programs


def _pre_mixer(cfg: ModelConfig, j: int, x: str) -> list[Op]:
    """Layer j's input norm and mixer projection from residual ``x``; ends in the mixer's inputs."""
    eps, L = cfg.rms_norm_eps, f"layers.{j}."
    ops = [Op("rmsnorm", (x,), ("h_in",), (L + "input_norm",), {"eps": eps})]
    return ops + _mixer_proj(cfg, j, "h_in")


def _mixer_proj(cfg: ModelConfig, j: int, h: str) -> list[Op]:
    L = f"layers.{j}."
    if cfg.layer_types[j] == LINEAR:
        p = L + "linear_attn."
        return [Op("linear", (h,), ("proj",), (p + "in_proj",)),
                Op("gdn_gates", ("proj",), ("u", "z", "g", "beta"), (p + "neg_exp_a", p + "dt_bias"),
                   {"conv_dim": cfg.conv_dim, "value_dim": cfg.value_dim, "nv": cfg.linear_num_value_heads})]
    p = L + "self_attn."
    bias = (p + "qkv_bias",) if cfg.attention_bias else ()
    return [Op("linear", (h,), ("proj",), (p + "qkv_proj", *bias)),
            Op("attn_qkv", ("proj", "positions"), ("q", "k", "v", "gate"),
               (p + "q_norm", p + "k_norm", "rope_cos", "rope_sin"),
               {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "rotary_dim": cfg.rotary_dim, "eps": cfg.rms_norm_eps})]


def _exit_ops(cfg: ModelConfig, nxt: tuple[str, int], x: str) -> tuple[list[Op], str]:
    """Ops after the residual ``x`` is final for this segment: the next mixer's inputs, or the MoE's ``h``."""
    kind, j = nxt
    if kind == "mixer":
        return _pre_mixer(cfg, j, x), x
    if kind == "moe":
        return [Op("rmsnorm", (x,), ("h",), (f"layers.{j}.post_norm",), {"eps": cfg.rms_norm_eps})], x
    return [], x


def segment_program(cfg: ModelConfig, plan: SegmentPlan) -> tuple[Op, ...]:
    """The ops of one segment. Its outputs: ``x_next`` is the tensor named by the last residual op (the
    program's ``x_next`` alias, see :func:`output_names`), the rest by name."""
    eps = cfg.rms_norm_eps
    kind, i = plan.entry
    ops: list[Op] = []
    if kind == "embed":
        ops.append(Op("embed", ("input_ids",), ("x0",), ("embed_tokens",)))
        more, _ = _exit_ops(cfg, plan.exit, "x0")
        return tuple(ops + more)
    if kind == "final":
        return (Op("rmsnorm", ("x",), ("h_out",), ("final_norm",), {"eps": eps}),
                Op("linear", ("h_out",), ("logits",), ("lm_head",)))
    L = f"layers.{i}."
    if kind == "moe":  # residual add of the MoE output, fused with the next norm where there is one
        ekind, j = plan.exit
        if ekind == "mixer":
            ops.append(Op("add_rmsnorm", ("x", "ffn_out"), ("x1", "h_in"), (f"layers.{j}.input_norm",), {"eps": eps}))
            return tuple(ops + _mixer_proj(cfg, j, "h_in"))
        # the last layer: the final norm belongs to the head segment (which runs on the logit rows only)
        return (Op("add", ("x", "ffn_out"), ("x1",)),)
    # post_mixer i: output projection with the residual, then a dense MLP if there is one
    if cfg.layer_types[i] == LINEAR:
        p = L + "linear_attn."
        ops += [Op("gated_rmsnorm", ("mix_core", "mix_z"), ("o",), (p + "norm",),
                   {"nv": cfg.linear_num_value_heads, "dv": cfg.linear_value_head_dim, "eps": eps}),
                Op("linear", ("o", "x"), ("x1",), (p + "out_proj",))]
    else:
        p = L + "self_attn."
        bias = (p + "o_bias",) if cfg.attention_bias else ()
        ops += [Op("sigmoid_mul", ("mix_attn", "mix_gate"), ("o",)), Op("linear", ("o", "x"), ("x1",),
                                                                          (p + "o_proj", *bias))]
    x = "x1"
    if cfg.ffn_types[i] == DENSE:
        p = L + "mlp."
        ops += [Op("rmsnorm", (x,), ("h2",), (L + "post_norm",), {"eps": eps}),
                Op("linear", ("h2",), ("gu",), (p + "gate_up",)),
                Op("swiglu", ("gu",), ("act",), attrs={"inter": cfg.intermediate_size}),
                Op("linear", ("act", x), ("x2",), (p + "down",))]
        x = "x2"
    more, _ = _exit_ops(cfg, plan.exit, x)
    return tuple(ops + more)


def residual_name(program: tuple[Op, ...]) -> str:
    """The tensor a program hands on as ``x_next``: the last residual (``x0``/``x1``/``x2``)."""
    for op in reversed(program):
        for o in op.outputs:
            if o in ("x0", "x1", "x2"):
                return o
    raise ValueError("program has no residual output")


def output_names(plan: SegmentPlan, program: tuple[Op, ...]) -> dict[str, str]:
    """Segment output name -> program tensor name."""
    if plan.exit[0] == "head":
        return {"logits": "logits"}
    return {n: (residual_name(program) if n == "x_next" else n) for n, _, _ in plan.outputs}


def programs(cfg: ModelConfig) -> list[tuple[SegmentPlan, tuple[Op, ...]]]:
    """Every segment's plan and program, in execution order."""
    return [(p, segment_program(cfg, p)) for p in plan_segments(cfg)]


# ---------------------------------------------------------------------------------------- numpy interpreter


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x ``[T, heads, hd]``, cos/sin ``[T, rd]``: rotate-half RoPE on the first rd dims."""
    rd = cos.shape[-1]
    if rd == 0:
        return x
    xr, half = x[..., :rd], rd // 2
    rot = np.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    return np.concatenate([xr * cos[:, None] + rot * sin[:, None], x[..., rd:]], axis=-1)


def apply_op(op: Op, env: dict[str, np.ndarray], w: Mapping[str, np.ndarray]) -> None:
    """Run one op on float32 numpy tensors in ``env`` (in place)."""
    a, W = op.attrs, [w[n] for n in op.weights]
    ins = [env[n] for n in op.inputs]
    if op.kind == "embed":
        outs = [W[0][ins[0]].astype(np.float32)]
    elif op.kind == "rmsnorm":
        outs = [_rms(ins[0], a["eps"]) * W[0]]
    elif op.kind == "add":
        outs = [ins[0] + ins[1]]
    elif op.kind == "add_rmsnorm":
        x2 = ins[0] + ins[1]
        outs = [x2, _rms(x2, a["eps"]) * W[0]]
    elif op.kind == "linear":
        y = ins[0] @ as_float(W[0]).T
        if len(W) > 1:
            y = y + W[1]
        outs = [y + ins[1] if len(ins) > 1 else y]
    elif op.kind == "gdn_gates":
        C, vd, nv = a["conv_dim"], a["value_dim"], a["nv"]
        p = ins[0]
        b, aa = p[:, C + vd:C + vd + nv], p[:, C + vd + nv:C + vd + 2 * nv]
        outs = [p[:, :C], p[:, C:C + vd], W[0] * np.logaddexp(0.0, aa + W[1]), _sigmoid(b)]
    elif op.kind == "attn_qkv":
        H, Hkv, hd, eps = a["num_heads"], a["num_kv_heads"], a["head_dim"], a["eps"]
        p, pos = ins
        T = p.shape[0]
        qg = p[:, :2 * H * hd].reshape(T, H, 2 * hd)
        k = p[:, 2 * H * hd:2 * H * hd + Hkv * hd].reshape(T, Hkv, hd)
        v = p[:, 2 * H * hd + Hkv * hd:]
        cos, sin = W[2][pos], W[3][pos]
        q = _rope(_rms(qg[..., :hd], eps) * W[0], cos, sin).reshape(T, H * hd)
        k = _rope(_rms(k, eps) * W[1], cos, sin).reshape(T, Hkv * hd)
        outs = [q, k, v, qg[..., hd:].reshape(T, H * hd)]
    elif op.kind == "gated_rmsnorm":
        nv, dv = a["nv"], a["dv"]
        core, z = ins[0].reshape(-1, nv, dv), ins[1].reshape(-1, nv, dv)
        outs = [(_rms(core, a["eps"]) * W[0] * _silu(z)).reshape(-1, nv * dv)]
    elif op.kind == "sigmoid_mul":
        outs = [ins[0] * _sigmoid(ins[1])]
    else:  # swiglu
        inter = a["inter"]
        outs = [_silu(ins[0][:, :inter]) * ins[0][:, inter:]]
    for name, arr in zip(op.outputs, outs):
        env[name] = np.asarray(arr, np.float32)


def run_program(plan: SegmentPlan, program: tuple[Op, ...], inputs: Mapping[str, np.ndarray],
                weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The numpy interpreter: a segment's outputs (by segment output name) from its inputs."""
    env = {n: (np.asarray(v) if n in ("input_ids", "positions") else np.asarray(v, np.float32))
           for n, v in inputs.items()}
    for op in program:
        apply_op(op, env, weights)
    return {out: env[src] for out, src in output_names(plan, program).items()}


def moe_layers(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(i for i in range(cfg.num_layers) if cfg.ffn_types[i] == MOE)
