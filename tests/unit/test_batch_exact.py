"""Batch invariance to the last bit on the CPU backend: a sequence's logits are the same alone and in any
batch (other sequences, other slots, another decode-attention plan) and however its prompt is cut into
prefill chunks at the scheduler's alignment. Sampled tokens need that: a draw can land within 1e-7 of a
boundary of the distribution (tests/unit/test_serving.py's staggered test has one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybrid_runtime.config import Manifest
from hybrid_runtime.engine import Phase
from hybrid_runtime.runner import ModelRunner, SeqStep
from hybrid_runtime.scheduler import PREFILL_ALIGN


def _prefill(runner: ModelRunner, seqs: list[tuple[int, list[int]]], cut: int | None = None) -> None:
    """Prefill every (slot, ids) in one step, or (``cut``) the first ``cut`` tokens, then the rest."""
    for slot, _ in seqs:
        runner.ops.reset_slot(slot)
    pieces = [(0, cut), (cut, None)] if cut else [(0, None)]
    for a, b in pieces:
        runner.run(Phase.PREFILL, [SeqStep(slot, list(range(slot * 40, slot * 40 + 40)), a, ids[a:b])
                                   for slot, ids in seqs])


def _decode(runner: ModelRunner, seqs: list[tuple[int, list[int]]], steps: int) -> np.ndarray:
    """Greedy decode of all sequences together; logits ``[steps, len(seqs), V]``."""
    cur = [SeqStep(slot, list(range(slot * 40, slot * 40 + 40)), len(ids), [ids[-1]]) for slot, ids in seqs]
    out = []
    for _ in range(steps):
        logits = runner.run(Phase.DECODE, cur)
        out.append(logits)
        for s, row in zip(cur, logits):
            s.start_pos += 1
            s.token_ids = [int(np.argmax(row))]
    return np.stack(out)


def test_decode_alone_equals_decode_in_a_batch(default_bundle: Path) -> None:
    m = Manifest.load(default_bundle)
    runner = ModelRunner(default_bundle, m)
    rng = np.random.default_rng(3)
    seqs = [(slot, [int(t) for t in rng.integers(3, 2000, n)]) for slot, n in ((5, 23), (0, 140), (2, 7), (9, 66))]
    _prefill(runner, seqs)
    together = _decode(runner, seqs, 4)
    for i, seq in enumerate(seqs):
        _prefill(runner, [seq])
        np.testing.assert_array_equal(_decode(runner, [seq], 4)[:, 0], together[:, i])
    assert runner.dispatcher.plans["single_block"] and runner.dispatcher.plans["multi_block"]  # both plans ran


def test_prefill_cut_at_the_alignment_equals_one_chunk(default_bundle: Path) -> None:
    m = Manifest.load(default_bundle)
    runner = ModelRunner(default_bundle, m)
    ids = [int(t) for t in np.random.default_rng(4).integers(3, 2000, 2 * PREFILL_ALIGN + 9)]
    _prefill(runner, [(1, ids)])
    whole = _decode(runner, [(1, ids)], 3)
    for cut in (PREFILL_ALIGN, 2 * PREFILL_ALIGN):
        _prefill(runner, [(1, ids)], cut=cut)
        np.testing.assert_array_equal(_decode(runner, [(1, ids)], 3), whole)
