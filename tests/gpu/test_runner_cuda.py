"""The runtime on the GPU operators (``device="cuda"``) against the numpy operators (``device="cpu"``):

(a) ModelRunner logits for a multi-chunk prefill + 20 decode steps of 3 sequences in non-contiguous slots
    and scattered pages, plus the final state and KV caches;
(b) ServingEngine greedy output ids for 16 concurrent requests of mixed lengths;
(c) multi_block_mode on vs off on the GPU: same tokens, and "on" really used the split-KV kernels.

Both sides run the same onnxruntime segments and numpy MoE; only the stateful operators differ.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from runner_cases import Driver, build_default_bundle, cpu_logits, scattered_tables

from hybrid_runtime.config import Manifest
from hybrid_runtime.runner import ModelRunner
from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.serving import Event, GenerationRequest, RuntimeOptions, ServingEngine, generate

pytestmark = pytest.mark.gpu

ATOL = 1e-3
MARGIN = 1e-3  # a greedy divergence is accepted only where CPU's top-1/top-2 margin is below this


@pytest.fixture(scope="module")
def long_bundle(default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model with prompts up to 768 tokens, so contexts span many chunks of the GPU's
    ``min_chunk_tokens`` and multi_block_mode=on splits (prefill queries and decode steps). Built from the
    session's default checkpoint rather than writing a second copy of it."""
    return build_default_bundle(tmp_path_factory.mktemp("long"), max_seq_len=1024, max_input_len=768,
                                checkpoint=default_checkpoint)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm((a - b).ravel()) / max(float(np.linalg.norm(b.ravel())), 1e-30))


def test_runner_cuda_matches_cpu(default_bundle: Path) -> None:
    m = Manifest.load(default_bundle)
    cpu, gpu = ModelRunner(default_bundle, m), ModelRunner(default_bundle, m, device="cuda")
    assert gpu.device == "cuda:0" and cpu.device == "cpu"
    with pytest.raises(AttributeError, match="cpu operators"):
        _ = gpu.state
    rng = np.random.default_rng(0)
    slots, lens, decode_steps = [5, 0, 11], [200, 37, 150], 20
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in lens]
    tables = scattered_tables(m, [n + decode_steps for n in lens], seed=1)
    drv = Driver([cpu, gpu], slots, tables, prompts)
    worst = 0.0
    rounds = drv.prefill(chunk=80)  # 3 rounds: every prompt but the shortest spans several chunks
    assert len(rounds) == 3
    for a, b in rounds:
        assert a.shape == b.shape and np.isfinite(b).all()
        worst = max(worst, float(np.abs(a - b).max()))
    for _ in range(decode_steps):
        a, b = drv.decode()
        assert a.shape == (3, m.model.vocab_size)
        worst = max(worst, float(np.abs(a - b).max()))
    assert worst < ATOL, f"max |cpu - cuda| logit difference {worst:.2e}"
    cfg = m.model
    for layer in cfg.linear_layers:  # the slots' states agree, untouched slots (and the sink) stay zero
        (cc, rc), (cg, rg) = cpu.ops.state_arrays(layer), gpu.ops.state_arrays(layer)
        assert rel(cg[slots], cc[slots]) < 1e-4 and rel(rg[slots], rc[slots]) < 1e-4, f"layer {layer}"
        others = np.setdiff1d(np.arange(cg.shape[0]), slots)
        assert not cg[others].any() and not rg[others].any()
    used = sorted(p for t in tables for p in t)
    for layer in cfg.attention_layers:
        (kc, vc), (kg, vg) = cpu.ops.kv_arrays(layer), gpu.ops.kv_arrays(layer)
        assert rel(kg[used], kc[used]) < 1e-4 and rel(vg[used], vc[used]) < 1e-4, f"layer {layer}"
    assert gpu.dispatcher.plans["single_block"] > 0 and not gpu.dispatcher.errors
    assert {"gdn", "attention", "moe", "segments"} <= set(gpu.timings)
    gpu.ops.reset_slot(5)  # a reset zeroes that slot only
    conv, rec = gpu.ops.state_arrays(cfg.linear_layers[0])
    assert not conv[5].any() and not rec[5].any() and rec[0].any()


