"""Cached decoding (onnxruntime segments + stateful CPU operators) equals the full-recompute reference.

Covers every layer kind (GDN, gated attention, dense MLP, MoE) and model layout, with prompts that
cross KV-page, conv-window and prefill-chunk boundaries, in both profile-pinning modes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from builder.bundle import BuildOptions, build_bundle
from builder.checkpoint import Checkpoint, load_weights
from hybrid_runtime import reference
from hybrid_runtime.config import FULL, LINEAR, Manifest
from hybrid_runtime.engine import Phase
from hybrid_runtime.runner import ModelRunner, SeqStep
from tests.conftest import write_tiny_tokenizer
from tests.hf_models import VOCAB, tiny_raw_config, write_numpy_checkpoint

VARIANTS = {
    "next_moe": ("qwen3_next", {}),
    "next_mixed_dense": ("qwen3_next", {"decoder_sparse_step": 2, "norm_topk_prob": False}),
    "qwen3_5_dense_hd256": ("qwen3_5", {"head_dim": 256}),
    "qwen3_5_moe_pattern": ("qwen3_5_moe", {"layer_types": [FULL, LINEAR, LINEAR, FULL]}),
    "tied_bias": ("qwen3_next", {"tie_word_embeddings": True, "attention_bias": True}),
}
PAGE, CHUNK = 4, 16  # small pages and prefill chunks so short prompts cross their boundaries


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model_type, overrides = VARIANTS[request.param]
    ckpt = tmp_path_factory.mktemp(f"ckpt_{request.param}")
    write_numpy_checkpoint(ckpt, tiny_raw_config(model_type, **overrides), seed=3)
    write_tiny_tokenizer(ckpt, VOCAB)
    bundle = tmp_path_factory.mktemp("bundle") / request.param
    build_bundle(ckpt, bundle, BuildOptions(max_batch_size=4, max_input_len=64, max_seq_len=96, max_num_tokens=CHUNK,
                                            page_size=PAGE), progress=lambda _m: None)
    ck = Checkpoint(ckpt)
    return bundle, ck.config, load_weights(ck)


def _run_sequence(runner: ModelRunner, slot: int, ids: list[int], n_prompt: int) -> list[np.ndarray]:
    """Prefill ``ids[:n_prompt]`` in CHUNK-token chunks, then decode the rest one token at a time;
    returns the logits of every step (last position of each prefill chunk, then each decode)."""
    runner.state.reset(slot)
    pages = list(range(slot * 20, slot * 20 + 20))
    out = []
    for start in range(0, n_prompt, CHUNK):
        chunk = ids[start:min(n_prompt, start + CHUNK)]
        out.append(runner.run(Phase.PREFILL, [SeqStep(slot, pages, start, chunk)])[0])
    for t in range(n_prompt, len(ids)):
        out.append(runner.run(Phase.DECODE, [SeqStep(slot, pages, t, [ids[t]])])[0])
    return out


@pytest.mark.parametrize("pinning", ["per_context", "single_context"])
def test_cached_decode_matches_reference(variant, pinning: str) -> None:
    bundle, cfg, w = variant
    runner = ModelRunner(bundle, Manifest.load(bundle), pinning=pinning)
    rng = np.random.default_rng(7)
    for n_prompt in (1, 3, 5, 17, 37):  # crosses pages (4), conv windows (4) and prefill chunks (16)
        ids = [int(t) for t in rng.integers(0, VOCAB, n_prompt + 6)]
        full = reference.forward(cfg, w, np.array(ids))
        got = _run_sequence(runner, slot=1, ids=ids, n_prompt=n_prompt)
        chunk_ends = [min(n_prompt, s + CHUNK) - 1 for s in range(0, n_prompt, CHUNK)]
        positions = chunk_ends + list(range(n_prompt, len(ids)))
        for pos, logits in zip(positions, got):
            np.testing.assert_allclose(logits, full[pos], atol=1e-4, rtol=0,
                                       err_msg=f"n_prompt={n_prompt} position {pos}")
        assert np.abs(full).max() > 0.05, "logits too small for the comparison to mean anything"
    if pinning == "per_context":
        assert runner.engine.profile_switches == 0
        assert runner.engine.num_contexts() == 2 * len(runner.plans)
    else:
        assert runner.engine.profile_switches > 0
        assert runner.engine.num_contexts() == len(runner.plans)


def test_batched_decode_rows_are_independent(variant) -> None:
    """A decode batch of sequences in non-contiguous slots equals each sequence run alone."""
    bundle, cfg, w = variant
    runner = ModelRunner(bundle, Manifest.load(bundle))
    rng = np.random.default_rng(11)
    seqs = {slot: [int(t) for t in rng.integers(0, VOCAB, n)] for slot, n in ((0, 9), (2, 4), (3, 21))}
    pages = {slot: list(range(slot * 20, slot * 20 + 20)) for slot in seqs}
    for slot, ids in seqs.items():  # prefill all but the last 3 tokens of each
        _run_sequence(runner, slot, ids[:-3], len(ids) - 3)
    for k in range(3, 0, -1):
        steps = [SeqStep(s, pages[s], len(ids) - k, [ids[-k]]) for s, ids in seqs.items()]
        logits = runner.run(Phase.DECODE, steps)
        for row, (_s, ids) in enumerate(seqs.items()):
            ref = reference.forward(cfg, w, np.array(ids[:len(ids) - k + 1]))[-1]
            np.testing.assert_allclose(logits[row], ref, atol=1e-4, rtol=0)


def test_segments_reject_shapes_outside_profile(variant) -> None:
    from hybrid_runtime.engine import ShapeError

    bundle, cfg, _ = variant
    runner = ModelRunner(bundle, Manifest.load(bundle))
    head = len(runner.plans) - 1
    too_many = np.zeros((runner.manifest.limits.max_batch_size + 1, cfg.hidden_size), np.float32)
    with pytest.raises(ShapeError, match="decode profile range"):
        runner.engine.run(head, Phase.DECODE, {"x": too_many})
    with pytest.raises(ShapeError, match="expected float32"):
        runner.engine.run(head, Phase.DECODE, {"x": np.zeros((1, cfg.hidden_size), np.float64)})
    with pytest.raises(ShapeError, match="inputs"):
        runner.engine.run(head, Phase.DECODE, {"y": np.zeros((1, cfg.hidden_size), np.float32)})


def test_bundle_dir_is_self_contained(variant, tmp_path: Path) -> None:
    """The runtime needs nothing but the bundle folder (moved elsewhere, it still loads and runs)."""
    import shutil

    bundle, _, _ = variant
    moved = tmp_path / "moved"
    shutil.copytree(bundle, moved)
    runner = ModelRunner(moved, Manifest.load(moved))
    runner.state.reset(0)
    assert runner.run(Phase.PREFILL, [SeqStep(0, [0, 1], 0, [1, 2, 3])]).shape == (1, VOCAB)
