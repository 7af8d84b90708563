"""The embedded default model (`builder.default_model`): format, determinism, tokenizer and behaviour."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from builder.checkpoint import Checkpoint, canonical_names, load_weights
from builder.default_model import CORPUS_PATH, DEFAULT_CONFIG, write_default_checkpoint
from builder.hf_config import load_hf_config
from hybrid_runtime.config import FULL, LINEAR, MOE
from hybrid_runtime.reference import forward, greedy_generate
from hybrid_runtime.tokenizer import Tokenizer
from hybrid_runtime.weights_io import SafetensorsFile

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja")
PROMPT = "The weather today"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _expected_tensor_names() -> set[str]:
    """Every safetensors name ``save_pretrained`` writes for the default qwen3_next config."""
    c = DEFAULT_CONFIG
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if kind == LINEAR:
            names |= {p + "linear_attn." + n for n in ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight",
                                                        "A_log", "dt_bias", "norm.weight", "out_proj.weight")}
        else:
            names |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                            "k_norm")}
        m = p + "mlp."
        names |= {m + "gate.weight", m + "shared_expert_gate.weight"}
        names |= {f"{m}shared_expert.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        names |= {f"{m}experts.{e}.{n}.weight" for e in range(c["num_experts"])
                  for n in ("gate_proj", "up_proj", "down_proj")}
    return names


def test_corpus_ships_with_non_ascii_text() -> None:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    assert 40_000 <= len(text.encode()) <= 80_000
    assert any(ord(ch) > 0xFFFF for ch in text)  # emoji (4-byte UTF-8)
    assert any(0x4E00 <= ord(ch) <= 0x9FFF for ch in text)  # CJK
    assert any(0x0370 <= ord(ch) <= 0x03FF for ch in text)  # Greek


def test_loads_through_the_checkpoint_loader(default_checkpoint: Path) -> None:
    for name in FILES:
        assert (default_checkpoint / name).is_file(), name
    cfg, layout = load_hf_config(default_checkpoint)
    assert cfg.model_type == "qwen3_next" and layout.fused_gdn and layout.prefix == "model."
    assert layout.torch_dtype == "float32"
    assert cfg.num_layers == 6
    assert cfg.layer_types == (LINEAR, LINEAR, FULL, LINEAR, LINEAR, FULL)
    assert cfg.ffn_types == (MOE,) * 6
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (8, 2, True)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (128, 4, 2, 64, 16)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.conv_kernel) == (2, 4, 32, 32, 4)
    assert not cfg.tie_word_embeddings

    tok = Tokenizer.from_dir(default_checkpoint)
    assert cfg.vocab_size == tok.vocab_size == DEFAULT_CONFIG["vocab_size"] == 2048
    eos_id = tokenizers.Tokenizer.from_file(str(default_checkpoint / "tokenizer.json")).token_to_id("<|endoftext|>")
    gen = json.loads((default_checkpoint / "generation_config.json").read_text())
    assert tok.eos_token_ids == (eos_id,)
    assert gen["eos_token_id"] == eos_id == DEFAULT_CONFIG["eos_token_id"] == DEFAULT_CONFIG["pad_token_id"]
    assert cfg.eos_token_ids == tok.eos_token_ids

    raw = json.loads((default_checkpoint / "config.json").read_text())
    assert raw == DEFAULT_CONFIG
    assert raw["architectures"] == ["Qwen3NextForCausalLM"] and "full_attention_interval" not in raw

    st = SafetensorsFile(default_checkpoint / "model.safetensors")
    assert st.metadata == {"format": "pt"}
    assert set(st.keys()) == _expected_tensor_names()

    ck = Checkpoint(default_checkpoint)
    assert ck.stored_dtypes() == {"F32"}
    w = load_weights(ck)
    assert set(canonical_names(cfg)) <= set(w)
    assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in w.values())
    # The stated initialisation: identity-ish RMSNorm1p weights, GDN norm ~1, A_log in [0, log 16).
    assert abs(float(w["norm"].mean())) < 0.01 and float(w["norm"].std()) < 0.05
    gdn_norm = w["layers.0.linear_attn.norm"]
    assert abs(float(gdn_norm.mean()) - 1.0) < 0.05
    a_log = w["layers.0.linear_attn.A_log"]
    assert ((a_log >= 0.0) & (a_log < np.log(16.0))).all()


def test_deterministic_and_fast(default_checkpoint: Path, tmp_path: Path) -> None:
    messages: list[str] = []
    t0 = time.perf_counter()
    out = write_default_checkpoint(tmp_path / "again", progress=messages.append)
    elapsed = time.perf_counter() - t0
    assert out == tmp_path / "again"
    for name in FILES:
        assert _sha256(out / name) == _sha256(default_checkpoint / name), name
    assert any("training tokenizer" in m for m in messages)
    assert any("writing weights" in m for m in messages)
    assert elapsed < 10.0

    other = write_default_checkpoint(tmp_path / "seed1", seed=1, progress=lambda _m: None)
    assert _sha256(other / "tokenizer.json") == _sha256(out / "tokenizer.json")
    assert _sha256(other / "model.safetensors") != _sha256(out / "model.safetensors")


def test_tokenizer_round_trips_the_corpus(default_checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(default_checkpoint)
    text = CORPUS_PATH.read_text(encoding="utf-8")
    non_ascii = [line for line in text.splitlines() if any(ord(ch) > 127 for ch in line)]
    assert len(non_ascii) >= 10
    for line in non_ascii:
        assert tok.decode(tok.encode(line)) == line, line
    assert tok.decode(tok.encode(text)) == text
    # Multi-byte characters were merged into the vocabulary (a byte-level token for "é" and for "天气").
    assert len(tok.encode("é")) == 1
    assert len(tok.encode("天气")) < len("天气".encode())
    assert tok.encode("<|endoftext|>") == [tok.eos_token_ids[0]]


def test_greedy_output_is_varied_with_clear_margins(default_checkpoint: Path) -> None:
    ck = Checkpoint(default_checkpoint)
    cfg, w = ck.config, load_weights(ck)
    tok = Tokenizer.from_dir(default_checkpoint)
    ids = tok.encode(PROMPT)
    out = greedy_generate(cfg, w, ids, 12)
    assert len(out) == 12 and len(set(out)) >= 4
    # One causal forward over prompt + generated gives every step's logits.
    logits = forward(cfg, w, np.array(ids + out[:-1]))[len(ids) - 1:]
    assert [int(t) for t in logits.argmax(-1)] == out
    top2 = np.sort(logits, axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    assert (margins > 0.05).mean() >= 0.75, margins
    assert 1.5 < float(logits.std(-1).mean()) < 6.0  # "peaky": logits with std ~3
    assert tok.decode(out)  # decodes to some text


def test_transformers_loads_it_and_agrees(default_checkpoint: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    model, info = transformers.AutoModelForCausalLM.from_pretrained(default_checkpoint, output_loading_info=True)
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), (key, info.get(key))
    model.eval()

    tok = Tokenizer.from_dir(default_checkpoint)
    hf_tok = transformers.AutoTokenizer.from_pretrained(default_checkpoint)
    ck = Checkpoint(default_checkpoint)
    w = load_weights(ck)
    for prompt in (PROMPT, "Serving a language model: prefill, then decode; 42 tokens/s. Café ☀️ 天气"):
        ids = tok.encode(prompt)
        assert hf_tok(prompt)["input_ids"] == ids
        with torch.no_grad():
            hf_logits = model(torch.tensor([ids])).logits[0, -1].float().numpy()
        ref = forward(ck.config, w, np.array(ids))[-1]
        np.testing.assert_allclose(hf_logits, ref, rtol=0, atol=1e-4)
