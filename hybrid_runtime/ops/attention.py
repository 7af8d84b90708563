"""CPU (numpy) attention over the paged KV cache: chunked causal prefill and decode (single / split-KV).

Buffers are the per-layer pools of ``KVCache``: ``k_buf``, ``v_buf`` ``[num_pages, page_size, Hkv, hd]``.
A page table lists a sequence's pages in position order. Everything is computed in float32 whatever
the buffer dtype. GQA: query head ``j`` reads kv head ``j // (H // Hkv)``; query heads are grouped per
kv head by a reshape ``[H] -> [Hkv, G]`` so K/V are never repeated.

Callers must write the new tokens' K/V to the cache *before* calling these (the softmax includes
them), which is how the runner's attention mixer is ordered.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Bound on the float32 score elements of one prefill query block (16 MiB), so a long prompt never
# materialises a full T x L matrix per head.
_MAX_SCORE_ELEMS = 1 << 22


def _check(q_heads: int, hd: int, k_buf: np.ndarray, v_buf: np.ndarray) -> int:
    """Validate shapes; return the GQA group size ``G = H // Hkv``."""
    if k_buf.ndim != 4 or v_buf.shape != k_buf.shape:
        raise ValueError(f"k_buf/v_buf must both be [pages, page_size, Hkv, hd], got {k_buf.shape}, {v_buf.shape}")
    hkv = k_buf.shape[2]
    if k_buf.shape[3] != hd or q_heads % hkv:
        raise ValueError(f"q has {q_heads} heads of {hd}; cache has {hkv} kv heads of {k_buf.shape[3]}")
    return q_heads // hkv


