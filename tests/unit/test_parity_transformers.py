"""Parity of our checkpoint loader + numpy reference forward with Hugging Face transformers.

Tiny random models are built with transformers' own classes (see ``tests/hf_models.py``), re-initialised
at a scale where every path moves the logits, saved with ``save_pretrained`` and loaded back with
``builder.checkpoint``. ``hybrid_runtime.reference.forward`` must then reproduce transformers' float32
logits at every position to 1e-4, and ``reference.greedy_generate`` its greedy tokens (compared up to
the first step where transformers' own top-1/top-2 margin is too small to call).

The error-case tests at the bottom use numpy only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from builder.checkpoint import Checkpoint, CheckpointError, load_weights
from builder.hf_config import load_hf_config, parse_hf_config
from hybrid_runtime import reference
from hybrid_runtime.config import DENSE, FULL, LINEAR, MOE, ConfigError
from tests import hf_models as hm

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ATOL = 1e-4  # logits, absolute
MARGIN = 1e-3  # greedy tokens are compared while transformers' top-1/top-2 margin is at least this
NEW_TOKENS = 8

_max_err: dict[str, float] = {}


def _record(case: str, err: float) -> None:
    _max_err[case] = max(err, _max_err.get(case, 0.0))


@pytest.fixture(scope="module", autouse=True)
def _report_max_error():
    yield
    if _max_err:
        worst = max(_max_err, key=_max_err.get)
        print(f"\n[parity] max |logit error| over {len(_max_err)} cases: {_max_err[worst]:.3g} ({worst})")


def _load(directory: Path):
    ck = Checkpoint(directory)
    return ck, load_weights(ck)


def _check_logits(case: str, model, cfg, w, ids: list[int]) -> np.ndarray:
    want = hm.hf_logits(model, ids)
    got = reference.forward(cfg, w, np.array(ids))
    assert got.shape == want.shape == (len(ids), cfg.vocab_size)
    assert got.dtype == np.float32
    # The test is only meaningful if the logits are far from zero and spread out.
    assert np.ptp(want[-1]) > 3.0, f"{case}: logits too flat ({np.ptp(want[-1]):.3g}); re-init too weak"
    err_all = np.abs(got - want).max(axis=1)
    _record(case, float(err_all.max()))
    assert err_all[-1] <= ATOL, f"{case}: last-position logit error {err_all[-1]:.3g}"
    worst = int(err_all.argmax())
    assert err_all.max() <= ATOL, f"{case}: logit error {err_all[worst]:.3g} at position {worst}"
    return want


def _check_greedy(case: str, model, cfg, w, ids: list[int], min_compared: int = 3) -> None:
    want, margins = hm.hf_greedy(model, ids, NEW_TOKENS)
    assert len(want) == NEW_TOKENS
    n = next((i for i, m in enumerate(margins) if m < MARGIN), NEW_TOKENS)
    assert n >= min_compared, f"{case}: near-tie at step {n} (margins {margins}); pick another seed"
    got = reference.greedy_generate(cfg, w, ids, n)
    assert got == want[:n], f"{case}: greedy tokens differ (compared {n} steps; margins {margins})"
    print(f"[parity] {case}: greedy compared {n}/{NEW_TOKENS} steps, min margin {min(margins[:n]):.3g}")


# ---- model cases ---------------------------------------------------------------------------------------

# name -> (config factory, prompt length, expected layer_types, expected ffn_types)
L, A, D, M = LINEAR, FULL, DENSE, MOE
CASES = {
    "next_moe_norm_topk": (lambda: hm.qwen3_next_config(), 12, (L, L, L, A), (M,) * 4),
    "next_moe_no_norm_topk": (lambda: hm.qwen3_next_config(norm_topk_prob=False), 12, (L, L, L, A), (M,) * 4),
    "next_mixed_dense_moe": (
        lambda: hm.qwen3_next_config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]),
        12, (L, L, L, A, L, L), (D, M, D, D, D, M)),
    "qwen3_5_dense_multimodal": (lambda: hm.qwen3_5_config(), 12, (L, L, L, A), (D,) * 4),
    "qwen3_5_moe_multimodal": (lambda: hm.qwen3_5_config(moe=True), 12, (L, L, L, A), (M,) * 4),
    "qwen3_5_text_causal_lm": (lambda: hm.qwen3_5_text_config(full_attention_interval=2), 12, (L, A, L, A), (D,) * 4),
    "qwen3_5_moe_text_causal_lm": (lambda: hm.qwen3_5_text_config(moe=True), 12, (L, L, L, A), (M,) * 4),
    "head_dim_256": (
        lambda: hm.qwen3_next_config(moe=False, head_dim=256, num_attention_heads=2, num_key_value_heads=1,
                                     layer_types=[L, A, L, A]),
        12, (L, A, L, A), (D,) * 4),
    "explicit_layer_types": (
        lambda: hm.qwen3_next_config(layer_types=[A, L, A, L]), 12, (A, L, A, L), (M,) * 4),
    "tied_embeddings_next": (lambda: hm.qwen3_next_config(tie_word_embeddings=True), 12, (L, L, L, A), (M,) * 4),
    "tied_embeddings_qwen3_5": (lambda: hm.qwen3_5_config(tie_word_embeddings=True), 12, (L, L, L, A), (D,) * 4),
    "attention_bias": (
        lambda: hm.qwen3_next_config(attention_bias=True, layer_types=[L, A, L, A]), 12, (L, A, L, A), (M,) * 4),
    "rope_full_rotary_theta": (
        lambda: hm.qwen3_5_text_config(partial_rotary_factor=1.0, rope_theta=500.0, layer_types=[A, L, A, A]),
        12, (A, L, A, A), (D,) * 4),
    "gdn_kernel3_wide_values": (
        lambda: hm.qwen3_next_config(moe=False, linear_conv_kernel_dim=3, linear_num_key_heads=1,
                                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=12),
        12, (L, L, L, A), (D,) * 4),
    "long_prompt_150": (lambda: hm.qwen3_next_config(), 150, (L, L, L, A), (M,) * 4),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Build + save each case once per module: name -> (model, folder)."""
    cache: dict[str, tuple[object, Path]] = {}

    def get(name: str, seed: int = 0):
        if name not in cache:
            factory = CASES[name][0]
            model = hm.build_model(factory(), seed=seed)
            d = hm.save_model(model, tmp_path_factory.mktemp(name))
            cache[name] = (model, d)
        return cache[name]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_transformers(case, saved):
    _, n_prompt, layer_types, ffn_types = CASES[case]
    model, d = saved(case)
    ck, w = _load(d)
    cfg = ck.config
    assert cfg.layer_types == layer_types
    assert cfg.ffn_types == ffn_types
    # our parse agrees with transformers' own view of the model
    tcfg = model.config.get_text_config()
    assert list(cfg.layer_types) == list(tcfg.layer_types)
    assert cfg.tie_word_embeddings == bool(model.config.tie_word_embeddings)
    names = set(ck.names())
    if cfg.tie_word_embeddings:
        assert not ck.has("lm_head.weight")
        assert w["lm_head"] is w["embed_tokens"]
    if isinstance(model.config, type(tcfg)):  # text-only class
        assert ck.layout.prefix == "model."
    else:  # multimodal wrapper: text under model.language_model.*, vision present but ignored
        assert ck.layout.prefix == "model.language_model."
        assert any(n.startswith("model.visual.") for n in hm.read_all(d))
        assert not any(n.startswith("model.visual.") for n in names)
    if MOE in ffn_types:
        assert cfg.norm_topk_prob == bool(getattr(tcfg, "norm_topk_prob", True))

    ids = hm.prompt(n_prompt, seed=1)
    _check_logits(case, model, cfg, w, ids)
    _check_greedy(case, model, cfg, w, ids)


