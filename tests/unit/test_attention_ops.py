"""CPU attention over the paged KV cache against a dense float64 causal softmax."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from hybrid_runtime.kv_cache import KVCache, KVLayout
from hybrid_runtime.ops import attention
from hybrid_runtime.ops.attention import (
    decode_attention_multi,
    decode_attention_single,
    gather_kv,
    prefill_attention,
)

TOL = 1e-5


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, qpos: np.ndarray) -> np.ndarray:
    """q [T,H,hd], k/v [L,Hkv,hd]; query t sees keys 0..qpos[t]. float64, GQA by repeating K/V."""
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k.astype(np.float64), G, axis=1), np.repeat(v.astype(np.float64), G, axis=1)
    s = np.einsum("thd,shd->hts", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    s = np.where(np.arange(k.shape[0])[None, None, :] <= qpos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v)


def _pool(rng: np.random.Generator, lens: list[int], page_size: int, hkv: int, hd: int
          ) -> tuple[KVCache, list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """A cache holding random K/V for each sequence under shuffled (non-contiguous) page tables."""
    need = [-(-n // page_size) for n in lens]
    cache = KVCache(KVLayout(sum(need) + 1, page_size, hkv, hd))
    perm = rng.permutation(sum(need) + 1)
    tables, ks, vs, off = [], [], [], 0
    for n, p in zip(lens, need):
        table = perm[off:off + p]
        off += p
        k = rng.standard_normal((n, hkv, hd)).astype(np.float32)
        v = rng.standard_normal((n, hkv, hd)).astype(np.float32)
        cache.write(0, table, 0, k, v)
        tables.append(table)
        ks.append(k)
        vs.append(v)
    return cache, tables, ks, vs


@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("hd", [64, 80, 128, 256])
@pytest.mark.parametrize("chunks", [1, 3])
def test_prefill_matches_dense_causal(group: int, hd: int, chunks: int) -> None:
    rng = np.random.default_rng(group * 1000 + hd + chunks)
    T, hkv, ps = 45, 2, 16  # crosses page boundaries; chunk edges fall mid-page
    H = hkv * group
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    cache, (table,), (k,), (v,) = _pool(rng, [T], ps, hkv, hd)
    kb, vb = cache.buffers(0)
    edges = [0, 7, 30, T] if chunks == 3 else [0, T]
    out = np.concatenate([prefill_attention(q[a:b], kb, vb, table, a) for a, b in pairwise(edges)])
    np.testing.assert_allclose(out, dense_attention(q, k, v, np.arange(T)), atol=TOL, rtol=TOL)
    assert out.dtype == np.float32 and out.shape == (T, H, hd)


def test_prefill_query_blocks_and_large_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_MAX_SCORE_ELEMS", 4 * 50)  # forces many small query blocks
    rng = np.random.default_rng(1)
    T, H, hkv, hd = 50, 4, 2, 64
    q = (30 * rng.standard_normal((T, H, hd))).astype(np.float32)  # scores ~ +-240: needs max-subtraction
    cache, (table,), (k,), (v,) = _pool(rng, [T], 8, hkv, hd)
    out = prefill_attention(q[20:], *cache.buffers(0), table, 20)
    # float32 rounding of scores of magnitude ~240 alone is ~2e-5, hence the looser bound here.
    np.testing.assert_allclose(out, dense_attention(q, k, v, np.arange(T))[20:], atol=1e-4, rtol=1e-4)
    assert np.isfinite(out).all()


def test_prefill_half_precision_cache_and_empty() -> None:
    rng = np.random.default_rng(2)
    cache = KVCache(KVLayout(4, 16, 1, 64, dtype=np.float16))
    k = rng.standard_normal((20, 1, 64)).astype(np.float16)
    v = rng.standard_normal((20, 1, 64)).astype(np.float16)
    cache.write(0, [2, 0], 0, k, v)
    q = rng.standard_normal((20, 2, 64)).astype(np.float32)
    out = prefill_attention(q, *cache.buffers(0), [2, 0], 0)
    np.testing.assert_allclose(out, dense_attention(q, k, v, np.arange(20)), atol=TOL, rtol=TOL)
    assert prefill_attention(q[:0], *cache.buffers(0), [2, 0], 20).shape == (0, 2, 64)


DECODE_CASES = [  # (seed, page_size, kv heads, group, head_dim, context lengths)
    (0, 16, 1, 1, 64, [1, 17, 300, 5000]),
    (1, 64, 2, 2, 96, [64, 65, 2049, 1]),
    (2, 256, 1, 8, 128, [32768, 3, 700]),
    (3, 16, 1, 4, 256, [12000, 255, 256, 257]),
    (4, 64, 2, 1, 160, [1, 1, 1000]),
    (5, 256, 1, 2, 192, [9999, 512]),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"seed{c[0]}")
def test_decode_single_and_multi_match_dense(case: tuple) -> None:
    seed, ps, hkv, group, hd, lens = case
    rng = np.random.default_rng(seed)
    H = hkv * group
    cache, tables, ks, vs = _pool(rng, lens, ps, hkv, hd)
    kb, vb = cache.buffers(0)
    q = (2 * rng.standard_normal((len(lens), H, hd))).astype(np.float32)
    ref = np.stack([dense_attention(q[b:b + 1], ks[b], vs[b], np.array([n - 1]))[0] for b, n in enumerate(lens)])
    single = decode_attention_single(q, kb, vb, tables, lens)
    np.testing.assert_allclose(single, ref, atol=TOL, rtol=TOL)
    for blocks in (1, 2, 3, 7, 64):
        multi = decode_attention_multi(q, kb, vb, tables, np.array(lens), blocks_per_seq=blocks)
        np.testing.assert_allclose(multi, single, atol=TOL, rtol=TOL)
        np.testing.assert_allclose(multi, ref, atol=TOL, rtol=TOL)


def test_decode_random_batches() -> None:
    """Many small random batches: lengths 1..32k (log-uniform), random page sizes, GQA, head_dim."""
    rng = np.random.default_rng(7)
    for _ in range(6):
        ps = int(rng.choice([16, 64, 256]))
        hkv, group, hd = int(rng.choice([1, 2])), int(rng.choice([1, 2, 4, 8])), int(rng.choice([64, 128, 256]))
        lens = [int(n) for n in np.exp(rng.uniform(0, np.log(32768), size=int(rng.integers(1, 4))))]
        cache, tables, ks, vs = _pool(rng, lens, ps, hkv, hd)
        q = rng.standard_normal((len(lens), hkv * group, hd)).astype(np.float32)
        ref = np.stack([dense_attention(q[b:b + 1], ks[b], vs[b], np.array([n - 1]))[0]
                        for b, n in enumerate(lens)])
        blocks = int(rng.integers(2, 65))
        multi = decode_attention_multi(q, *cache.buffers(0), tables, lens, blocks)
        np.testing.assert_allclose(multi, ref, atol=TOL, rtol=TOL)
        np.testing.assert_allclose(decode_attention_single(q, *cache.buffers(0), tables, lens), ref,
                                   atol=TOL, rtol=TOL)


def test_bad_inputs_rejected() -> None:
    kb = np.zeros((4, 16, 2, 64), np.float32)
    with pytest.raises(IndexError):
        gather_kv(kb, kb, [0, -1], 20)  # negative page would wrap silently
    with pytest.raises(IndexError):
        gather_kv(kb, kb, [0, 4], 20)
    with pytest.raises(IndexError):
        gather_kv(kb, kb, [0], 17)
    q = np.zeros((1, 3, 64), np.float32)
    with pytest.raises(ValueError):
        decode_attention_single(q, kb, kb, [[0]], [1])  # 3 query heads over 2 kv heads
    with pytest.raises(ValueError):
        decode_attention_single(np.zeros((1, 2, 64), np.float32), kb, kb, [[0]], [0])
    with pytest.raises(ValueError):
        decode_attention_multi(np.zeros((1, 2, 64), np.float32), kb, kb, [[0]], [1], blocks_per_seq=0)
