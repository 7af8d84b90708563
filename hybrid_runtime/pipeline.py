"""The segment pipeline of a hybrid model: which stateless segments exist and what runs between them.

One source of truth for the builder (which turns each :class:`SegmentPlan` into an ONNX graph) and the
runner (which executes them in order, with the stateful operator named by ``exit`` after each one).

A forward pass over T tokens is::

    embed -> [mixer 0] -> post_mixer0 -> ([moe 0] -> post_moe0) -> [mixer 1] -> ... -> final x
    head(x rows of the positions that need logits) -> logits

Segment tensors are all ``[T, width]`` float32 (``input_ids``/``positions`` are ``[T]`` int64).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import DENSE, LINEAR, MOE, ModelConfig

F32, I64 = "float32", "int64"


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """One stateless segment. ``entry``/``exit`` are ("embed"|"mixer"|"moe"|"final"|"head", layer)."""

    name: str
    entry: tuple[str, int]
    exit: tuple[str, int]
    inputs: tuple[tuple[str, str, int], ...]
    outputs: tuple[tuple[str, str, int], ...]


def mixer_inputs(cfg: ModelConfig, layer: int) -> tuple[tuple[str, str, int], ...]:
    """What a segment that *ends* before mixer ``layer`` outputs for it (besides ``x_next``)."""
    if cfg.layer_types[layer] == LINEAR:
        nv = cfg.linear_num_value_heads
        return (("u", F32, cfg.conv_dim), ("z", F32, cfg.value_dim), ("g", F32, nv), ("beta", F32, nv))
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return (("q", F32, qd), ("k", F32, kvd), ("v", F32, kvd), ("gate", F32, qd))


def mixer_outputs(cfg: ModelConfig, layer: int) -> tuple[tuple[str, str, int], ...]:
    """What the stateful mixer ``layer`` hands to the segment after it (besides the residual ``x``)."""
    if cfg.layer_types[layer] == LINEAR:
        return (("mix_core", F32, cfg.value_dim), ("mix_z", F32, cfg.value_dim))
    qd = cfg.num_heads * cfg.head_dim
    return (("mix_attn", F32, qd), ("mix_gate", F32, qd))


def plan_segments(cfg: ModelConfig) -> list[SegmentPlan]:
    """All segments in execution order; the last one is the ``head`` (final norm + lm_head)."""
    H = cfg.hidden_size
    x_in, x_out = ("x", F32, H), ("x_next", F32, H)

    def exit_io(nxt: tuple[str, int]) -> tuple[tuple, tuple]:
        kind, layer = nxt
        if kind == "mixer":
            extra_in = (("positions", I64, 0),) if cfg.layer_types[layer] != LINEAR else ()
            return extra_in, (x_out, *mixer_inputs(cfg, layer))
        if kind == "moe":
            return (), (x_out, ("h", F32, H))
        return (), (x_out,)

    def after_ffn(layer: int) -> tuple[str, int]:
        return ("mixer", layer + 1) if layer + 1 < cfg.num_layers else ("final", -1)

    plans: list[SegmentPlan] = []
    extra, outs = exit_io(("mixer", 0))
    plans.append(SegmentPlan("embed", ("embed", -1), ("mixer", 0), (("input_ids", I64, 0), *extra), outs))
    for i in range(cfg.num_layers):
        nxt = ("moe", i) if cfg.ffn_types[i] == MOE else after_ffn(i)
        extra, outs = exit_io(nxt)
        plans.append(SegmentPlan(f"post_mixer{i}", ("mixer", i), nxt, (x_in, *mixer_outputs(cfg, i), *extra), outs))
        if cfg.ffn_types[i] == MOE:
            nxt = after_ffn(i)
            extra, outs = exit_io(nxt)
            plans.append(SegmentPlan(f"post_moe{i}", ("moe", i), nxt, (x_in, ("ffn_out", F32, H), *extra), outs))
    plans.append(SegmentPlan("head", ("final", -1), ("head", -1), (x_in,), (("logits", F32, cfg.vocab_size),)))
    assert all(cfg.ffn_types[i] in (DENSE, MOE) for i in range(cfg.num_layers))
    return plans


def state_weight_names(cfg: ModelConfig) -> list[str]:
    """Canonical weights the stateful operators need at run time (stored beside the segments)."""
    names: list[str] = []
    for i in range(cfg.num_layers):
        if cfg.layer_types[i] == LINEAR:
            names.append(f"layers.{i}.linear_attn.conv1d")
        if cfg.ffn_types[i] == MOE:
            p = f"layers.{i}.mlp."
            # gate_up_proj [E, 2I, H]: per expert the gate rows, then the up rows (transformers' fused layout)
            names += [p + "gate", p + "experts.gate_up_proj", p + "experts.down_proj"]
            if cfg.shared_expert_intermediate_size:
                names += [p + "shared_expert.gate_proj", p + "shared_expert.up_proj",
                          p + "shared_expert.down_proj", p + "shared_expert_gate"]
    return names