def gather_kv(k_buf: np.ndarray, v_buf: np.ndarray, page_table: Sequence[int] | np.ndarray,
              length: int) -> tuple[np.ndarray, np.ndarray]:
    """K, V of positions ``0 .. length-1`` as float32 ``[length, Hkv, hd]`` (bounds-checked pages).

    Negative page indices are rejected explicitly: numpy would silently wrap them to the last page.
    """
    ps, num_pages = k_buf.shape[1], k_buf.shape[0]
    n = -(-length // ps)
    table = np.asarray(page_table, dtype=np.int64)
    if len(table) < n:
        raise IndexError(f"page table of {len(table)} pages does not cover {length} tokens")
    table = table[:n]
    if n and (table.min() < 0 or table.max() >= num_pages):
        raise IndexError(f"page index outside the pool of {num_pages} pages")
    shape = (n * ps, *k_buf.shape[2:])
    k = k_buf[table].reshape(shape)[:length].astype(np.float32, copy=False)
    v = v_buf[table].reshape(shape)[:length].astype(np.float32, copy=False)
    return k, v


def _softmax_rows(s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stable softmax over the last axis: ``(p unnormalised, row max m, row sum l)``."""
    m = s.max(-1)
    p = np.exp(s - m[..., None])
    return p, m, p.sum(-1)


def prefill_attention(q: np.ndarray, k_buf: np.ndarray, v_buf: np.ndarray,
                      page_table: Sequence[int] | np.ndarray, start_pos: int) -> np.ndarray:
    """Causal attention of ``T`` new tokens at positions ``start_pos .. start_pos+T-1``.

    q: ``[T, H, hd]``. Keys are cache positions ``0 .. start_pos+T-1`` (earlier chunks of a chunked
    prefill included), already written. Returns float32 ``[T, H, hd]``.
    """
    T, H, hd = q.shape
    G = _check(H, hd, k_buf, v_buf)
    hkv = H // G
    total = start_pos + T
    k, v = gather_kv(k_buf, v_buf, page_table, total)
    kt = k.transpose(1, 2, 0)[:, None]  # [Hkv, 1, hd, L]
    vt = v.transpose(1, 0, 2)[:, None]  # [Hkv, 1, L, hd]
    qs = q.astype(np.float32) * np.float32(1.0 / np.sqrt(hd))
    out = np.empty((T, H, hd), np.float32)
    block = max(1, min(T, _MAX_SCORE_ELEMS // max(1, H * total)))
    for i0 in range(0, T, block):
        i1 = min(T, i0 + block)
        keys = start_pos + i1  # later queries of other blocks are masked anyway: skip their keys
        qb = qs[i0:i1].reshape(i1 - i0, hkv, G, hd).transpose(1, 2, 0, 3)  # [Hkv, G, Tb, hd]
        s = qb @ kt[..., :keys]  # [Hkv, G, Tb, keys]
        qpos = start_pos + np.arange(i0, i1)
        s = np.where(np.arange(keys)[None, :] <= qpos[:, None], s, -np.inf)
        p, _, l_sum = _softmax_rows(s)
        o = (p @ vt[:, :, :keys]) / l_sum[..., None]  # [Hkv, G, Tb, hd]
        out[i0:i1] = o.transpose(2, 0, 1, 3).reshape(i1 - i0, H, hd)
    return out


def _decode_args(q: np.ndarray, k_buf: np.ndarray, v_buf: np.ndarray, page_tables: Sequence,
                 context_lens: Sequence[int] | np.ndarray) -> tuple[int, np.ndarray]:
    B, H, hd = q.shape
    G = _check(H, hd, k_buf, v_buf)
    lens = np.asarray(context_lens, dtype=np.int64).reshape(-1)
    if len(lens) != B or len(page_tables) != B:
        raise ValueError(f"batch of {B} queries, {len(lens)} context lengths, {len(page_tables)} page tables")
    if B and lens.min() < 1:
        raise ValueError("every decode sequence needs context_len >= 1 (its new token is already cached)")
    return G, lens


def decode_attention_single(q: np.ndarray, k_buf: np.ndarray, v_buf: np.ndarray, page_tables: Sequence,
                            context_lens: Sequence[int] | np.ndarray) -> np.ndarray:
    """One query per sequence over its whole cached context in one pass (the "single-block" kernel).

    q: ``[B, H, hd]``; ``page_tables[b]`` covers ``context_lens[b]`` tokens. Returns float32 ``[B, H, hd]``.
    """
    B, H, hd = q.shape
    G, lens = _decode_args(q, k_buf, v_buf, page_tables, context_lens)
    hkv = H // G
    qs = q.astype(np.float32) * np.float32(1.0 / np.sqrt(hd))
    out = np.empty((B, H, hd), np.float32)
    for b in range(B):
        k, v = gather_kv(k_buf, v_buf, page_tables[b], int(lens[b]))
        s = qs[b].reshape(hkv, G, hd) @ k.transpose(1, 2, 0)  # [Hkv, G, L]
        p, _, l_sum = _softmax_rows(s)
        out[b] = ((p @ v.transpose(1, 0, 2)) / l_sum[..., None]).reshape(H, hd)
    return out


def decode_partials(qg: np.ndarray, k: np.ndarray, v: np.ndarray, blocks: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split-KV partials of one sequence: what each multi-block CTA writes to the workspace.

    qg: scaled query ``[Hkv, G, hd]``; k, v: ``[L, Hkv, hd]``. The context is cut into
    ``nc = ceil(L / ceil(L / blocks))`` contiguous, non-empty chunks. Returns per chunk the locally
    normalised output ``o [nc, Hkv, G, hd]``, row max ``m [nc, Hkv, G]`` and sum-exp ``l [nc, Hkv, G]``.
    """
    L, hkv, hd = k.shape
    chunk = -(-L // blocks)
    nc = -(-L // chunk)
    pad = nc * chunk - L
    if pad:  # pad the last chunk; its padded keys are masked to -inf below
        k = np.concatenate([k, np.zeros((pad, hkv, hd), np.float32)])
        v = np.concatenate([v, np.zeros((pad, hkv, hd), np.float32)])
    kc = k.reshape(nc, chunk, hkv, hd).transpose(0, 2, 3, 1)  # [nc, Hkv, hd, chunk]
    vc = v.reshape(nc, chunk, hkv, hd).transpose(0, 2, 1, 3)  # [nc, Hkv, chunk, hd]
    s = qg[None] @ kc  # [nc, Hkv, G, chunk]
    if pad:
        valid = (np.arange(nc * chunk) < L).reshape(nc, 1, 1, chunk)
        s = np.where(valid, s, -np.inf)
    p, m, l_sum = _softmax_rows(s)  # every chunk has >= 1 valid key, so m is finite
    return (p @ vc) / l_sum[..., None], m, l_sum


def merge_partials(o: np.ndarray, m: np.ndarray, l_sum: np.ndarray) -> np.ndarray:
    """Log-sum-exp merge over the chunk axis 0: ``sum_c w_c o_c / sum_c w_c`` with ``w_c = l_c e^(m_c - M)``."""
    w = l_sum * np.exp(m - m.max(0, keepdims=True))  # [nc, ...]
    return (w[..., None] * o).sum(0) / w.sum(0)[..., None]


def decode_attention_multi(q: np.ndarray, k_buf: np.ndarray, v_buf: np.ndarray, page_tables: Sequence,
                           context_lens: Sequence[int] | np.ndarray, blocks_per_seq: int) -> np.ndarray:
    """Split-KV ("multi-block") decode: per-chunk partials + LSE merge; same result as single-block.

    q: ``[B, H, hd]``. Each sequence's context is split into at most ``blocks_per_seq`` chunks (fewer
    when it is shorter than ``blocks_per_seq`` tokens). Chunks are vectorised in numpy rather than run
    on threads: one batched matmul per sequence beats a thread pool for these sizes.
    """
    if blocks_per_seq < 1:
        raise ValueError(f"blocks_per_seq must be >= 1, got {blocks_per_seq}")
    B, H, hd = q.shape
    G, lens = _decode_args(q, k_buf, v_buf, page_tables, context_lens)
    hkv = H // G
    qs = q.astype(np.float32) * np.float32(1.0 / np.sqrt(hd))
    out = np.empty((B, H, hd), np.float32)
    for b in range(B):
        k, v = gather_kv(k_buf, v_buf, page_tables[b], int(lens[b]))
        o, m, l_sum = decode_partials(qs[b].reshape(hkv, G, hd), k, v, blocks_per_seq)
        out[b] = merge_partials(o, m, l_sum).reshape(H, hd)
    return out
