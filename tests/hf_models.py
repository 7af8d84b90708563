"""Tiny Hugging Face hybrid models for tests: config factories, re-initialisation, saving, running.

torch and transformers are test-only dependencies, so they are imported lazily inside the functions
that need them; the numpy-only helpers at the bottom (:func:`write_numpy_checkpoint`, the config-file
rewriters) work without them.

Everything is sized to run in seconds on a CPU: hidden <= 64, at most a handful of layers, vocab <= 256.
transformers' default ``initializer_range`` (0.02) gives nearly-zero logits, so :func:`reinit_` draws
every parameter at a scale where every path (each mixer, the gates, the norms' weights, the routing)
visibly moves the logits.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hybrid_runtime.config import DENSE, FULL, LINEAR, ModelConfig
from hybrid_runtime.weights_io import SafetensorsFile, save_safetensors

VOCAB = 256

# Shared sizes: GQA attention (4 query heads over 2 KV heads), GDN with 2 key heads and 4 value heads
# (r = 2, so the per-key-head grouping of Qwen3-Next's fused projections matters), K = 4.
_TEXT_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_MOE_BASE: dict[str, Any] = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
)
_ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)


def _rope(kwargs: dict[str, Any], mrope: bool) -> dict[str, Any]:
    """Pull ``rope_theta`` / ``partial_rotary_factor`` overrides into a ``rope_parameters`` dict."""
    rope = dict(_ROPE)
    if mrope:
        rope.update(mrope_section=[11, 11, 10], mrope_interleaved=True)
    for k in ("rope_theta", "partial_rotary_factor"):
        if k in kwargs:
            rope[k] = kwargs.pop(k)
    rope.update(kwargs.pop("rope_parameters", None) or {})
    return rope


# ---- config factories (transformers' own classes) -----------------------------------------------------


def qwen3_next_config(moe: bool = True, **overrides: Any):
    """A tiny ``Qwen3NextConfig``; ``moe=False`` makes every layer a dense SwiGLU."""
    from transformers import Qwen3NextConfig

    kw: dict[str, Any] = {**_TEXT_BASE, **_MOE_BASE, "norm_topk_prob": True, "decoder_sparse_step": 1}
    if not moe:
        kw["num_experts"] = 0
    kw.update(overrides)
    rope = _rope(kw, mrope=False)
    return Qwen3NextConfig(**kw, rope_parameters=rope)


def _vision_config(cls, out_hidden: int):
    return cls(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
               spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=out_hidden, num_position_embeddings=16)


def qwen3_5_text_config(moe: bool = False, **overrides: Any):
    """A tiny ``Qwen3_5TextConfig`` (dense) or ``Qwen3_5MoeTextConfig`` (``moe=True``)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    kw: dict[str, Any] = {**_TEXT_BASE, **(_MOE_BASE if moe else {})}
    if moe:
        kw.pop("intermediate_size")
    kw.update(overrides)
    rope = _rope(kw, mrope=True)
    return (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(**kw, rope_parameters=rope)


def qwen3_5_config(moe: bool = False, **text_overrides: Any):
    """The multimodal wrapper config (``Qwen3_5Config`` / ``Qwen3_5MoeConfig``) with a tiny vision tower."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3_5MoeVisionConfig, Qwen3_5VisionConfig

    tie = text_overrides.pop("tie_word_embeddings", False)
    text = qwen3_5_text_config(moe=moe, tie_word_embeddings=tie, **text_overrides)
    if moe:
        vision = _vision_config(Qwen3_5MoeVisionConfig, text.hidden_size)
        return Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                tie_word_embeddings=tie)
    vision = _vision_config(Qwen3_5VisionConfig, text.hidden_size)
    return Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=tie)


def model_class(config):
    """The transformers class that builds a causal-LM (or multimodal wrapper) for ``config``."""
    import transformers as tf

    return {
        "qwen3_next": tf.Qwen3NextForCausalLM,
        "qwen3_5": tf.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": tf.Qwen3_5MoeForConditionalGeneration,
        "qwen3_5_text": tf.Qwen3_5ForCausalLM,
        "qwen3_5_moe_text": tf.Qwen3_5MoeForCausalLM,
    }[config.model_type]


# ---- building, re-initialising, saving, running ---------------------------------------------------------


def reinit_(model, seed: int = 0) -> None:
    """Re-draw the text model's parameters at a scale where every path matters (logits spread O(1..10)).

    Matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), the zero-centred norms' weights small random around
    0, the GDN output norm around 1, ``A_log`` / ``dt_bias`` random in a range that keeps the decays
    between strong and weak, biases small random. Vision parameters (``model.visual.*``) keep their init.
    """
    import torch

    g = torch.Generator().manual_seed(seed)

    def normal(p, std: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std + mean)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".visual." in f".{name}":
                continue
            if name.endswith("A_log"):  # A = exp(A_log) in [0.05, 0.6]
                lo, hi = math.log(0.05), math.log(0.6)
                p.copy_(torch.rand(p.shape, generator=g) * (hi - lo) + lo)
            elif name.endswith("dt_bias"):
                normal(p, 0.5)
            elif name.endswith("linear_attn.norm.weight"):  # plain weight (gated norm)
                normal(p, 0.2, mean=1.0)
            elif name.endswith("norm.weight"):  # zero-centred (1 + w) norms: layer, final, q/k
                normal(p, 0.15)
            elif name.endswith("conv1d.weight"):
                normal(p, 1.0 / math.sqrt(p.shape[-1]))
            elif name.endswith("embed_tokens.weight"):
                normal(p, 1.0)
            elif name.endswith(("lm_head.weight", "mlp.gate.weight")):  # router: sharp, routing varies per token
                normal(p, 2.0 / math.sqrt(p.shape[1]))
            elif name.endswith(".bias"):
                normal(p, 0.1)
            elif p.ndim >= 2:  # Linear [out, in] and fused experts [E, out, in]
                normal(p, 1.0 / math.sqrt(p.shape[-1]))
            else:
                raise AssertionError(f"reinit_: no rule for parameter {name} {tuple(p.shape)}")


def build_model(config, seed: int = 0):
    """A float32 model for ``config`` in eval mode, re-initialised with :func:`reinit_`, no EOS."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)(config).to(torch.float32).eval()
    reinit_(model, seed)
    if model.generation_config is not None:
        model.generation_config.eos_token_id = None
    return model


