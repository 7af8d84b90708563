"""The onnxruntime GDN operator (ops/gdn_ort.py) against the numpy oracle of ops/gdn.py: outputs, the
state it leaves in the batch's slots, rows it must not touch, in-place and gathered slot layouts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hybrid_runtime.ops import gdn
from hybrid_runtime.ops.gdn_ort import OrtGdn

ATOL = 1e-5
SHAPES = [(2, 8, 2, 6), (2, 8, 4, 6), (1, 16, 1, 8)]  # (nk, dk, nv, dv): r = 1, the GQA-like r = 2, one head
ROWS = 9  # slots 0..7 and the sink 8


def _op(nk: int, dk: int, nv: int, dv: int, K: int) -> OrtGdn:
    C = 2 * nk * dk + nv * dv
    return OrtGdn(SimpleNamespace(linear_num_key_heads=nk, linear_key_head_dim=dk, linear_num_value_heads=nv,
                                  linear_value_head_dim=dv, value_dim=nv * dv, conv_dim=C, conv_kernel=K))


def _case(rng: np.random.Generator, T: int, nk: int, dk: int, nv: int, dv: int, K: int):
    """Random non-zero buffers (so a stray write shows) and inputs with decays from weak to extreme."""
    C = 2 * nk * dk + nv * dv
    conv = rng.standard_normal((ROWS, K - 1, C)).astype(np.float32)
    rec = (rng.standard_normal((ROWS, nv, dk, dv)) * 0.3).astype(np.float32)
    u = rng.standard_normal((T, C)).astype(np.float32)
    g = (-np.exp(rng.uniform(-4, 1, (T, nv)))).astype(np.float32)
    g[T // 3:T // 3 + 2] = -1e3  # e^{cumsum g} underflows inside a chunk: no inf/NaN may follow
    beta = rng.uniform(0, 1, (T, nv)).astype(np.float32)
    w = (rng.standard_normal((C, K)) * 0.7).astype(np.float32)
    return conv, rec, u, g, beta, w


SLOTS = {"one": [2], "contiguous": [0, 1, 2, 3], "permuted range": [3, 1, 2], "gaps": [5, 0, 7], "sink": [8]}


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("slots", sorted(SLOTS))
def test_decode_matches_numpy(slots: str, shape, K: int) -> None:
    nk, dk, nv, dv = shape
    rng = np.random.default_rng(len(slots) + K)
    op, sl = _op(nk, dk, nv, dv, K), np.array(SLOTS[slots], np.int64)
    conv, rec, u, g, beta, w = _case(rng, 3 * len(sl), nk, dk, nv, dv, K)
    conv_ref, rec_ref = conv.copy(), rec.copy()
    for t in range(3):  # three steps: the state each one leaves is the next one's input
        rows = slice(t * len(sl), (t + 1) * len(sl))
        got = op.decode(conv, rec, sl, u[rows], g[rows], beta[rows], w).copy()
        want = gdn.gdn_decode(conv_ref, rec_ref, sl, u[rows], g[rows], beta[rows], w, nk, dk, nv, dv)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(conv, conv_ref)  # the conv window is a copy of inputs: exact
    np.testing.assert_allclose(rec, rec_ref, atol=ATOL, rtol=0)  # every row, untouched ones included
    untouched = np.setdiff1d(np.arange(ROWS), sl)
    assert np.array_equal(rec[untouched], rec_ref[untouched])


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("slots", sorted(SLOTS))
def test_prefill_matches_numpy(slots: str, shape, K: int) -> None:
    """Ragged chunks (1 token up to more than one 64-token chunk of the delta rule) in one call."""
    nk, dk, nv, dv = shape
    rng = np.random.default_rng(7 * len(slots) + K)
    op, sl = _op(nk, dk, nv, dv, K), np.array(SLOTS[slots], np.int64)
    lens = [1, 70, 3, 17][:len(sl)]
    bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    conv, rec, u, g, beta, w = _case(rng, int(bounds[-1]), nk, dk, nv, dv, K)
    conv_ref, rec_ref = conv.copy(), rec.copy()
    got = op.prefill(conv, rec, sl, bounds, u, g, beta, w)
    want = np.concatenate([gdn.gdn_prefill(conv_ref, rec_ref, int(s), u[a:b], g[a:b], beta[a:b], w, nk, dk, nv, dv)
                           for s, a, b in zip(sl, bounds[:-1], bounds[1:])])
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(conv, conv_ref)
    np.testing.assert_allclose(rec, rec_ref, atol=ATOL, rtol=0)
    untouched = np.setdiff1d(np.arange(ROWS), sl)
    assert np.array_equal(rec[untouched], rec_ref[untouched]) and np.array_equal(conv[untouched], conv_ref[untouched])


def test_prefill_then_decode_continues_the_state() -> None:
    nk, dk, nv, dv = SHAPES[1]
    rng = np.random.default_rng(3)
    op = _op(nk, dk, nv, dv, 4)
    conv, rec, u, g, beta, w = _case(rng, 40, nk, dk, nv, dv, 4)
    conv[:], rec[:] = 0, 0  # a fresh slot
    op.prefill(conv, rec, np.array([4]), np.array([0, 37]), u[:37], g[:37], beta[:37], w)
    got = np.concatenate([op.decode(conv, rec, np.array([4]), u[t:t + 1], g[t:t + 1], beta[t:t + 1], w).copy()
                          for t in range(37, 40)])
    c2, r2 = np.zeros_like(conv), np.zeros_like(rec)
    want = gdn.gdn_prefill(c2, r2, 4, u, g, beta, w, nk, dk, nv, dv)[37:]
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_bad_inputs_raise_and_leave_the_buffers() -> None:
    nk, dk, nv, dv = SHAPES[1]
    rng = np.random.default_rng(0)
    op = _op(nk, dk, nv, dv, 4)
    conv, rec, u, g, beta, w = _case(rng, 4, nk, dk, nv, dv, 4)
    conv0, rec0 = conv.copy(), rec.copy()
    for slots in ([0, ROWS], [-1, 2]):
        with pytest.raises(IndexError, match="out of range"):
            op.decode(conv, rec, np.array(slots), u[:2], g[:2], beta[:2], w)
    with pytest.raises(ValueError, match="distinct"):
        op.decode(conv, rec, np.array([2, 2]), u[:2], g[:2], beta[:2], w)
    with pytest.raises(ValueError, match="non-empty"):
        op.prefill(conv, rec, np.array([1, 2]), np.array([0, 4, 4]), u, g, beta, w)
    with pytest.raises(ValueError, match="shape"):
        op.decode(conv, rec, np.array([1]), u[:1, :-1], g[:1], beta[:1], w)
    assert np.array_equal(conv, conv0) and np.array_equal(rec, rec0)


@pytest.mark.parametrize("block_tokens", [128, 512])  # one sequence per run, or several (a non-contiguous group)
def test_prefill_of_long_chunks_runs_in_windows(block_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks longer than a window (several runs per sequence, the state carried between them), and
    groups of sequences in one run; the result equals the numpy oracle."""
    from hybrid_runtime.ops import gdn_ort

    monkeypatch.setattr(gdn_ort, "_BLOCK_TOKENS", block_tokens)
    nk, dk, nv, dv = SHAPES[1]
    rng = np.random.default_rng(block_tokens)
    op, sl = _op(nk, dk, nv, dv, 4), np.array([5, 0, 7, 2], np.int64)
    lens = [300, 5, 129, 64]
    bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    conv, rec, u, g, beta, w = _case(rng, int(bounds[-1]), nk, dk, nv, dv, 4)
    conv_ref, rec_ref = conv.copy(), rec.copy()
    got = op.prefill(conv, rec, sl, bounds, u, g, beta, w)
    want = np.concatenate([gdn.gdn_prefill(conv_ref, rec_ref, int(s), u[a:b], g[a:b], beta[a:b], w, nk, dk, nv, dv)
                           for s, a, b in zip(sl, bounds[:-1], bounds[1:])])
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(conv, conv_ref)
    np.testing.assert_allclose(rec, rec_ref, atol=ATOL, rtol=0)
    assert len(op._last.blocks) == (7 if block_tokens == 128 else 3)  # 3 + 1 + 2 + 1 windows, or 3 groups
