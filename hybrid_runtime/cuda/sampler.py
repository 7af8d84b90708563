"""Sampling on the device (``ops/cuda/sampling.cu``), its per-row parameters, and its numpy twin.

The kernels' semantics are in the header of ``sampling.cu``; :func:`reference_sample` is the same function
in numpy (float64 where the kernel sums in fixed point), used by the GPU tests, and :func:`philox_uniform`
the same counter-based generator: a seeded request draws the same tokens whatever else is in the batch,
because a row's draw depends only on (seed, counter = the token's position, its logits).

:func:`row_params` turns one request's :class:`~hybrid_runtime.sampling.SamplingParams` into the 8 int32
words the kernel reads; unseeded requests get a seed drawn once per request by the serving engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np

from ..sampling import SamplingParams
from .stepio import MAX_TOP_LOGPROBS, ROW_WORDS

PARTIAL_CHUNKS = 64  # chunks per row of the first sampling kernel (keeps batch 1 spread over 64 CTAs)
_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def row_params(p: SamplingParams, seed: int, counter: int, n_logprobs: int | None = None) -> np.ndarray:
    """The 8 int32 sampling words of one row (``n_logprobs``: None = none, else 0..20 top tokens)."""
    w = np.zeros(ROW_WORDS, np.int64)
    w[0] = 1 if p.greedy else 0
    w[1] = p.top_k
    w[2] = int(np.array([p.temperature if p.temperature > 0 else 1.0], np.float32).view(np.int32)[0])
    w[3] = int(np.array([p.top_p], np.float32).view(np.int32)[0])
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    w[4], w[5] = seed & _MASK, seed >> 32
    w[6] = int(counter) & _MASK
    w[7] = -1 if n_logprobs is None else min(int(n_logprobs), MAX_TOP_LOGPROBS)
    return (w & _MASK).astype(np.uint32).view(np.int32)


# the static words of a SamplingParams (frozen, so they never change) by identity, as two little-endian word pairs
# (w0 | w1 << 32, w2 | w3 << 32); entries hold the params, so an id is never reused while it is cached
_STATIC: dict[int, tuple[SamplingParams, tuple[int, int]]] = {}
_STATIC_MAX = 4096
_PAD_ROW = (1, 0, 0, _MASK << 32)  # a padding row: greedy, no logprobs (-1), as 4 word pairs
_M64 = 0xFFFFFFFFFFFFFFFF


def _pairs(w: np.ndarray) -> tuple[int, ...]:
    """The 8 int32 words of a row as 4 unsigned 64-bit word pairs (low word first)."""
    u = [int(x) & _MASK for x in w]
    return tuple(u[i] | u[i + 1] << 32 for i in range(0, ROW_WORDS, 2))


def _static_words(p: SamplingParams) -> tuple[int, int]:
    """Words 0..3 of :func:`row_params` (greedy, top_k, temperature, top_p) as two word pairs."""
    e = _STATIC.get(id(p))
    if e is not None and e[0] is p:
        return e[1]
    words = _pairs(row_params(p, 0, 0))[:2]
    if type(p) is SamplingParams:  # frozen: safe to remember (anything else is recomputed every time)
        if len(_STATIC) >= _STATIC_MAX:
            _STATIC.clear()
        _STATIC[id(p)] = (p, words)  # type: ignore[assignment]
    return words  # type: ignore[return-value]


def rows_params(rows: Sequence[Any], R: int) -> np.ndarray:
    """The ``[R, ROW_WORDS]`` int32 sampling words of a step: :func:`row_params` of each ``rows[r]`` (a
    :class:`~hybrid_runtime.backend.SampleRow`: ``params``, ``seed``, ``counter``, ``logprobs``) for its first
    ``len(rows)`` rows, greedy rows without logprobs after them (padding) — the same words, row by row, the same
    exceptions, with the static words of each SamplingParams computed once. Each row is built as 4 unsigned 64-bit
    word pairs (the seed is one already) and the whole step converted by one ``fromiter``."""
    vals: list[tuple[int, ...]] = []
    static = _STATIC
    for sr in rows:
        p = sr.params
        e = static.get(id(p))
        s01, s23 = e[1] if e is not None and e[0] is p else _static_words(p)
        seed = int(sr.seed) & _M64
        counter = int(sr.counter) & _MASK
        n = sr.logprobs
        top = -1 if n is None else min(int(n), MAX_TOP_LOGPROBS)
        if top < -0x80000000:  # row_params' int64 words decide (below -2**63 it raises)
            vals.append(_pairs(row_params(p, sr.seed, sr.counter, n)))
        else:
            vals.append((s01, s23, seed, counter | (top & _MASK) << 32))
    vals += [_PAD_ROW] * (R - len(vals))
    flat = np.fromiter(chain.from_iterable(vals), "<u8", count=4 * len(vals))
    return flat.view("<i4").reshape(len(vals), ROW_WORDS).astype(np.int32, copy=False)


def philox_uniform(seed: int, counter: int, idx: np.ndarray) -> np.ndarray:
    """The kernel's uniforms in (0, 1) for token ids ``idx`` (float32, bit-exact with the device)."""
    i = np.asarray(idx, np.uint64)
    c0, c1 = (i >> np.uint64(2)).astype(np.uint64), np.full_like(i, counter & _MASK)
    c2, c3 = np.full_like(i, 0x5EED), np.zeros_like(i)
    k0, k1 = seed & _MASK, (seed >> 32) & _MASK
    m = np.uint64(_MASK)
    for _ in range(10):
        p0, p1 = np.uint64(_M0) * c0, np.uint64(_M1) * c2
        hi0, lo0, hi1, lo1 = p0 >> np.uint64(32), p0 & m, p1 >> np.uint64(32), p1 & m
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    words = np.stack([c0, c1, c2, c3])[i.astype(np.int64) & 3, np.arange(i.size)]
    return ((words >> np.uint64(8)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 16777216.0)


def _keys(x: np.ndarray) -> np.ndarray:
    u = np.asarray(x, np.float32).view(np.uint32)
    return np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)