def save_model(model, directory: str | Path, dtype=None, max_shard_size: str | None = None) -> Path:
    """``save_pretrained`` into ``directory`` (optionally cast to ``dtype`` first; the model is not changed)."""
    import copy

    d = Path(directory)
    m = model
    if dtype is not None:
        m = copy.deepcopy(model).to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    m.save_pretrained(d, **kwargs)
    return d


def rounded_copy(model, dtype):
    """A float32 copy of ``model`` whose weights went through ``dtype`` (what a bf16/f16 file holds)."""
    import copy

    import torch

    return copy.deepcopy(model).to(dtype).to(torch.float32).eval()


def text_state_dict(model) -> dict[str, np.ndarray]:
    """The model's in-memory state dict as float32 numpy (fused MoE experts, as transformers holds them)."""
    return {k: v.detach().to("cpu").float().numpy().copy() for k, v in model.state_dict().items()}


def hf_logits(model, ids: Iterable[int]) -> np.ndarray:
    """transformers' logits ``[T, vocab]`` for one sequence (uncached forward, float32)."""
    import torch

    x = torch.tensor([list(ids)], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=x, use_cache=False)
    return out.logits[0].float().numpy()


def hf_greedy(model, ids: Iterable[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and, per step, its own top-1/top-2 logit margin."""
    import torch

    model.generation_config.eos_token_id = None
    x = torch.tensor([list(ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, x.shape[1]:].tolist()
    margins = []
    for step in out.logits:
        top2 = torch.topk(step[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return tokens, margins


def prompt(n: int, seed: int = 0, vocab: int = VOCAB) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


# ---- numpy-only helpers (no torch) --------------------------------------------------------------------


def read_config(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / "config.json").read_text())


def write_config(directory: str | Path, raw: Mapping[str, Any]) -> None:
    (Path(directory) / "config.json").write_text(json.dumps(raw, indent=2))


def legacyfy_config(directory: str | Path) -> dict[str, Any]:
    """Rewrite ``config.json`` in place into the released-checkpoint spelling; returns the new dict.

    ``layer_types`` -> ``full_attention_interval`` (the list must be periodic with its last layer of each
    period full attention), ``rope_parameters`` -> top-level ``rope_theta`` / ``partial_rotary_factor``,
    ``dtype`` -> ``torch_dtype``, plus ``time_step_limit: [0.0, Infinity]`` (the non-standard JSON literal).
    """
    raw = read_config(directory)
    cfg = raw.get("text_config", raw)
    types = cfg.pop("layer_types")
    interval = types.index(FULL) + 1
    expect = [LINEAR if (i + 1) % interval else FULL for i in range(len(types))]
    if types != expect:
        raise ValueError(f"layer_types {types} is not an interval pattern")
    cfg["full_attention_interval"] = interval
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
    for d in (raw, cfg):
        if "dtype" in d:
            d["torch_dtype"] = d.pop("dtype")
    cfg["time_step_limit"] = [0.0, math.inf]
    text = json.dumps(raw, indent=2)  # json writes the bare literal Infinity (allow_nan defaults to True)
    assert "Infinity" in text
    (Path(directory) / "config.json").write_text(text)
    return raw


def fused_experts_file(state: Mapping[str, np.ndarray], directory: str | Path, config_from: str | Path) -> Path:
    """Write ``state`` (in-memory names, fused ``experts.gate_up_proj`` / ``experts.down_proj``) as a
    single ``model.safetensors`` in ``directory``, with ``config.json`` copied from ``config_from``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_safetensors(d / "model.safetensors", dict(state))
    shutil.copy(Path(config_from) / "config.json", d / "config.json")
    return d


def read_all(directory: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of every ``*.safetensors`` in ``directory`` as float32 numpy."""
    out: dict[str, np.ndarray] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        f = SafetensorsFile(path)
        out.update({k: f.get(k) for k in f.keys()})  # noqa: SIM118 (not a dict)
    return out


def tiny_raw_config(model_type: str = "qwen3_next", **overrides: Any) -> dict[str, Any]:
    """A tiny ``config.json`` dict in the transformers-5 spelling (no transformers needed).

    qwen3_next is flat; ``qwen3_5`` / ``qwen3_5_moe`` get the multimodal wrapper with ``text_config``.
    """
    text: dict[str, Any] = {**_TEXT_BASE, "hidden_act": "silu", "attention_bias": False,
                            "rope_parameters": dict(_ROPE),
                            "layer_types": [LINEAR, LINEAR, LINEAR, FULL]}
    if model_type in ("qwen3_next", "qwen3_5_moe"):
        text.update(_MOE_BASE)
    if model_type == "qwen3_next":
        text.update(decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])
    text.update(overrides)
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        return {"model_type": model_type, "architectures": ["X"], "dtype": "float32",
                "tie_word_embeddings": text.get("tie_word_embeddings", False),
                "text_config": {**text, "model_type": f"{model_type}_text"}}
    return {"model_type": model_type, "dtype": "float32", **text}


def hf_tensor_shapes(cfg: ModelConfig, prefix: str, fused_gdn: bool) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the text-model tensors as ``save_pretrained`` writes them (MODEL_MATH.md)."""
    h = cfg.hidden_size
    s: dict[str, tuple[int, ...]] = {f"{prefix}embed_tokens.weight": (cfg.vocab_size, h),
                                     f"{prefix}norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, h)
    nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    for i in range(cfg.num_layers):
        p = f"{prefix}layers.{i}."
        s[p + "input_layernorm.weight"] = (h,)
        s[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.layer_types[i] == LINEAR:
            la = p + "linear_attn."
            if fused_gdn:
                s[la + "in_proj_qkvz.weight"] = (2 * cfg.key_dim + 2 * cfg.value_dim, h)
                s[la + "in_proj_ba.weight"] = (2 * nv, h)
            else:
                s[la + "in_proj_qkv.weight"] = (cfg.conv_dim, h)
                s[la + "in_proj_z.weight"] = (cfg.value_dim, h)
                s[la + "in_proj_b.weight"] = (nv, h)
                s[la + "in_proj_a.weight"] = (nv, h)
            s[la + "conv1d.weight"] = (cfg.conv_dim, 1, cfg.conv_kernel)
            s[la + "A_log"] = (nv,)
            s[la + "dt_bias"] = (nv,)
            s[la + "norm.weight"] = (dv,)
            s[la + "out_proj.weight"] = (h, cfg.value_dim)
        else:
            sa = p + "self_attn."
            qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            for n, shp in (("q_proj", (2 * qd, h)), ("k_proj", (kvd, h)), ("v_proj", (kvd, h)), ("o_proj", (h, qd))):
                s[sa + n + ".weight"] = shp
                if cfg.attention_bias:
                    s[sa + n + ".bias"] = (shp[0],)
            s[sa + "q_norm.weight"] = (cfg.head_dim,)
            s[sa + "k_norm.weight"] = (cfg.head_dim,)
        m = p + "mlp."
        if cfg.ffn_types[i] == DENSE:
            it = cfg.intermediate_size
            s.update({m + "gate_proj.weight": (it, h), m + "up_proj.weight": (it, h), m + "down_proj.weight": (h, it)})
            continue
        it, si = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        s[m + "gate.weight"] = (cfg.num_experts, h)
        for e in range(cfg.num_experts):
            s.update({f"{m}experts.{e}.gate_proj.weight": (it, h), f"{m}experts.{e}.up_proj.weight": (it, h),
                      f"{m}experts.{e}.down_proj.weight": (h, it)})
        s.update({m + "shared_expert.gate_proj.weight": (si, h), m + "shared_expert.up_proj.weight": (si, h),
                  m + "shared_expert.down_proj.weight": (h, si), m + "shared_expert_gate.weight": (1, h)})
    return s


def write_numpy_checkpoint(directory: str | Path, raw: Mapping[str, Any], seed: int = 0,
                           drop: Iterable[str] = (), reshape: Mapping[str, tuple[int, ...]] | None = None) -> Path:
    """A random checkpoint folder for ``raw`` (a config.json dict) written with numpy only.

    ``drop`` removes tensors by name and ``reshape`` gives some tensors a different shape (to test
    the loader's errors).
    """
    from builder.hf_config import parse_hf_config

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg, layout = parse_hf_config(dict(raw))
    shapes = hf_tensor_shapes(cfg, layout.prefix, layout.fused_gdn)
    shapes.update(reshape or {})
    rng = np.random.default_rng(seed)
    tensors = {n: (rng.standard_normal(shp) * 0.1).astype(np.float32) for n, shp in shapes.items() if n not in drop}
    save_safetensors(d / "model.safetensors", tensors)
    write_config(d, raw)
    return d