def test_sensitivity_of_the_parity_check(saved):
    """A few plausible implementation mistakes each move the logits far beyond the tolerance."""
    model, d = saved("next_moe_norm_topk")
    ck, w = _load(d)
    cfg = ck.config
    ids = hm.prompt(12, seed=1)
    want = hm.hf_logits(model, ids)
    ok = np.abs(reference.forward(cfg, w, np.array(ids)) - want).max()
    assert ok <= ATOL
    mutants = {
        "norm_topk_prob flipped": (dataclasses.replace(cfg, norm_topk_prob=False), w),
        "full rotary": (dataclasses.replace(cfg, rotary_dim=cfg.head_dim), w),
        "one expert fewer": (dataclasses.replace(cfg, num_experts_per_tok=1), w),
        "A_log ignored": (cfg, {**w, **{k: np.zeros_like(v) for k, v in w.items() if k.endswith("A_log")}}),
        "q/k norm weight ignored": (cfg, {**w, **{k: np.zeros_like(v) for k, v in w.items()
                                                 if k.endswith(("q_norm", "k_norm"))}}),
        "GDN value heads permuted": (cfg, {**w, "layers.0.linear_attn.in_proj_z": np.roll(
            w["layers.0.linear_attn.in_proj_z"], cfg.linear_value_head_dim, axis=0)}),
        "shared-expert gate ignored": (cfg, {**w, **{k: np.full_like(v, 0.0) for k, v in w.items()
                                                    if k.endswith("shared_expert_gate")}}),
    }
    for what, (c, ww) in mutants.items():
        err = np.abs(reference.forward(c, ww, np.array(ids)) - want).max()
        assert err > 100 * ATOL, f"the parity check would not catch: {what} (error only {err:.3g})"


