"""Per-step-size tables of the CPU path are made up front (issue 21): the output views of each onnxruntime context
and the MoE's pair inputs. Filled on first use, they grew for hours in the 2-hour soak as steps of new sizes arrived
(+5097 views and +660 pair arrays between the snapshots after warm-up and at the end, 0.6 MB of the stub's traced
heap); a table made at load cannot grow, and a step of any size leaves every table as it was."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybrid_runtime.config import Manifest
from hybrid_runtime.engine import Phase
from hybrid_runtime.engine.onnxruntime import _VIEW_CACHE_TOKENS
from hybrid_runtime.ops.moe import _KEEP_TOKENS
from hybrid_runtime.runner import ModelRunner, SeqStep


def _tables(runner: ModelRunner) -> dict[str, tuple[int, int, frozenset[int]]]:
    """Each table: (its identity, its length, the identities of its entries)."""
    out = {}
    for si, ctxs in enumerate(runner.engine._contexts):
        for ci, ctx in enumerate(ctxs):
            out[f"views {si}.{ci}"] = (id(ctx._views), len(ctx._views), frozenset(id(v) for v in ctx._views.values()))
    for layer, moe in runner.backend.moe_layers.items():
        out[f"pairs {layer}"] = (id(moe._pairs), len(moe._pairs), frozenset(id(p[0]) for p in moe._pairs.values()))
    return out


def test_step_size_tables_are_made_at_load_and_never_grow(default_bundle: Path) -> None:
    m = Manifest.load(default_bundle)
    runner = ModelRunner(default_bundle, m)
    before = _tables(runner)
    assert any(k.startswith("pairs") for k in before), "the default model has MoE layers"
    for name, (_, n, _) in before.items():
        if name.startswith("pairs"):
            assert n == _KEEP_TOKENS + 1
    for ctxs in runner.engine._contexts:
        for ctx in ctxs:
            assert sorted(ctx._views) == list(range(1, min(ctx.profile.max_tokens, _VIEW_CACHE_TOKENS) + 1))
    rng = np.random.default_rng(0)
    vocab, lim = m.model.vocab_size, m.limits
    ps = lim.page_size
    # prefill steps of many sizes (one sequence, then several packed), then decode steps of every batch size
    for n in [1, 2, 3, 7, 13, 31, 47, 63, 64, 65, 100]:
        n = min(n, lim.max_num_tokens)
        runner.run(Phase.PREFILL, [SeqStep(0, list(range(-(-n // ps))), 0, rng.integers(0, vocab, n).tolist())])
    packed = [SeqStep(i, [i], 0, rng.integers(0, vocab, 1 + i).tolist()) for i in range(3)]
    runner.run(Phase.PREFILL, packed)
    for b in range(1, lim.max_batch_size + 1):
        runner.run(Phase.DECODE, [SeqStep(i, [i], 3, [int(rng.integers(0, vocab))]) for i in range(b)])
    assert _tables(runner) == before
