"""The host MoE operator (one onnxruntime graph per layer, ops/moe.py) against the reference's MoE: values,
bit-exact rows whatever the batch, the fused expert layout the bundle stores, file-backed weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from builder.bundle import BuildOptions, build_bundle
from builder.checkpoint import Checkpoint, load_weights
from hybrid_runtime import reference
from hybrid_runtime.config import Manifest
from hybrid_runtime.ops.moe import MoE, fuse_gate_up
from hybrid_runtime.weights_io import SafetensorsFile
from tests.conftest import write_tiny_tokenizer
from tests.hf_models import VOCAB, tiny_raw_config, write_numpy_checkpoint

VARIANTS = {"norm_topk": {}, "no_norm_topk": {"norm_topk_prob": False},
            "no_shared": {"shared_expert_intermediate_size": 0},
            "top1_of_4": {"num_experts": 4, "num_experts_per_tok": 1}}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def moe_bundle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    ckpt = tmp_path_factory.mktemp(f"moe_{request.param}")
    write_numpy_checkpoint(ckpt, tiny_raw_config("qwen3_next", **VARIANTS[request.param]), seed=5)
    write_tiny_tokenizer(ckpt, VOCAB)
    bundle = tmp_path_factory.mktemp("bundle") / request.param
    build_bundle(ckpt, bundle, BuildOptions(max_batch_size=2, max_input_len=32, max_seq_len=64),
                 progress=lambda _m: None)
    ck = Checkpoint(ckpt)
    return bundle, ck.config, load_weights(ck)


def test_fused_layout() -> None:
    gate = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    up = -gate
    fused = fuse_gate_up(gate, up)
    assert fused.shape == (2, 6, 4)
    np.testing.assert_array_equal(fused[:, :3], gate)
    np.testing.assert_array_equal(fused[:, 3:], up)


@pytest.mark.parametrize("T", [0, 1, 5, 70])  # 70: past the rows a layer keeps for decode outputs
def test_moe_matches_reference(moe_bundle, T: int) -> None:
    bundle, cfg, w = moe_bundle
    sw = SafetensorsFile(bundle / Manifest.load(bundle).state_weights)
    rng = np.random.default_rng(T)
    h = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    for layer in range(cfg.num_layers):
        moe = MoE(cfg, sw, layer)
        got = moe(h)
        assert got.shape == (T, cfg.hidden_size) and got.dtype == np.float32
        if T:
            want = reference.moe(cfg, w, layer, h)
            assert np.abs(want).max() > 0.05
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
            np.testing.assert_allclose(moe.numpy_forward(h), want, atol=1e-5, rtol=0)


def test_rows_are_bit_exact_whatever_the_batch(moe_bundle) -> None:
    """A token's output does not depend on which other tokens share the call, to the last bit (batch
    invariance of sampled tokens needs that): alone, in pairs, in the whole batch, and in a batch where
    its experts get no other token."""
    bundle, cfg, _ = moe_bundle
    moe = MoE(cfg, SafetensorsFile(bundle / Manifest.load(bundle).state_weights), 0)
    h = np.random.default_rng(1).standard_normal((9, cfg.hidden_size)).astype(np.float32)
    together = moe(h).copy()
    for t in range(9):
        np.testing.assert_array_equal(moe(h[t:t + 1])[0], together[t])
        np.testing.assert_array_equal(moe(h[[t, (t + 4) % 9]])[0], together[t])
    np.testing.assert_array_equal(moe(np.concatenate([h, h]))[:9], together)


def test_weights_from_a_mapping_and_from_separate_gate_up(moe_bundle) -> None:
    """In-memory weights, and a bundle from before the fused layout (gate/up stored apart)."""
    bundle, cfg, w = moe_bundle
    sw = SafetensorsFile(bundle / Manifest.load(bundle).state_weights)
    h = np.random.default_rng(2).standard_normal((6, cfg.hidden_size)).astype(np.float32)
    want = MoE(cfg, sw, 1)(h).copy()
    mapping = {n: sw.get(n) for n in sw.header if n.startswith("layers.1.mlp.")}
    np.testing.assert_allclose(MoE(cfg, mapping, 1)(h), want, atol=1e-6, rtol=0)
    old = {n: a for n, a in mapping.items() if not n.endswith("gate_up_proj")}
    old["layers.1.mlp.experts.gate_proj"] = w["layers.1.mlp.experts.gate_proj"]
    old["layers.1.mlp.experts.up_proj"] = w["layers.1.mlp.experts.up_proj"]
    np.testing.assert_allclose(MoE(cfg, old, 1)(h), want, atol=1e-6, rtol=0)


def test_bundle_stores_experts_once(moe_bundle) -> None:
    bundle, _cfg, w = moe_bundle
    sw = SafetensorsFile(bundle / Manifest.load(bundle).state_weights)
    names = set(sw.keys())
    assert "layers.0.mlp.experts.gate_up_proj" in names
    assert "layers.0.mlp.experts.gate_proj" not in names and "layers.0.mlp.experts.up_proj" not in names
    inter = w["layers.0.mlp.experts.up_proj"].shape[1]
    np.testing.assert_array_equal(sw.get("layers.0.mlp.experts.gate_up_proj")[:, inter:],
                                  w["layers.0.mlp.experts.up_proj"])
    offset, length = sw.data_range("layers.0.mlp.experts.down_proj")
    with open(Path(sw.path), "rb") as f:
        f.seek(offset)
        raw = np.frombuffer(f.read(length), np.float32)
    np.testing.assert_array_equal(raw, w["layers.0.mlp.experts.down_proj"].reshape(-1))
