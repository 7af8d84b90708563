"""Next-token sampling on the host: greedy, temperature, top-k, top-p, with per-request generators.

Batch invariance: the token picked for a row depends only on that row's logits, its `SamplingParams`
and its own `numpy.random.Generator`, never on the other rows of the batch. A seeded request therefore
gets the same tokens whatever it is batched with. Greedy rows are handled together with one argmax;
sampled rows are processed one at a time (each one consumes exactly one uniform draw from its generator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybrid_runtime.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20
_TOP_K_STRIDE = 16  # subsampling stride used to bound the top-k threshold cheaply
_DRAW_BLOCK = 1024  # block size of the two-level inverse-CDF draw


def make_rng(seed: int | None, fallback_seed_source: np.random.SeedSequence) -> np.random.Generator:
    """Generator of one request: from ``seed`` if given, else from a fresh child of ``fallback_seed_source``.

    Spawning a child advances the source, so unseeded requests get distinct, non-overlapping streams.
    """
    if seed is not None:
        return np.random.Generator(np.random.PCG64(seed))
    return np.random.Generator(np.random.PCG64(fallback_seed_source.spawn(1)[0]))


def sample(logits: np.ndarray, params: Sequence[SamplingParams],
           rngs: Sequence[np.random.Generator]) -> np.ndarray:
    """Pick the next token of every row.

    Args:
        logits: ``[B, V]`` float (float32 from the engine); ``-inf`` entries are never picked by
            sampled rows.
        params: ``B`` sampling parameters, one per row.
        rngs: ``B`` generators, one per row (used only by non-greedy rows).

    Returns:
        ``[B]`` int64 token ids. Greedy rows (``temperature == 0`` or ``top_k == 1``) take the first
        maximum; the others apply temperature, then top-k, then top-p, then draw one token.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    batch = logits.shape[0]
    if len(params) != batch or len(rngs) != batch:
        raise ValueError(f"need one SamplingParams and one generator per row: B={batch}, "
                         f"len(params)={len(params)}, len(rngs)={len(rngs)}")
    out = np.empty(batch, dtype=np.int64)
    greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=batch)
    if greedy.any():
        out[greedy] = np.argmax(logits[greedy], axis=-1)
    for i in np.flatnonzero(~greedy):
        out[i] = _sample_row(logits[i], params[i], rngs[i])
    return out


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest entries of ``x`` (``[V]``, ``0 < k < V``), in a deterministic order."""
    pool = None
    if x.shape[0] // _TOP_K_STRIDE >= k:
        # The k-th largest of a strided subsample bounds the k-th largest of x from below, so the pool
        # {x >= bound} holds the top k (about k * stride entries): partition that instead of all of x.
        sub = x[::_TOP_K_STRIDE]
        bound = np.partition(sub, sub.shape[0] - k)[sub.shape[0] - k]
        pool = np.flatnonzero(x >= bound)
    if pool is None:
        return np.argpartition(-x, k - 1)[:k]
    return pool[np.argpartition(-x[pool], k - 1)[:k]]


def _sample_row(row: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """One sampled row: ``row`` is ``[V]`` logits; returns the drawn token id."""
    x = np.asarray(row, dtype=np.float32)
    if np.isnan(x).any():
        x = np.where(np.isnan(x), np.float32(-np.inf), x)
    top = x.max()
    if not np.isfinite(top):  # every logit masked (or +inf present): fall back to the first maximum
        return int(np.argmax(x))
    cand: np.ndarray | None = None  # token ids of the entries of ``w`` (None: all ids, in id order)
    if 0 < p.top_k < x.shape[0]:
        cand = _top_k_ids(x, p.top_k)
        x = x[cand]
    # Unnormalised probabilities (float32; every sum over them is taken in float64).
    w = np.exp((x - top) * np.float32(1.0 / p.temperature))
    if p.top_p < 1.0:
        cand, w = _nucleus(w, cand, p.top_p)
    idx = _draw(w, rng.random())
    return idx if cand is None else int(cand[idx])


def _draw(w: np.ndarray, u: float) -> int:
    """Index drawn from unnormalised weights ``w`` ``[n]`` (not all zero) with a uniform ``u`` in [0, 1).

    Inverse-CDF in two levels (block sums, then one block) so that no cumulative sum over the whole
    vocabulary is needed; a zero-weight index is never returned.
    """
    starts = np.arange(0, w.shape[0], _DRAW_BLOCK)
    blocks = np.add.reduceat(w, starts, dtype=np.float64)
    cum = np.cumsum(blocks)
    target = u * cum[-1]
    b = min(int(np.searchsorted(cum, target, side="right")), blocks.shape[0] - 1)
    while blocks[b] <= 0.0:  # only after rounding at the very top end
        b -= 1
    inner = np.cumsum(w[starts[b]: starts[b] + _DRAW_BLOCK], dtype=np.float64)
    j = int(np.searchsorted(inner, max(target - (cum[b - 1] if b else 0.0), 0.0), side="right"))
    if j >= inner.shape[0]:  # rounding: the block's last positive weight
        j = int(np.flatnonzero(w[starts[b]: starts[b] + _DRAW_BLOCK] > 0)[-1])
    return int(starts[b]) + j


def _nucleus(w: np.ndarray, cand: np.ndarray | None, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Top-p filter of unnormalised weights ``w`` ``[n]`` of ids ``cand`` (None: ids 0..n-1).

    Keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one); among
    equal weights at the cut, the lowest ids. Returns ``(ids, weights)`` of the kept tokens.
    """
    total = float(w.sum(dtype=np.float64))
    # Entries below (1 - top_p) * total / n together hold less than 1 - top_p of the mass, so they lie
    # outside the nucleus: drop them before sorting.
    live = np.flatnonzero(w >= (1.0 - top_p) * total / w.shape[0])
    ids = live if cand is None else cand[live]
    wl = w[live].astype(np.float64)
    desc = np.sort(wl)[::-1]
    keep = min(int(np.searchsorted(np.cumsum(desc), top_p * total, side="left")) + 1, desc.shape[0])
    cut = desc[keep - 1]
    sel = wl > cut
    ties = np.flatnonzero(wl == cut)
    ties = ties[np.argsort(ids[ties], kind="stable")]  # tie-break by id, not by sort order
    sel[ties[: keep - int(sel.sum())]] = True
    return ids[sel], wl[sel]


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The drawn token's logprob and the ``top`` most likely tokens as ``(id, logprob)``, by descending
    logprob (ties: lower id)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: np.ndarray, tokens: np.ndarray, top_n: Sequence[int]) -> list[TokenLogprobs | None]:
    """Logprobs of the drawn ``tokens [B]`` and the ``top_n[b]`` (-1: none, else 0..20) most likely tokens.

    They are the log-softmax of the RAW logits ``[B, V]`` (before temperature, top-k or top-p, as vLLM
    returns by default); the normaliser is summed in float64.
    """
    out: list[TokenLogprobs | None] = []
    for b, n in enumerate(top_n):
        if n is None or n < 0:
            out.append(None)
            continue
        x = np.asarray(logits[b], np.float64)
        lse = float(x.max() + np.log(np.exp(x - x.max()).sum()))
        k = min(int(n), MAX_TOP_LOGPROBS, x.shape[0])
        top: tuple[tuple[int, float], ...] = ()
        if k:
            cand = np.argpartition(-x, k - 1)[:k] if k < x.shape[0] else np.arange(x.shape[0])
            cut = x[cand].min()
            pool = np.flatnonzero(x >= cut)  # every tie at the cut, then by (logprob desc, id asc)
            order = pool[np.lexsort((pool, -x[pool]))][:k]
            top = tuple((int(i), float(x[i] - lse)) for i in order)
        out.append(TokenLogprobs(float(x[int(tokens[b])] - lse), top))
    return out
