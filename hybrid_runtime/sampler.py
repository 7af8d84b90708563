"""Next-token sampling on the host: greedy, temperature, top-k, top-p, with per-request generators.

Batch invariance: the token picked for a row depends only on that row's logits, its `SamplingParams`
and its own `numpy.random.Generator`, never on the other rows of the batch. A seeded request therefore
gets the same tokens whatever it is batched with. Greedy rows are handled together with one argmax;
sampled rows are processed one at a time (each one consumes exactly one uniform draw from its generator).

`token_logprobs` gives the log-probabilities of the sampled tokens (and the most likely alternatives) for
the rows that ask for them; it never changes which token is picked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybrid_runtime.sampling import MAX_LOGPROBS, SamplingParams

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
    """Log-probabilities at one generated position.

    ``logprob`` is the sampled token's; ``top`` holds ``(token_id, logprob)`` of the N most likely tokens
    (N = the request's ``logprobs``; empty for 0), by descending logprob, ties by lower token id. A
    logprob may be ``-inf`` (a masked logit); JSON encoders must map it to a finite stand-in.
    """

    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: np.ndarray, tokens: np.ndarray, top_n: Sequence[int]) -> list[TokenLogprobs | None]:
    """Log-probabilities of the sampled ``tokens`` under ``logits``, for the rows that ask.

    Args:
        logits: ``[B, V]`` float32, the same logits `sample` picked from.
        tokens: ``[B]`` the sampled token ids.
        top_n: ``B`` ints: -1 = no logprobs for that row (None is returned), else 0..20 = the sampled
            token's logprob plus that many most likely tokens.

    The logprobs are the log-softmax of the *raw* logits, before temperature, top-k and top-p (what
    vLLM returns by default): they describe the model's distribution, not the filtered one a token was
    drawn from, so a sampled token's logprob is the same whatever the sampling parameters. The
    normaliser (log-sum-exp) is computed in float64. NaN logits count as ``-inf`` (as in `sample`);
    when some logits are ``+inf`` they share all the mass; when all are ``-inf`` every token gets
    ``-log(V)``.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    batch = logits.shape[0]
    if len(tokens) != batch or len(top_n) != batch:
        raise ValueError(f"need one token and one top_n per row: B={batch}, len(tokens)={len(tokens)}, "
                         f"len(top_n)={len(top_n)}")
    out: list[TokenLogprobs | None] = []
    for b in range(batch):
        n = int(top_n[b])
        if n < 0:
            out.append(None)
            continue
        if n > MAX_LOGPROBS:
            raise ValueError(f"top_n[{b}]={n} exceeds {MAX_LOGPROBS}")
        lp = _log_softmax(logits[b])
        out.append(TokenLogprobs(float(lp[int(tokens[b])]), _top(lp, n)))
    return out


def _log_softmax(row: np.ndarray) -> np.ndarray:
    """``[V]`` float64 log-softmax of one row of logits (float64 throughout)."""
    x = np.asarray(row, dtype=np.float64)
    if np.isnan(x).any():
        x = np.where(np.isnan(x), -np.inf, x)
    top = x.max()
    if np.isposinf(top):
        inf = np.isposinf(x)
        return np.where(inf, -math.log(int(inf.sum())), -np.inf)
    if np.isneginf(top):
        return np.full(x.shape, -math.log(x.shape[0]))
    return x - (top + math.log(float(np.exp(x - top).sum())))


def _top(lp: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` largest entries of ``lp`` as ``(id, value)``, by descending value, ties by lower id."""
    if n == 0:
        return ()
    n = min(n, lp.shape[0])
    cut = np.partition(lp, lp.shape[0] - n)[lp.shape[0] - n]
    cand = np.flatnonzero(lp >= cut)  # every entry tied at the cut, so that the lowest ids can win
    order = np.lexsort((cand, -lp[cand]))[:n]
    return tuple((int(cand[i]), float(lp[cand[i]])) for i in order)
