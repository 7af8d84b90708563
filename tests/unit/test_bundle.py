"""The engine bundle: manifest fields, checksums, workarounds independent of batch size, CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from builder import workarounds
from builder.bundle import BuildOptions, build_bundle, describe, verify_checksums
from builder.checkpoint import Checkpoint, load_weights
from hybrid_runtime import reference
from hybrid_runtime.config import BundleError, ConfigError, Manifest
from hybrid_runtime.engine.ort_session import cpu_session, session_options


def test_manifest_records_limits_profiles_and_toolkit(default_bundle: Path) -> None:
    m = Manifest.load(default_bundle)
    raw = json.loads((default_bundle / "manifest.json").read_text())
    assert raw["version"] == 1 and raw["backend"] == "onnxruntime" and raw["dtype"] == "float32"
    assert [p["name"] for p in raw["profiles"]] == ["prefill", "decode"]
    prefill, decode = m.profiles
    assert (prefill.min_tokens, prefill.max_tokens) == (1, m.limits.max_num_tokens)
    assert (decode.min_tokens, decode.max_tokens) == (1, m.limits.max_batch_size) == (1, 16)
    assert raw["toolkit"]["onnxruntime"] == ort.__version__ and raw["target"]["arch"] == "cpu"
    assert {w["id"] for w in raw["workarounds"]} == {w.id for w in workarounds.select("onnxruntime", ort.__version__,
                                                                                      "cpu")}
    assert all(w["reason"] for w in raw["workarounds"])
    assert raw["tokenizer"]["eos_token_ids"] == [0]
    assert verify_checksums(default_bundle, m) == []
    for seg in m.segments:  # every segment is checker-clean with its weights outside the graph
        onnx.checker.check_model(str(default_bundle / seg.onnx))
    assert "profile prefill" in describe(default_bundle)


def test_checksum_mismatch_is_reported(default_bundle: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(default_bundle, copy)
    (copy / "segments" / "head.onnx.data").write_bytes(b"tampered")
    assert verify_checksums(copy, Manifest.load(copy)) == ["segments/head.onnx.data"]


def test_workarounds_do_not_depend_on_max_batch_size(default_checkpoint: Path, tmp_path: Path) -> None:
    recorded = []
    for mbs in (1, 2, 16):
        out = tmp_path / f"b{mbs}"
        build_bundle(default_checkpoint, out, BuildOptions(max_batch_size=mbs, max_input_len=32, max_seq_len=64),
                     progress=lambda _m: None)
        recorded.append(json.loads((out / "manifest.json").read_text())["workarounds"])
    assert recorded[0] == recorded[1] == recorded[2] and recorded[0]
    import inspect

    assert list(inspect.signature(workarounds.select).parameters) == ["toolkit", "version", "arch"]


def test_embed_and_head_segments_reproduce_the_reference(default_bundle: Path, default_checkpoint: Path) -> None:
    ck = Checkpoint(default_checkpoint)
    cfg, w = ck.config, load_weights(ck)
    m = Manifest.load(default_bundle)
    ids = np.array([5, 17, 300, 2047, 9], np.int64)
    head = cpu_session(default_bundle / m.segments[-1].onnx, session_options())
    x = np.random.default_rng(0).standard_normal((5, cfg.hidden_size)).astype(np.float32)
    want = reference.rmsnorm1p(x, w["norm"], cfg.rms_norm_eps) @ w["lm_head"].T
    np.testing.assert_allclose(head.run(None, {"x": x})[0], want, atol=1e-4, rtol=1e-5)
    embed = cpu_session(default_bundle / m.segments[0].onnx, session_options())
    out = dict(zip([o.name for o in embed.get_outputs()], embed.run(None, {"input_ids": ids})))
    np.testing.assert_array_equal(out["x_next"], w["embed_tokens"][ids])
    h = reference.rmsnorm1p(w["embed_tokens"][ids], w["layers.0.input_layernorm"], cfg.rms_norm_eps)
    p = "layers.0.linear_attn."
    np.testing.assert_allclose(out["u"], h @ w[p + "in_proj_qkv"].T, atol=1e-4, rtol=1e-5)
    g = -np.exp(w[p + "A_log"]) * reference.softplus(h @ w[p + "in_proj_a"].T + w[p + "dt_bias"])
    np.testing.assert_allclose(out["g"], g, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out["beta"], reference.sigmoid(h @ w[p + "in_proj_b"].T), atol=1e-6)


@pytest.mark.parametrize("args, message", [
    (["--max-seq-len", "999999"], "max_position_embeddings"),
    (["--max-batch-size", "0"], "max_batch_size"),
    (["--max-input-len", "4096", "--max-seq-len", "4096"], "max_input_len"),
])
def test_builder_cli_errors_are_clear(default_checkpoint: Path, tmp_path: Path, args: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "builder", "build", "--checkpoint", str(default_checkpoint),
                        "--output", str(tmp_path / "o"), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_manifest_load_errors(tmp_path: Path, default_bundle: Path) -> None:
    with pytest.raises(BundleError, match=r"no manifest\.json"):
        Manifest.load(tmp_path)
    raw = json.loads((default_bundle / "manifest.json").read_text())
    raw["version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(BundleError, match="version 99"):
        Manifest.load(tmp_path)
    raw["version"] = 1
    raw["model"]["layer_types"] = ["mamba"] * raw["model"]["num_layers"]
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="mamba"):
        Manifest.load(tmp_path)