def _requests(rng: np.random.Generator, vocab: int, shapes: list[tuple[int, int]], ignore_eos: bool
              ) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", prompt_ids=tuple(int(t) for t in rng.integers(3, vocab, n)),
                              params=SamplingParams(max_tokens=mt, ignore_eos=ignore_eos or i % 2 == 0))
            for i, (n, mt) in enumerate(shapes)]


def _serve(bundle: Path, reqs: list[GenerationRequest], **opts: object) -> tuple[list[Event], Counter, Counter]:
    eng = ServingEngine(bundle, RuntimeOptions(**opts)).start()  # type: ignore[arg-type]
    try:
        evs = generate(eng, reqs, timeout=300)
        d = eng.runner.dispatcher
        return evs, d.plans.copy(), d.fallbacks.copy()
    finally:
        eng.shutdown()


def _assert_same_tokens(bundle: Path, reqs: list[GenerationRequest], want: list[Event], got: list[Event]) -> int:
    """Output ids equal; a divergence is tolerated only where the CPU's top-2 margin is below MARGIN (then
    the rest of that request is not compared). Returns the number of such divergences."""
    cpu: ModelRunner | None = None
    ties = 0
    for r, a, b in zip(reqs, want, got):
        if a.output_ids == b.output_ids:
            continue
        j = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y),
                 min(len(a.output_ids), len(b.output_ids)))
        if cpu is None:
            cpu = ModelRunner(bundle, Manifest.load(bundle))
        top = np.sort(cpu_logits(cpu, list(r.prompt_ids or ()) + list(a.output_ids[:j])))[-2:]
        assert top[1] - top[0] < MARGIN, (f"{r.request_id}: outputs diverge at token {j} with a CPU top-2 margin of "
                                          f"{top[1] - top[0]:.2e}\n cpu  {a.output_ids}\n cuda {b.output_ids}")
        ties += 1
    return ties


def test_serving_engine_cuda_equals_cpu(default_bundle: Path) -> None:
    vocab = Manifest.load(default_bundle).model.vocab_size
    shapes = [(5, 40), (17, 24), (64, 64), (130, 32), (250, 48), (384, 100), (33, 16), (2, 60),
              (90, 20), (200, 64), (300, 80), (12, 8), (45, 50), (160, 36), (220, 28), (8, 100)]
    reqs = _requests(np.random.default_rng(3), vocab, shapes, ignore_eos=False)
    want, _, _ = _serve(default_bundle, reqs, device="cpu")
    got, plans, _ = _serve(default_bundle, reqs, device="cuda")
    assert all(e.finish_reason in ("stop", "length") for e in want + got), [e.error for e in want + got]
    ties = _assert_same_tokens(default_bundle, reqs, want, got)
    assert ties <= 1, f"{ties} near-tie divergences"
    assert plans["single_block"] > 0
    print(f"\n16 requests, {sum(len(e.output_ids) for e in got)} tokens: cuda == cpu ({ties} near-ties)")


def test_multi_block_on_off_same_tokens(long_bundle: Path) -> None:
    vocab = Manifest.load(long_bundle).model.vocab_size
    rng = np.random.default_rng(4)
    shapes = [(int(n), 24) for n in rng.integers(440, 560, 8)]  # contexts reach 463..583 tokens
    reqs = _requests(rng, vocab, shapes, ignore_eos=True)
    off, plans_off, _ = _serve(long_bundle, reqs, device="cuda", multi_block_mode="off")
    on, plans_on, fb_on = _serve(long_bundle, reqs, device="cuda", multi_block_mode="on")
    assert all(e.finish_reason == "length" and len(e.output_ids) == 24 for e in off + on)
    ties = _assert_same_tokens(long_bundle, reqs, off, on)
    assert ties <= 1
    assert plans_off["multi_block"] == 0 and plans_off["single_block"] > 0
    assert plans_on["multi_block"] > 0, f"multi_block_mode=on never split: {dict(plans_on)}, fallbacks {fb_on}"
    print(f"\nplans off {dict(plans_off)}; on {dict(plans_on)}; fallbacks on {dict(fb_on)}")
