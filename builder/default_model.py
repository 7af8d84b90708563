"""The embedded default model: a small, seeded Qwen3-Next style hybrid checkpoint.

:func:`write_default_checkpoint` writes a folder in exactly the Hugging Face format that transformers 5's
``save_pretrained`` produces for ``model_type: "qwen3_next"`` (``config.json``, ``generation_config.json``,
``model.safetensors`` with one tensor per expert and the fused, grouped-per-key-head ``in_proj_qkvz`` /
``in_proj_ba``), plus a byte-level BPE tokenizer trained on ``builder/data/corpus.txt`` and a ChatML chat
template (``chat_template.jinja``, the file transformers 5 writes; Qwen's format). The folder therefore
goes through the same loader as a real checkpoint, and transformers can load it too.

The model is untrained: its weights are drawn from ``numpy.random.default_rng(seed)``, scaled so that the
output distribution is "peaky" (logits with a standard deviation of about 3). Greedy decoding then gives
varied tokens with clear top-1/top-2 margins, so greedy output is robust to float rounding, which is what
tests and demos of the serving stack need. Everything is numpy and ``tokenizers``; the output is
byte-for-byte deterministic for a given seed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hybrid_runtime.weights_io import save_safetensors

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"
TRANSFORMERS_VERSION = "5.24.0"  # the transformers release whose save_pretrained format this mirrors

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 in the trained vocabulary
TARGET_VOCAB_SIZE = 2048
MODEL_MAX_LENGTH = 4096

# ChatML, the format of the Qwen family (<|im_start|>role\n...<|im_end|>\n), without Qwen's tool and
# reasoning sections: the random-weight model can do neither.
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention",
               "linear_attention", "linear_attention", "full_attention"]

# config.json as transformers 5.24 writes it for this model (keys sorted as save_pretrained sorts them).
# vocab_size, eos_token_id and pad_token_id are taken from the trained tokenizer when writing (the values
# here are what the shipped corpus gives).
DEFAULT_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "decoder_sparse_step": 1,
    "dtype": "float32",
    "eos_token_id": 0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "layer_types": LAYER_TYPES,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 32,
    "max_position_embeddings": MODEL_MAX_LENGTH,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 128,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": len(LAYER_TYPES),
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 128,
    "tie_word_embeddings": False,
    "transformers_version": TRANSFORMERS_VERSION,
    "use_cache": True,
    "vocab_size": TARGET_VOCAB_SIZE,
}

# Weight scales (standard deviations). Matrices use 1/sqrt(fan_in) so every projection keeps the scale of
# its input; the lm_head is 3/sqrt(hidden) so that logits of the unit-RMS final hidden state have std ~3.
LM_HEAD_LOGIT_STD = 3.0
NORM_NOISE_STD = 0.02  # RMSNorm1p weights (stored w, scale 1+w): 0 (identity) plus this noise
DT_BIAS_STD = 0.1


def _json_text(obj: dict[str, Any]) -> str:
    """JSON as ``save_pretrained`` writes it: two-space indent, sorted keys, trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def train_tokenizer(corpus: Path = CORPUS_PATH, vocab_size: int = TARGET_VOCAB_SIZE) -> Tokenizer:
    """Train the default byte-level BPE tokenizer on ``corpus`` (deterministic for a given corpus)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(corpus)], trainer)
    return tok


def _tensor_specs(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...], str, float]]:
    """Every tensor of the checkpoint as ``(name, shape, kind, scale)``, in a fixed draw order.

    kinds: ``normal`` ~ N(0, scale^2); ``norm1p`` ~ N(0, scale^2) (RMSNorm1p stores w, 0 = identity);
    ``plain_norm`` ~ 1 + N(0, scale^2); ``a_log`` = log(U(1, 16)).
    """
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    r = nv // nk
    conv_dim = 2 * nk * dk + nv * dv
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E, inter, shared = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    dense = cfg["intermediate_size"]
    fan = lambda n: 1.0 / np.sqrt(n)  # noqa: E731

    yield "model.embed_tokens.weight", (V, H), "normal", 1.0
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (H,), "norm1p", NORM_NOISE_STD
        if kind == "linear_attention":
            la = p + "linear_attn."
            # Grouped per key head g: [q_g (dk) | k_g (dk) | v (r*dv) | z (r*dv)] and [b (r) | a (r)].
            yield la + "in_proj_qkvz.weight", (nk * (2 * dk + 2 * r * dv), H), "normal", fan(H)
            yield la + "in_proj_ba.weight", (2 * nv, H), "normal", fan(H)
            yield la + "conv1d.weight", (conv_dim, 1, K), "normal", fan(K)
            yield la + "A_log", (nv,), "a_log", 0.0
            yield la + "dt_bias", (nv,), "normal", DT_BIAS_STD
            yield la + "norm.weight", (dv,), "plain_norm", NORM_NOISE_STD
            yield la + "out_proj.weight", (H, nv * dv), "normal", fan(nv * dv)
        else:
            sa = p + "self_attn."
            yield sa + "q_proj.weight", (2 * nh * hd, H), "normal", fan(H)  # per head [query | gate]
            yield sa + "k_proj.weight", (nkv * hd, H), "normal", fan(H)
            yield sa + "v_proj.weight", (nkv * hd, H), "normal", fan(H)
            yield sa + "o_proj.weight", (H, nh * hd), "normal", fan(nh * hd)
            yield sa + "q_norm.weight", (hd,), "norm1p", NORM_NOISE_STD
            yield sa + "k_norm.weight", (hd,), "norm1p", NORM_NOISE_STD
        yield p + "post_attention_layernorm.weight", (H,), "norm1p", NORM_NOISE_STD
        m = p + "mlp."
        is_moe = E > 0 and i not in cfg["mlp_only_layers"] and (i + 1) % cfg["decoder_sparse_step"] == 0
        if not is_moe:
            yield m + "gate_proj.weight", (dense, H), "normal", fan(H)
            yield m + "up_proj.weight", (dense, H), "normal", fan(H)
            yield m + "down_proj.weight", (H, dense), "normal", fan(dense)
            continue
        yield m + "gate.weight", (E, H), "normal", fan(H)
        for e in range(E):
            yield f"{m}experts.{e}.gate_proj.weight", (inter, H), "normal", fan(H)
            yield f"{m}experts.{e}.up_proj.weight", (inter, H), "normal", fan(H)
            yield f"{m}experts.{e}.down_proj.weight", (H, inter), "normal", fan(inter)
        yield m + "shared_expert.gate_proj.weight", (shared, H), "normal", fan(H)
        yield m + "shared_expert.up_proj.weight", (shared, H), "normal", fan(H)
        yield m + "shared_expert.down_proj.weight", (H, shared), "normal", fan(shared)
        yield m + "shared_expert_gate.weight", (1, H), "normal", fan(H)
    yield "model.norm.weight", (H,), "norm1p", NORM_NOISE_STD
    yield "lm_head.weight", (V, H), "normal", LM_HEAD_LOGIT_STD / np.sqrt(H)


def default_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """The seeded float32 weights of ``cfg`` under their safetensors names (see :func:`_tensor_specs`)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape, kind, scale in _tensor_specs(cfg):
        if kind == "a_log":
            arr = np.log(rng.uniform(1.0, 16.0, size=shape))
        else:
            arr = rng.standard_normal(shape) * scale
            if kind == "plain_norm":
                arr = arr + 1.0
        out[name] = np.ascontiguousarray(arr, dtype=np.float32)
    return out