def reference_sample(x: np.ndarray, words: np.ndarray) -> tuple[int, float, list[tuple[int, float]]]:
    """numpy twin of ``sample_finish`` for one row: ``(token, logprob, top-N [(id, logprob)])``."""
    x = np.asarray(x, np.float32)
    w = np.asarray(words, np.int32)
    greedy, top_k = bool(w[0] & 1), int(w[1])
    temp, top_p = float(w[2:3].view(np.float32)[0]), float(w[3:4].view(np.float32)[0])
    seed, counter, ntop = int(w[4].astype(np.uint32)) | (int(w[5].astype(np.uint32)) << 32), int(
        w[6].astype(np.uint32)), int(w[7])
    mx = float(x.max())
    lse = mx + float(np.log(np.exp((x - mx).astype(np.float64)).sum()))
    if greedy:
        tok = int(np.argmax(x))
    else:
        keys = _keys(x)
        lo = np.uint32(0)
        if 0 < top_k < x.size:
            lo = np.sort(keys)[::-1][top_k - 1]
        if top_p < 1.0:
            inv_t = np.float32(1.0 / temp)
            mass = (np.exp((x - np.float32(mx)) * inv_t) * np.float32(4294967296.0)).astype(np.uint64)
            ok = keys >= lo
            Z = int(mass[ok].sum())
            target = min(max(int(np.ceil(top_p * Z)), 1), Z)
            order = np.argsort(keys[ok], kind="stable")[::-1]
            ks, ms = keys[ok][order], mass[ok][order]
            cum = np.cumsum(ms.astype(object))  # exact integers
            j = next(i for i, c in enumerate(cum) if int(c) >= target)
            lo = max(lo, ks[j])
        ok = np.flatnonzero(keys >= lo)
        u = philox_uniform(seed, counter, ok)
        score = x[ok] * np.float32(1.0 / temp) - np.log(-np.log(u))
        tok = int(ok[int(np.argmax(score))])
    top: list[tuple[int, float]] = []
    if ntop > 0:
        n = min(ntop, MAX_TOP_LOGPROBS)
        order = np.lexsort((np.arange(x.size), -x.astype(np.float64)))[:n]
        top = [(int(i), float(x[i]) - lse) for i in order]
    return tok, float(x[tok]) - lse, top


class DeviceSampler:
    """Launches the two sampling kernels for ``rows`` rows of float32 logits ``[rows, V]`` (rows of ``ld``)."""

    def __init__(self, device: Any, module: Any, max_rows: int, vocab: int) -> None:
        from .driver import DeviceArray

        self.device, self.vocab = device, vocab
        self.nch = max(1, min(PARTIAL_CHUNKS, vocab // 256 or 1))
        self._partials = device.empty((3, max(1, max_rows), self.nch), "float32")
        self._k_part = module.kernel("sample_partials")
        self._k_fin = module.kernel("sample_finish")
        self._DeviceArray = DeviceArray

    def launch(self, rows: int, logits_ptr: int, ld: int, params_ptr: int, out_tok: int, out_lp: int, top_ids: int,
               top_lp: int) -> None:
        if rows < 1:
            return
        stride = self._partials.shape[1] * self.nch * 4
        pm, ps, pi = (self._partials.ptr + i * stride for i in range(3))
        self._k_part.launch(self.device, (self.nch, rows, 1), (256, 1, 1), 0,
                            [("ptr", logits_ptr), ("i64", ld), ("i32", self.vocab), ("i32", self.nch), ("ptr", pm),
                             ("ptr", ps), ("ptr", pi)], pdl=True)
        self._k_fin.launch(self.device, (rows, 1, 1), (1024, 1, 1), 0,
                           [("ptr", logits_ptr), ("i64", ld), ("i32", self.vocab), ("i32", self.nch), ("ptr", pm),
                            ("ptr", ps), ("ptr", pi), ("ptr", params_ptr), ("ptr", out_tok), ("ptr", out_lp),
                            ("ptr", top_ids), ("ptr", top_lp)], pdl=True)
