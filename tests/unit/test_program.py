"""The segment programs are the one description of the stateless segments: their numpy interpreter equals the
ONNX graphs the builder lowers them to (for every model type), the runtime weights they read are derived once,
and a ``cuda`` bundle stores exactly those weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from builder.bundle import BuildOptions, build_bundle, verify_checksums
from builder.checkpoint import Checkpoint, load_weights
from builder.segments import build_segment
from hybrid_runtime.config import Manifest
from hybrid_runtime.engine.ort_session import session_options
from hybrid_runtime.program import (
    OPS,
    Op,
    derive_weight,
    output_names,
    programs,
    run_program,
    runtime_weight_specs,
    runtime_weights,
    stored_weight_specs,
)
from hybrid_runtime.weights_io import SafetensorsFile, bf16_to_f32, f32_to_bf16_bits
from tests.hf_models import VOCAB, tiny_raw_config, write_numpy_checkpoint

L_, A_ = "linear_attention", "full_attention"
CONFIGS = {
    "next_moe": ("qwen3_next", {}),
    "next_moe_bias_tied": ("qwen3_next", {"attention_bias": True, "tie_word_embeddings": True,
                                          "layer_types": [L_, A_, L_, A_]}),
    "next_mixed_no_renorm": ("qwen3_next", {"norm_topk_prob": False, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                                            "mlp_only_layers": [3], "layer_types": [L_, L_, L_, A_, L_, L_]}),
    "qwen3_5_dense_full_rope": ("qwen3_5", {"partial_rotary_factor": 1.0, "layer_types": [A_, L_, A_, A_]}),
    "qwen3_5_moe_kernel3": ("qwen3_5_moe", {"linear_conv_kernel_dim": 3, "linear_value_head_dim": 12}),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    model_type, over = CONFIGS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    write_numpy_checkpoint(d, tiny_raw_config(model_type, **over), seed=2)
    from tests.conftest import write_tiny_tokenizer

    write_tiny_tokenizer(d, VOCAB)
    return request.param, d


def _inputs(plan, cfg, T: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, _dt, width in plan.inputs:
        if name == "input_ids":
            out[name] = rng.integers(0, cfg.vocab_size, T).astype(np.int64)
        elif name == "positions":
            out[name] = rng.integers(0, 64, T).astype(np.int64)
        else:
            out[name] = rng.standard_normal((T, width)).astype(np.float32)
    return out


def test_numpy_interpreter_equals_the_onnx_lowering(ckpt: tuple[str, Path]) -> None:
    name, d = ckpt
    ck = Checkpoint(d)
    cfg = ck.config
    w = load_weights(ck)
    rw = runtime_weights(cfg, w, 128)
    rng = np.random.default_rng(0)
    kinds = set()
    for plan, program in programs(cfg):
        kinds |= {op.kind for op in program}
        # every session of this process comes from session_options (one process-wide thread pool)
        sess = ort.InferenceSession(build_segment(cfg, w, plan, 128).SerializeToString(), session_options(None),
                                    providers=["CPUExecutionProvider"])
        feeds = _inputs(plan, cfg, 7, rng)
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        want = run_program(plan, program, feeds, rw)
        assert set(got) == set(want) == set(output_names(plan, program))
        for out in want:
            scale = max(1.0, float(np.abs(want[out]).max()))
            assert np.abs(got[out] - want[out]).max() <= 1e-5 * scale, f"{name}/{plan.name}/{out}"
    assert kinds <= set(OPS)


def test_runtime_weights_have_the_declared_shapes(ckpt: tuple[str, Path]) -> None:
    _, d = ckpt
    ck = Checkpoint(d)
    cfg = ck.config
    w = load_weights(ck)
    specs = runtime_weight_specs(cfg, 64)
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    for s in specs:
        arr = derive_weight(cfg, s.name, w.__getitem__, 64)
        assert arr.shape == s.shape and arr.dtype == np.float32, s
    used = {n for _, prog in programs(cfg) for op in prog for n in op.weights}
    assert used <= set(names)
    stored = {s.name for s in stored_weight_specs(cfg, 64)}
    assert ("lm_head" in stored) == (not cfg.tie_word_embeddings)
    # the fused layouts are concatenations in the documented order
    i = cfg.linear_layers[0]
    p = f"layers.{i}.linear_attn."
    fused = derive_weight(cfg, p + "in_proj", w.__getitem__, 64)
    assert np.array_equal(fused, np.concatenate([w[p + "in_proj_qkv"], w[p + "in_proj_z"], w[p + "in_proj_b"],
                                                 w[p + "in_proj_a"]]))


def test_unknown_op_and_weight_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown op"):
        Op("conv3d", ("x",), ("y",))
    with pytest.raises(KeyError, match="unknown runtime weight"):
        derive_weight(None, "layers.0.nothing", lambda n: np.zeros(1), 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_bundle_stores_the_runtime_weights(ckpt: tuple[str, Path], tmp_path: Path, dtype: str) -> None:
    _, d = ckpt
    out = tmp_path / "cuda"
    m = build_bundle(d, out, BuildOptions(backend="cuda", dtype=dtype, max_seq_len=128, max_input_len=64),
                     progress=lambda _m: None)
    assert m.backend == "cuda" and m.dtype == dtype and all(s.onnx == "" for s in m.segments)
    assert Manifest.load(out).toolkit["program"] == "1"
    assert verify_checksums(out, m) == []
    assert not list(out.glob("segments/*"))
    f = SafetensorsFile(out / m.state_weights)
    ck = Checkpoint(d)
    w = load_weights(ck)
    for s in stored_weight_specs(m.model, 128):
        want = derive_weight(m.model, s.name, w.__getitem__, 128)
        raw = f.raw(s.name)
        if s.matrix and dtype == "bfloat16":
            assert f.dtype(s.name) == "BF16" and np.array_equal(raw, f32_to_bf16_bits(want)), s.name
            assert np.abs(bf16_to_f32(raw) - want).max() <= np.abs(want).max() * 2 ** -8
        else:
            assert f.dtype(s.name) == "F32" and np.array_equal(raw, want), s.name
    assert set(f.keys()) == {s.name for s in stored_weight_specs(m.model, 128)}