def _tokenizer_config(eos: str) -> dict[str, Any]:
    """``tokenizer_config.json``: no BOS, EOS doubles as padding (the chat template is a file of its own)."""
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": eos,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_default_checkpoint(out_dir: Path, seed: int = 0, progress: Callable[[str], None] = print,
                             overrides: dict[str, Any] | None = None) -> Path:
    """Write the default hybrid checkpoint (config, generation config, weights, tokenizer) to ``out_dir``.

    ``overrides`` replaces config values (e.g. a larger random model for benchmarks; same tokenizer).
    Returns ``out_dir``. The result is byte-for-byte identical for equal ``seed`` and ``overrides``.
    """
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    progress(f"training tokenizer (byte-level BPE, vocab {TARGET_VOCAB_SIZE}) on {CORPUS_PATH.name}")
    tok = train_tokenizer()
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos_id = tok.token_to_id(EOS_TOKEN)
    if eos_id is None:
        raise RuntimeError(f"trained tokenizer lacks {EOS_TOKEN!r}")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(_json_text(_tokenizer_config(EOS_TOKEN)), encoding="utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    progress(f"tokenizer: {vocab_size} tokens, eos {EOS_TOKEN!r} = {eos_id}")

    # The model's vocabulary is the tokenizer's, unless an override asks for a larger one (a benchmark shape
    # with a real-sized lm_head): ids past the tokenizer's are valid model inputs that no text encodes to.
    want = int((overrides or {}).get("vocab_size", vocab_size))
    if want < vocab_size:
        raise ValueError(f"vocab_size override {want} is smaller than the tokenizer's {vocab_size} tokens")
    cfg = {**DEFAULT_CONFIG, **(overrides or {}), "vocab_size": want, "eos_token_id": eos_id,
           "pad_token_id": eos_id}
    (out / "config.json").write_text(_json_text(cfg), encoding="utf-8")
    gen = {"_from_model_config": True, "eos_token_id": eos_id, "output_attentions": False,
           "output_hidden_states": False, "pad_token_id": eos_id, "transformers_version": TRANSFORMERS_VERSION,
           "use_cache": True}
    (out / "generation_config.json").write_text(_json_text(gen), encoding="utf-8")

    progress(f"drawing weights (seed {seed})")
    weights = default_weights(cfg, seed)
    n_params = sum(int(a.size) for a in weights.values())
    progress(f"writing weights: {len(weights)} tensors, {n_params:,} parameters, float32")
    save_safetensors(out / "model.safetensors", weights, metadata={"format": "pt"})
    progress(f"default checkpoint written to {out} in {time.perf_counter() - t0:.2f} s")
    return out
