"""Hugging Face ``config.json`` -> :class:`hybrid_runtime.config.ModelConfig`.

Accepts both spellings (MODEL_MATH.md, "Config spelling"):

* transformers 5: ``layer_types``, ``rope_parameters: {rope_theta, partial_rotary_factor, ...}``, ``dtype``;
* released checkpoints: ``full_attention_interval``, top-level ``rope_theta`` / ``partial_rotary_factor`` /
  ``rope_scaling``, ``torch_dtype``;

and the Qwen3.5 multimodal wrapper whose text hyper-parameters sit in ``text_config``. A value we do not
support raises :class:`ConfigError` naming the key and the value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_runtime.config import DENSE, FULL, LINEAR, MOE, ConfigError, ModelConfig

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")

# transformers' defaults for keys a config may omit (read from transformers 5.24's configuration classes).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                       decoder_sparse_step=1, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       num_experts_per_tok=10, num_experts=512, norm_topk_prob=True),
    "qwen3_5": dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768),
    "qwen3_5_moe": dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                        num_key_value_heads=2, max_position_embeddings=32768, moe_intermediate_size=512,
                        shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256),
}
_COMMON_DEFAULTS = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, head_dim=256,
                        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_num_key_heads=16, linear_num_value_heads=32, hidden_act="silu")
_ALLOWED_ROPE_KEYS = {"rope_theta", "rope_type", "type", "partial_rotary_factor", "mrope_section",
                      "mrope_interleaved"}


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """Where a checkpoint keeps its text-model weights and how its GDN projections are laid out."""

    prefix: str  # "model." or "model.language_model."
    fused_gdn: bool  # qwen3_next: in_proj_qkvz / in_proj_ba grouped per key head
    torch_dtype: str | None


def _family(model_type: str) -> str:
    return model_type.removesuffix("_text")


def parse_hf_config(raw: dict[str, Any], generation_eos: list[int] | None = None
                    ) -> tuple[ModelConfig, CheckpointLayout]:
    """Normalise a parsed ``config.json``; returns the model config and the checkpoint layout."""
    top_type = raw.get("model_type")
    if top_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unsupported config value model_type={top_type!r}: supported are "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    wrapped = "text_config" in raw and isinstance(raw["text_config"], dict)
    cfg = dict(raw["text_config"]) if wrapped else dict(raw)
    family = _family(top_type)
    defaults = {**_COMMON_DEFAULTS, **_DEFAULTS[family]}

    def get(key: str) -> Any:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
        if key in raw and raw[key] is not None and key in ("tie_word_embeddings",):
            return raw[key]
        return defaults[key]

    act = get("hidden_act")
    if act != "silu":
        raise ConfigError(f"unsupported config value hidden_act={act!r}: only 'silu' is implemented")

    n_layers = int(get("num_hidden_layers"))
    if cfg.get("layer_types") is not None:
        layer_types = tuple(cfg["layer_types"])
        for t in layer_types:
            if t not in (LINEAR, FULL):
                raise ConfigError(f"unsupported config value layer_types entry {t!r}: expected "
                                  f"{LINEAR!r} or {FULL!r}")
    else:
        interval = int(cfg.get("full_attention_interval", 4))
        if interval < 1:
            raise ConfigError(f"unsupported config value full_attention_interval={interval!r}: must be >= 1")
        layer_types = tuple(LINEAR if (i + 1) % interval else FULL for i in range(n_layers))

    # RoPE: rope_parameters (v5) or rope_theta / partial_rotary_factor / rope_scaling (legacy).
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling")
    if scaling:
        rope = {**scaling, **rope}
    # rope_type first: a scaled RoPE (yarn, linear, ...) also brings keys like `factor`, and the error
    # should name the type, not those keys.
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"unsupported config value rope_type={rope_type!r}: only 'default' RoPE is "
                          f"implemented (no YaRN / linear / dynamic scaling)")
    unknown_rope = sorted(set(rope) - _ALLOWED_ROPE_KEYS)
    if unknown_rope:
        raise ConfigError(f"unsupported config value rope_parameters keys {unknown_rope}: only default "
                          f"RoPE (optionally with mrope_section for text) is implemented")
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    prf = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    head_dim = int(get("head_dim"))
    if not 0.0 < prf <= 1.0:
        raise ConfigError(f"unsupported config value partial_rotary_factor={prf!r}: must be in (0, 1]")

    if family == "qwen3_next":
        num_experts = int(get("num_experts"))
        step = int(get("decoder_sparse_step"))
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        ffn_types = tuple(MOE if (i not in mlp_only and num_experts > 0 and (i + 1) % step == 0) else DENSE
                          for i in range(n_layers))
        norm_topk = bool(get("norm_topk_prob"))
    elif family == "qwen3_5":
        num_experts, ffn_types, norm_topk = 0, (DENSE,) * n_layers, True
    else:  # qwen3_5_moe: always MoE, always renormalised
        num_experts, ffn_types, norm_topk = int(get("num_experts")), (MOE,) * n_layers, True
        if cfg.get("norm_topk_prob") is False:
            raise ConfigError("unsupported config value norm_topk_prob=False: qwen3_5_moe always "
                              "renormalises its top-k weights")

    has_moe = MOE in ffn_types
    eos = cfg.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    for e in generation_eos or []:
        if e not in eos_ids:
            eos_ids.append(e)

    model = ModelConfig(
        model_type=family,
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        num_layers=n_layers,
        layer_types=layer_types,
        ffn_types=ffn_types,
        rms_norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        num_heads=int(get("num_attention_heads")),
        num_kv_heads=int(get("num_key_value_heads")),
        head_dim=head_dim,
        rotary_dim=int(head_dim * prf),
        rope_theta=rope_theta,
        attention_bias=bool(get("attention_bias")),
        max_position_embeddings=int(get("max_position_embeddings")),
        linear_num_key_heads=int(get("linear_num_key_heads")),
        linear_num_value_heads=int(get("linear_num_value_heads")),
        linear_key_head_dim=int(get("linear_key_head_dim")),
        linear_value_head_dim=int(get("linear_value_head_dim")),
        conv_kernel=int(get("linear_conv_kernel_dim")),
        intermediate_size=int(cfg.get("intermediate_size") or defaults.get("intermediate_size", 0)),
        num_experts=num_experts if has_moe else 0,
        num_experts_per_tok=int(get("num_experts_per_tok")) if has_moe else 0,
        moe_intermediate_size=int(get("moe_intermediate_size")) if has_moe else 0,
        shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")) if has_moe else 0,
        norm_topk_prob=norm_topk,
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )
    if DENSE in ffn_types and model.intermediate_size <= 0:
        raise ConfigError(f"unsupported config value intermediate_size={model.intermediate_size!r}: dense "
                          f"layers need a positive width")
    layout = CheckpointLayout(
        prefix="model.language_model." if family in ("qwen3_5", "qwen3_5_moe") and top_type in
        ("qwen3_5", "qwen3_5_moe") else "model.",
        fused_gdn=family == "qwen3_next",
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype"),
    )
    return model, layout


def load_hf_config(checkpoint_dir: str | Path) -> tuple[ModelConfig, CheckpointLayout]:
    """Read ``config.json`` (and ``generation_config.json``'s EOS, if present) from a checkpoint folder."""
    d = Path(checkpoint_dir)
    path = d / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {d}")
    raw = json.loads(path.read_text())  # json accepts the legacy non-standard literal `Infinity`
    gen_eos: list[int] = []
    gen_path = d / "generation_config.json"
    if gen_path.is_file():
        g = json.loads(gen_path.read_text()).get("eos_token_id")
        gen_eos = [g] if isinstance(g, int) else list(g or [])
    return parse_hf_config(raw, gen_eos)