# ---- checkpoint storage variants -----------------------------------------------------------------------


def _fused_state_matches_file(model_state: dict[str, np.ndarray], ck: Checkpoint) -> int:
    """Every stored text tensor equals the model's in-memory tensor bit-exactly; returns how many."""
    n = 0
    for name in ck.names():
        got = ck.get(name)
        parts = name.split(".")
        if ".experts." in name and name not in model_state:  # per-expert file name -> fused memory slice
            i = parts.index("experts")
            e, proj = int(parts[i + 1]), parts[i + 2]
            base = ".".join(parts[:i + 1])
            if proj == "down_proj":
                want = model_state[base + ".down_proj"][e]
            else:
                gu = model_state[base + ".gate_up_proj"][e]
                half = gu.shape[0] // 2
                want = gu[:half] if proj == "gate_proj" else gu[half:]
        else:
            want = model_state[name]
        assert got.dtype == np.float32
        assert got.shape == want.shape, name
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{name} not bit-exact"
        n += 1
    return n


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint_widens_exactly(dtype, saved, tmp_path):
    tdtype = getattr(torch, dtype)
    model, d32 = saved("next_moe_norm_topk")
    d = hm.save_model(model, tmp_path / dtype, dtype=tdtype)
    ck, w = _load(d)
    assert ck.stored_dtypes() == {{"bfloat16": "BF16", "float16": "F16"}[dtype]}
    assert ck.layout.torch_dtype == dtype
    rounded = hm.rounded_copy(model, tdtype)
    assert _fused_state_matches_file(hm.text_state_dict(rounded), ck) > 50
    # the rounded weights, saved in float32, load to the very same canonical arrays
    _, w32 = _load(hm.save_model(rounded, tmp_path / f"{dtype}_as_f32"))
    assert w.keys() == w32.keys()
    for k in w:
        assert np.array_equal(w[k], w32[k]), k
    # and the widened weights still run like transformers (in float32 on the same rounded weights)
    ids = hm.prompt(12, seed=1)
    _check_logits(f"{dtype}_checkpoint", rounded, ck.config, w, ids)
    # sanity: rounding really changed the weights, so the comparison above is not the float32 one
    _, w_orig = _load(d32)
    assert not np.array_equal(w["embed_tokens"], w_orig["embed_tokens"])


def test_float32_file_matches_model_bit_exactly(saved):
    for case in ("next_moe_norm_topk", "qwen3_5_moe_multimodal", "attention_bias"):
        model, d = saved(case)
        assert _fused_state_matches_file(hm.text_state_dict(model), Checkpoint(d)) > 30


