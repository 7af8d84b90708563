"""The onnxruntime attention of the CPU backend (ops/attention_ort.py) against the numpy oracle of
ops/attention.py: decode (through the dispatcher, both plans) and prefill, bit-exact rows alone and in a
batch, and prefill chunks cut anywhere."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_runtime.ops import attention as A
from hybrid_runtime.ops.attention_ort import CHUNK, OrtAttention
from hybrid_runtime.ops.dispatcher import SINGLE, DecodeAttentionDispatcher

LAYOUTS = [(8, 2, 32, 16), (4, 2, 16, 4), (2, 2, 16, 5)]  # (H, Hkv, hd, page size); the last has no GQA (G = 1)
POOL = 120


def _pools(rng: np.random.Generator, Hkv: int, hd: int, ps: int) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((POOL, ps, Hkv, hd)).astype(np.float32),
            rng.standard_normal((POOL, ps, Hkv, hd)).astype(np.float32))


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_matches_numpy_and_is_batch_exact(layout, mode: str) -> None:
    H, Hkv, hd, ps = layout
    rng = np.random.default_rng(hd + ps)
    k, v = _pools(rng, Hkv, hd, ps)
    op = OrtAttention(H, Hkv, hd)
    disp = DecodeAttentionDispatcher(mode=mode, kernels=op.kernels())  # type: ignore[arg-type]
    lens = np.array([1, 2 * CHUNK + 3, 40, CHUNK])
    tables = [rng.permutation(POOL)[: -(-int(n) // ps) + 1] for n in lens]
    q = rng.standard_normal((len(lens), H, hd)).astype(np.float32)
    got = disp.run(q, k, v, tables, lens)
    np.testing.assert_allclose(got, A.decode_attention_single(q, k, v, tables, lens), atol=1e-5, rtol=0)
    for b in range(len(lens)):  # alone: another plan (auto splits a batch of one), the same bits
        np.testing.assert_array_equal(disp.run(q[b:b + 1], k, v, tables[b:b + 1], lens[b:b + 1])[0], got[b])
    assert sum(disp.plans.values()) == 1 + len(lens) and not disp.errors


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_matches_numpy_and_any_cut_gives_the_same_bits(layout, monkeypatch: pytest.MonkeyPatch) -> None:
    H, Hkv, hd, ps = layout
    rng = np.random.default_rng(7 * hd + ps)
    k, v = _pools(rng, Hkv, hd, ps)
    op = OrtAttention(H, Hkv, hd)
    starts, lens = np.array([0, 37, 5]), np.array([150, 20, 1])
    bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tables = [rng.permutation(POOL)[: -(-int(s + n) // ps)] for s, n in zip(starts, lens)]
    q = rng.standard_normal((int(bounds[-1]), H, hd)).astype(np.float32)
    got = op.prefill(q, k, v, tables, starts, bounds)
    want = np.concatenate([A.prefill_attention(q[a:b], k, v, t, int(s))
                           for a, b, t, s in zip(bounds[:-1], bounds[1:], tables, starts)])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    first = op.prefill(q[:150], k, v, tables[:1], starts[:1], np.array([0, 150]))
    for cut in (1, 30, CHUNK, 149):  # the first sequence's chunk cut in two calls
        a = op.prefill(q[:cut], k, v, tables[:1], starts[:1], np.array([0, cut]))
        b = op.prefill(q[cut:150], k, v, tables[:1], starts[:1] + cut, np.array([0, 150 - cut]))
        np.testing.assert_array_equal(np.concatenate([a, b]), first)
    np.testing.assert_array_equal(first, got[:150])
    from hybrid_runtime.ops import attention_ort

    monkeypatch.setattr(attention_ort, "_MAX_PARTIALS", 1)  # one query per run: blocks change no bit
    np.testing.assert_array_equal(op.prefill(q, k, v, tables, starts, bounds), got)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_in_blocks_of_sequences_gives_the_same_bits(layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """_MAX_GATHER splits a step's sequences into runs: every split gives every row the same bits."""
    from hybrid_runtime.ops import attention_ort

    H, Hkv, hd, ps = layout
    rng = np.random.default_rng(3 * hd + ps)
    k, v = _pools(rng, Hkv, hd, ps)
    lens = np.array([1, 2 * CHUNK + 3, 40, CHUNK, 3 * CHUNK, 7])
    tables = [rng.permutation(POOL)[: -(-int(n) // ps) + 1] for n in lens]
    q = rng.standard_normal((len(lens), H, hd)).astype(np.float32)
    want = OrtAttention(H, Hkv, hd).kernels()[SINGLE](None, q, k, v, tables, lens).copy()
    for bound in (1, 2 * CHUNK * Hkv * hd, 4 * CHUNK * Hkv * hd):  # one sequence per run; mixed runs
        monkeypatch.setattr(attention_ort, "_MAX_GATHER", bound)
        op = OrtAttention(H, Hkv, hd)
        got = op.kernels()[SINGLE](None, q, k, v, tables, lens)
        np.testing.assert_array_equal(got, want)
        assert bound > 1 or len(op._last[1]) == len(lens)
    np.testing.assert_allclose(want, A.decode_attention_single(q, k, v, tables, lens), atol=1e-5, rtol=0)
