"""Prefill on the ``cuda`` backend through its tensor-core paths (bfloat16 bundle of the default model): the
causal prefill-attention kernel over the paged pool, the grouped-GEMM MoE and the chunked delta rule.

* a prompt prefilled in 64-token cuts (as the scheduler makes them) gives the bits of the one-shot prefill and
  the same greedy tokens after it; 100-token cuts give its logits within a tolerance;
* several prompts sharing prefill steps give each prompt's logits alone (the rows of a step do not see each
  other);
* against the float32 CPU backend, the tensor-core prefill is as accurate as the CUDA-core paths it replaced
  (per-token decode-kernel attention, CUDA-core MoE, token-scan delta rule) on the same bf16 bundle.

The float32 parity suite against the CPU (``test_cuda_backend.py``) covers the float32 paths (the per-token
decode-kernel attention and CUDA-core MoE, which float32 bundles keep; the chunked delta rule, which they
share).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from runner_cases import Driver, scattered_tables

from hybrid_runtime.config import Manifest
from hybrid_runtime.runner import ModelRunner

pytestmark = pytest.mark.gpu

REPORT = Path(os.environ.get("GPU_REPORT_DIR", "/tmp")) / "prefill_report.json"
_report: dict[str, object] = {}


def _record(key: str, value: object) -> None:
    _report[key] = value
    REPORT.write_text(json.dumps(_report, indent=1, default=str))
    print(f"[prefill] {key}: {value}")


@pytest.fixture(scope="module")
def bundle(default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from builder.bundle import BuildOptions, build_bundle

    out = tmp_path_factory.mktemp("prefill") / "cuda_bf16"
    build_bundle(default_checkpoint, out, BuildOptions(backend="cuda", dtype="bfloat16", max_batch_size=8,
                                                       max_input_len=700, max_seq_len=768, max_num_tokens=1024,
                                                       page_size=16), progress=lambda _m: None)
    return out


def _run(runner: ModelRunner, m: Manifest, prompts: list[list[int]], slots: list[int], chunk: int,
         decode_steps: int = 12) -> tuple[list[np.ndarray], list[list[int]]]:
    """Final prefill logits of every prompt and the greedy tokens of ``decode_steps`` decode steps after it."""
    tables = scattered_tables(m, [len(p) + decode_steps + 1 for p in prompts], seed=4)
    drv = Driver([runner], slots, tables, prompts)
    last: list[np.ndarray | None] = [None] * len(prompts)
    pos = [0] * len(prompts)
    for (out,) in drv.prefill(chunk=chunk):
        idx = [i for i, p in enumerate(prompts) if pos[i] < len(p)]
        for row, i in enumerate(idx):
            pos[i] = min(len(prompts[i]), pos[i] + chunk)
            if pos[i] == len(prompts[i]):
                last[i] = out[row].copy()
    toks: list[list[int]] = [[] for _ in prompts]
    for _ in range(decode_steps):
        drv.decode()
        for i, t in enumerate(drv.next_tok):
            toks[i].append(t)
    assert all(x is not None for x in last)
    return [x for x in last if x is not None], toks


def test_the_tensor_core_prefill_paths_are_the_ones_running(bundle: Path) -> None:
    m = Manifest.load(bundle)
    be = ModelRunner(bundle, m).backend
    assert be.prefill_attn is not None and be.moe_prefill is not None and be.gdn_ws is not None  # type: ignore


def test_prefill_in_chunks_equals_one_shot(bundle: Path) -> None:
    """64-token cuts (the scheduler's) give the one-shot prefill's bits, so the same greedy tokens after it.
    100-token cuts split the delta rule's 64-token chunks elsewhere: other rounding, logits within 2% of their
    scale; the greedy tokens then agree as long as the one-shot run's choice was not a near-tie, so only the first
    token is held to it (where the one-shot logits' top-2 margin exceeds twice the logit error) and the rest are
    reported (a random-weight model's 10th token flipped on a near-tie on the H200)."""
    m = Manifest.load(bundle)
    runner = ModelRunner(bundle, m)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in (640, 300, 77)]
    slots = [2, 5, 0]
    one, toks1 = _run(runner, m, prompts, slots, chunk=700)
    be = runner.backend
    assert be.prefill_plans > 0  # type: ignore[attr-defined]
    worst, agree = {}, {}
    for chunk in (64, 100):
        got, toks = _run(runner, m, prompts, slots, chunk=chunk)
        err = max(float(np.abs(a - b).max()) for a, b in zip(one, got))
        scale = max(float(np.abs(a).max()) for a in one)
        worst[chunk] = err
        agree[chunk] = [next((j for j, (a, b) in enumerate(zip(t1, t)) if a != b), len(t1))
                        for t1, t in zip(toks1, toks)]
        assert all(np.isfinite(g).all() for g in got)
        if chunk % 64 == 0:
            assert err == 0.0, f"chunks of {chunk}: logits differ from one-shot by {err} (same bits expected)"
            assert toks == toks1, f"chunks of {chunk}: greedy tokens after the prefill differ"
            continue
        assert err <= 2e-2 * scale, f"chunks of {chunk}: logits differ from one-shot by {err} (scale {scale})"
        for i, lg in enumerate(one):
            top2 = np.sort(lg.astype(np.float64))[-2:]
            if top2[1] - top2[0] > 2 * err:
                assert toks[i][0] == toks1[i][0], f"chunks of {chunk}: prompt {i}'s first token differs"
    _record("chunked_vs_one_shot_max_logit_diff", worst)
    _record("chunked_vs_one_shot_tokens_agreeing_before_first_difference", agree)


def test_prompts_sharing_a_prefill_step_equal_each_alone(bundle: Path) -> None:
    m = Manifest.load(bundle)
    runner = ModelRunner(bundle, m)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in (129, 64, 300, 1)]
    slots = [1, 3, 4, 6]
    together, _ = _run(runner, m, prompts, slots, chunk=1024, decode_steps=1)
    diffs = []
    for i, p in enumerate(prompts):
        alone, _ = _run(runner, m, [p], [slots[i]], chunk=1024, decode_steps=1)
        diffs.append(float(np.abs(alone[0] - together[i]).max()))
    _record("shared_step_vs_alone_max_logit_diff", diffs)
    assert max(diffs) == 0.0, f"a prompt's logits depend on the prompts sharing its prefill step: {diffs}"


def test_tensor_core_prefill_is_as_accurate_as_the_cuda_core_paths(bundle: Path, default_checkpoint: Path,
                                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    from builder.bundle import BuildOptions, build_bundle

    cpu_b = tmp_path_factory.mktemp("prefill_cpu") / "ort"
    m = Manifest.load(bundle)
    lim = m.limits
    build_bundle(default_checkpoint, cpu_b, BuildOptions(max_batch_size=lim.max_batch_size,
                                                         max_input_len=lim.max_input_len, max_seq_len=lim.max_seq_len,
                                                         max_num_tokens=lim.max_num_tokens, page_size=lim.page_size),
                 progress=lambda _m: None)
    cpu = ModelRunner(cpu_b, Manifest.load(cpu_b))
    new, old = ModelRunner(bundle, m), ModelRunner(bundle, m)
    ob = old.backend
    ob.prefill_attn = None  # type: ignore[attr-defined]
    ob.moe_prefill = None  # type: ignore[attr-defined]
    ob.gdn_ws = None  # type: ignore[attr-defined]
    rng = np.random.default_rng(21)
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in (500, 130, 9)]
    slots = [0, 3, 6]
    ref, _ = _run(cpu, Manifest.load(cpu_b), prompts, slots, chunk=256, decode_steps=1)
    errs = {}
    for name, r in (("tensor_cores", new), ("cuda_cores", old)):
        got, _ = _run(r, m, prompts, slots, chunk=256, decode_steps=1)
        errs[name] = [float(np.sqrt(np.mean((g - c) ** 2)) / np.sqrt(np.mean(c ** 2))) for g, c in zip(got, ref)]
    assert ob.prefill_plans == 0  # type: ignore[attr-defined]
    _record("prefill_rel_rms_err_vs_fp32_cpu", errs)
    for a, b in zip(errs["tensor_cores"], errs["cuda_cores"]):
        assert a <= 1.5 * b + 1e-3, f"tensor-core prefill error {a:.2e} vs CUDA-core {b:.2e} (relative RMS vs fp32 CPU)"


def test_bf16_moe_slots_stay_close_to_float32_slots(bundle: Path) -> None:
    """Prefill's MoE slots in bf16 (the default: ``CudaBackend.moe_slots_lowp``; every routed and shared-expert slot
    rounded once to bf16, summed in float32 in slot order by the add) against float32 slots on the same prompts:
    final prefill logits within 2e-2 of their scale (the chunked-vs-one-shot bound above; the added rounding is the
    size of the bf16 activation roundings the MoE already has), the same first greedy token wherever the float32
    run's top two logits are further apart than that, and both runs batch invariant (the bf16 run's bits alone ==
    shared, by test_prompts_sharing_a_prefill_step_equal_each_alone)."""
    m = Manifest.load(bundle)
    lowp, f32 = ModelRunner(bundle, m), ModelRunner(bundle, m)
    f32.backend.moe_slots_lowp = False  # type: ignore[attr-defined]
    assert lowp.backend.moe_slots_lowp  # type: ignore[attr-defined]
    rng = np.random.default_rng(31)
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in (600, 257, 64, 5)]
    slots = [0, 2, 4, 6]
    a, ta = _run(lowp, m, prompts, slots, chunk=1024, decode_steps=4)
    b, tb = _run(f32, m, prompts, slots, chunk=1024, decode_steps=4)
    scale = max(float(np.abs(x).max()) for x in b)
    errs = [float(np.abs(x - y).max()) for x, y in zip(a, b)]
    _record("bf16_vs_f32_moe_slots_max_logit_diff", {"errs": errs, "scale": scale, "tokens_equal": ta == tb})
    assert max(errs) <= 2e-2 * scale, (errs, scale)
    for x, y in zip(a, b):
        top2 = np.sort(y)[-2:]
        if top2[1] - top2[0] > 2 * max(errs):
            assert int(np.argmax(x)) == int(np.argmax(y))