def test_sharded_checkpoint(saved, tmp_path):
    model, d_single = saved("next_moe_norm_topk")
    d = hm.save_model(model, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert sorted(p.name for p in d.glob("*.safetensors")) == shards
    ck, w = _load(d)
    _, w_single = _load(d_single)
    assert w.keys() == w_single.keys()
    for k in w:
        assert np.array_equal(w[k], w_single[k]), k
    _check_logits("sharded", model, ck.config, w, hm.prompt(12, seed=1))


@pytest.mark.parametrize("case", ["legacy_next_interval2", "legacy_qwen3_5_moe"])
def test_legacy_config_spelling(case, tmp_path):
    import transformers

    factory = {
        "legacy_next_interval2": lambda: hm.qwen3_next_config(full_attention_interval=2, partial_rotary_factor=0.5,
                                                              rope_theta=1000.0),
        "legacy_qwen3_5_moe": lambda: hm.qwen3_5_config(moe=True),
    }[case]
    model = hm.build_model(factory(), seed=3)
    d_new = hm.save_model(model, tmp_path / "v5")
    cfg_new, _ = load_hf_config(d_new)
    d = hm.save_model(model, tmp_path / "legacy")
    raw = hm.legacyfy_config(d)
    text = (d / "config.json").read_text()
    assert "Infinity" in text and '"dtype"' not in text and '"torch_dtype"' in text
    tc = raw.get("text_config", raw)
    assert "layer_types" not in tc and "rope_parameters" not in tc and "dtype" not in tc
    assert tc["full_attention_interval"] in (2, 4) and tc["time_step_limit"] == [0.0, float("inf")]
    ck, w = _load(d)
    assert ck.config == cfg_new
    assert ck.layout.torch_dtype == "float32"
    ids = hm.prompt(12, seed=2)
    _check_logits(case, model, ck.config, w, ids)
    # the rewritten folder is a faithful legacy checkpoint: transformers itself reads it the same way
    if case == "legacy_next_interval2":
        again = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        assert list(again.config.layer_types) == list(ck.config.layer_types)
        np.testing.assert_array_equal(hm.hf_logits(again, ids), hm.hf_logits(model, ids))


@pytest.mark.parametrize("case", ["next_moe_norm_topk", "qwen3_5_moe_multimodal", "next_mixed_dense_moe"])
def test_fused_in_memory_moe_form(case, saved, tmp_path):
    model, d = saved(case)
    state = hm.text_state_dict(model)
    state["mtp.fc.weight"] = np.ones((3, 5), np.float32)  # multi-token-prediction tensors are ignored
    d_fused = hm.fused_experts_file(state, tmp_path / "fused", d)
    ck_fused, w_fused = _load(d_fused)
    stored = set(ck_fused.names())
    assert any(n.endswith("experts.gate_up_proj") for n in stored)
    assert not any(".experts.0." in n for n in stored)
    gu = next(n for n in stored if n.endswith("experts.gate_up_proj"))
    cfg = ck_fused.config
    assert ck_fused.get(gu).shape == (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    _, w = _load(d)
    assert w_fused.keys() == w.keys()
    for k in w:
        assert w_fused[k].dtype == w[k].dtype == np.float32, k
        assert np.array_equal(w_fused[k], w[k]), k


# ---- error cases (numpy only) --------------------------------------------------------------------------


def _config_error(raw, *must_name: str) -> str:
    with pytest.raises(ConfigError) as ei:
        parse_hf_config(raw)
    msg = str(ei.value)
    for s in must_name:
        assert s in msg, f"{s!r} not named in: {msg}"
    return msg


def test_tiny_numpy_checkpoint_loads(tmp_path):
    for model_type in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        d = hm.write_numpy_checkpoint(tmp_path / model_type, hm.tiny_raw_config(model_type))
        ck, w = _load(d)
        out = reference.forward(ck.config, w, np.arange(5))
        assert out.shape == (5, hm.VOCAB) and np.isfinite(out).all()


def test_error_unsupported_model_type():
    _config_error(hm.tiny_raw_config(model_type="llama"), "model_type", "'llama'")
    _config_error({**hm.tiny_raw_config(), "model_type": "qwen3_moe"}, "model_type", "'qwen3_moe'")


def test_error_hidden_act():
    _config_error(hm.tiny_raw_config(hidden_act="gelu"), "hidden_act", "'gelu'")
    raw = hm.tiny_raw_config("qwen3_5", hidden_act="gelu")
    _config_error(raw, "hidden_act", "'gelu'")


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_parameters_minimal", "legacy_rope_scaling"])
def test_error_rope_yarn(spelling):
    raw = hm.tiny_raw_config()
    yarn = {"factor": 4.0, "original_max_position_embeddings": 256}
    if spelling == "rope_parameters":
        raw["rope_parameters"] = {**raw["rope_parameters"], "rope_type": "yarn", **yarn}
    elif spelling == "rope_parameters_minimal":
        raw["rope_parameters"] = {**raw["rope_parameters"], "rope_type": "yarn"}
    else:
        del raw["rope_parameters"]
        raw.update(rope_theta=10000.0, partial_rotary_factor=0.25, rope_scaling={"type": "yarn", **yarn})
    _config_error(raw, "rope_type", "'yarn'")


def test_error_layer_type_mamba(tmp_path):
    raw = hm.tiny_raw_config(layer_types=[LINEAR, "mamba", LINEAR, FULL])
    _config_error(raw, "layer_types", "'mamba'")
    wrapped = hm.tiny_raw_config("qwen3_5", layer_types=[LINEAR, "mamba", LINEAR, FULL])
    _config_error(wrapped, "layer_types", "'mamba'")
    # and through the checkpoint folder (the legacy-tolerant json reader)
    hm.write_config(tmp_path, raw)
    with pytest.raises(ConfigError, match="mamba"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("model_type,name", [
    ("qwen3_next", "model.layers.1.linear_attn.in_proj_ba.weight"),
    ("qwen3_next", "model.layers.3.self_attn.k_norm.weight"),
    ("qwen3_next", "model.layers.2.mlp.experts.5.up_proj.weight"),
    ("qwen3_next", "lm_head.weight"),
    ("qwen3_5_moe", "model.language_model.layers.0.linear_attn.in_proj_z.weight"),
    ("qwen3_5_moe", "model.language_model.norm.weight"),
])
def test_error_missing_tensor(model_type, name, tmp_path):
    d = hm.write_numpy_checkpoint(tmp_path, hm.tiny_raw_config(model_type), drop=[name])
    with pytest.raises(ConfigError) as ei:
        load_weights(Checkpoint(d))
    assert isinstance(ei.value, CheckpointError)
    assert name in str(ei.value) and "missing" in str(ei.value)


@pytest.mark.parametrize("model_type,name,shape", [
    ("qwen3_next", "model.embed_tokens.weight", (hm.VOCAB, 16)),
    ("qwen3_next", "lm_head.weight", (hm.VOCAB + 1, 32)),
    ("qwen3_next", "model.norm.weight", (16,)),
    ("qwen3_next", "model.layers.0.input_layernorm.weight", (31,)),
    ("qwen3_next", "model.layers.0.post_attention_layernorm.weight", (1,)),
    ("qwen3_next", "model.layers.0.linear_attn.in_proj_qkvz.weight", (88, 32)),
    ("qwen3_next", "model.layers.0.linear_attn.in_proj_ba.weight", (6, 32)),
    ("qwen3_next", "model.layers.1.linear_attn.conv1d.weight", (64, 1, 3)),
    ("qwen3_next", "model.layers.1.linear_attn.A_log", (2,)),
    ("qwen3_next", "model.layers.3.self_attn.q_proj.weight", (64, 32)),
    ("qwen3_next", "model.layers.3.self_attn.q_norm.weight", (8,)),
    ("qwen3_next", "model.layers.2.mlp.gate.weight", (7, 32)),
    ("qwen3_next", "model.layers.2.mlp.experts.3.down_proj.weight", (32, 15)),
    ("qwen3_next", "model.layers.2.mlp.shared_expert.up_proj.weight", (24, 30)),
    ("qwen3_next", "model.layers.2.mlp.shared_expert_gate.weight", (2, 32)),
    ("qwen3_5", "model.language_model.layers.0.linear_attn.in_proj_qkv.weight", (63, 32)),
    ("qwen3_5", "model.language_model.layers.0.mlp.down_proj.weight", (32, 47)),
])
def test_error_wrong_shape(model_type, name, shape, tmp_path):
    d = hm.write_numpy_checkpoint(tmp_path, hm.tiny_raw_config(model_type), reshape={name: shape})
    with pytest.raises(ConfigError) as ei:
        load_weights(Checkpoint(d))
    assert isinstance(ei.value, CheckpointError)
    msg = str(ei.value)
    assert name in msg, msg
    assert str(tuple(shape)) in msg, msg


def test_error_wrong_bias_shape(tmp_path):
    raw = hm.tiny_raw_config(attention_bias=True)
    name = "model.layers.3.self_attn.o_proj.bias"
    d = hm.write_numpy_checkpoint(tmp_path, raw, reshape={name: (31,)})
    with pytest.raises(CheckpointError, match=r"o_proj\.bias.*\(31,\)"):
        load_weights(Checkpoint(d))
