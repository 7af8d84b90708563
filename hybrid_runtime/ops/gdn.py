"""Stateful CPU operators of the Gated DeltaNet mixer (numpy, float32).

The stateless ONNX segment before these operators produces, per token, the pre-conv channels
``u = [q | k | v]`` (``C = 2*nk*dk + nv*dv``), the log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``
(``<= 0``) and ``beta = sigmoid(b)``, both ``[T, nv]``. These operators run the causal depthwise conv +
SiLU against the slot's conv window, l2-normalise q/k, and run the gated delta rule against the slot's
recurrent state. They return the core output ``o`` (before the gated RMSNorm and out_proj, which the
next segment does). Math: MODEL_MATH.md, "Gated DeltaNet mixer"; oracle: ``reference.gated_deltanet``.

State buffers of one layer, owned by the runtime and updated in place:
  * ``conv_buf`` float32 ``[rows, K-1, C]``: the last K-1 pre-conv inputs of each slot, oldest first.
  * ``rec_buf`` float32 ``[rows, nv, dk, dv]``: the delta-rule state of each slot.
``rows = num_slots + 1``; the last row is a padding sink that padded decode rows point at.
"""

from __future__ import annotations

import numpy as np


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) = inf for x < -88 gives the right limit, -0
        return x / (1.0 + np.exp(-x))


def _l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(1e-6))


def _check(conv_buf: np.ndarray, rec_buf: np.ndarray, u: np.ndarray, g: np.ndarray, beta: np.ndarray,
           conv_w: np.ndarray, nk: int, dk: int, nv: int, dv: int) -> None:
    """Raise ValueError unless all shapes agree (a wrong shape would otherwise broadcast silently)."""
    n, C, K = u.shape[0], 2 * nk * dk + nv * dv, conv_w.shape[-1]
    if nk <= 0 or nv % nk:
        raise ValueError(f"nv={nv} must be a positive multiple of nk={nk}")
    want = {"u": (u.shape, (n, C)), "g": (g.shape, (n, nv)), "beta": (beta.shape, (n, nv)),
            "conv_w": (conv_w.shape, (C, K)), "conv_buf": (conv_buf.shape[1:], (K - 1, C)),
            "rec_buf": (rec_buf.shape[1:], (nv, dk, dv))}
    for name, (got, exp) in want.items():
        if tuple(got) != exp:
            raise ValueError(f"{name} has shape {tuple(got)}, expected {exp} (per row for the buffers)")
    if conv_buf.shape[0] != rec_buf.shape[0]:
        raise ValueError(f"conv_buf has {conv_buf.shape[0]} rows but rec_buf has {rec_buf.shape[0]}")
    if conv_buf.dtype != np.float32 or rec_buf.dtype != np.float32:
        raise ValueError(f"state buffers must be float32, got {conv_buf.dtype} and {rec_buf.dtype}")


def _check_slots(slots: np.ndarray, rows: int, n: int) -> np.ndarray:
    """Validated slot indices ``[n]``. Negative indices are rejected: numpy would wrap them to other rows."""
    s = np.asarray(slots)
    if s.shape != (n,) or not (s.dtype == np.int64 or np.issubdtype(s.dtype, np.integer)):
        raise ValueError(f"slots must be an integer array of shape ({n},), got {s.dtype} {s.shape}")
    if n and (s.min() < 0 or s.max() >= rows):
        bad = (s < 0) | (s >= rows)
        raise IndexError(f"state slot(s) {s[bad].tolist()} out of range: buffers have rows 0..{rows - 1} "
                         f"(row {rows - 1} is the padding sink)")
    idx = s.astype(np.intp)
    # every slot is in 0..rows-1 now: a count per row finds a live one used twice (the sink row may repeat)
    if n > 1 and (np.bincount(idx, minlength=rows)[:rows - 1].max(initial=0) > 1 if rows <= 1 << 16
                  else np.unique(live := idx[idx != rows - 1]).size != live.size):
        # Two live rows sharing a slot would both read the old state and one write would be lost.
        raise ValueError(f"live slots must be distinct, got {s.tolist()}")
    return idx


def _split_heads(x: np.ndarray, nk: int, dk: int, nv: int,
                 dv: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Post-conv ``x [N, C]`` -> q, k ``[N, nv, dk]`` (normalised, one per value head), v ``[N, nv, dv]``.

    Value head j uses key head j // (nv/nk).
    """
    N, kd, r = x.shape[0], nk * dk, nv // nk
    q = _l2norm(x[:, :kd].reshape(N, nk, dk)) * np.float32(1.0 / np.sqrt(dk))
    k = _l2norm(x[:, kd:2 * kd].reshape(N, nk, dk))
    v = x[:, 2 * kd:].reshape(N, nv, dv)
    if r > 1:
        q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
    return q, k, v


def causal_conv_prefill(window: np.ndarray, u: np.ndarray,
                        conv_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv + SiLU of one sequence continuing from its window.

    window ``[K-1, C]`` (pre-conv inputs before ``u``, oldest first), u ``[T, C]``, conv_w ``[C, K]``.
    Returns (SiLU(conv) ``[T, C]``, new window ``[K-1, C]`` = the last K-1 rows of window ++ u).
    """
    T, K = u.shape[0], conv_w.shape[1]
    x = np.concatenate([window, u], axis=0)  # [K-1+T, C]
    wT = np.ascontiguousarray(conv_w.T, np.float32)  # contiguous taps: a strided column is ~2x slower
    acc, tmp = x[:T] * wT[0], np.empty(u.shape, np.float32)
    for j in range(1, K):  # K taps (typically 4), each one vectorised over T and C, no temporaries
        acc += np.multiply(x[j:j + T], wT[j], out=tmp)
    return _silu(acc), x[T:].copy()  # x[T:] has exactly K-1 rows, also when K == 1


def causal_conv_step(window: np.ndarray, u: np.ndarray, conv_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One conv step for B sequences: window ``[B, K-1, C]``, u ``[B, C]``, conv_w ``[C, K]``.

    Returns (SiLU(conv) ``[B, C]``, new window ``[B, K-1, C]``).
    """
    x = np.concatenate([window, u[:, None, :]], axis=1)  # [B, K, C]
    return _silu(np.sum(x * conv_w.T, axis=1)), x[:, 1:]


def delta_rule_step(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                    beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One gated delta-rule token for B sequences (the decode recurrence), updating ``state`` IN PLACE.

    state ``[B, nv, dk, dv]`` float32 (gdn_decode passes a gathered copy), q/k ``[B, nv, dk]``,
    v ``[B, nv, dv]``, g/beta ``[B, nv]``. Returns (o ``[B, nv, dv]``, ``state``).
    """
    # Decode is memory bound, so the state is streamed as few times as possible: both reads use the old
    # state (with S' = e^g S, the prediction S'^T k = e^g S^T k and the read after the write is
    # S'^T q + (q.k) delta), and the update is in place (fresh state-sized arrays cost page faults).
    # einsum, not matmul: numpy's stacked vector @ matrix does not use BLAS and is several times slower.
    eg = np.exp(g)[..., None]  # [B, nv, 1]
    pred = eg * np.einsum("bhk,bhkv->bhv", k, state)  # what the decayed state predicts for k
    delta = beta[..., None] * (v - pred)  # delta-rule correction
    o = eg * np.einsum("bhk,bhkv->bhv", q, state) + np.einsum("bhk,bhk->bh", q, k)[..., None] * delta
    state *= eg[..., None]  # decay first
    state += np.einsum("bhk,bhv->bhkv", k, delta)  # then the write
    return o, state


def chunked_delta_rule(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                       beta: np.ndarray, chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Gated delta rule over T tokens of one sequence in the chunked WY/UT form.

    state ``[nv, dk, dv]`` (state before the first token), q/k ``[T, nv, dk]`` (already normalised and
    repeated per value head), v ``[T, nv, dv]``, g/beta ``[T, nv]``. Returns (o ``[T, nv, dv]``, final
    state ``[nv, dk, dv]``), equal to T calls of ``delta_rule_step`` up to rounding.

    Within a chunk with cumulative log-decay G_i and start state S0, the written values
    u_i = beta_i (v_i - e^{G_i} S0^T k_i - sum_{j<i} e^{G_i-G_j} (k_i.k_j) u_j) form the unit lower
    triangular system (I + A) U = beta V - (beta e^G K) S0, solved once for all chunks; then
    o_i = e^{G_i} S0^T q_i + sum_{j<=i} e^{G_i-G_j} (q_i.k_j) u_j and the state is carried to the next chunk.
    """
    T, nv, dv = k.shape[0], k.shape[1], v.shape[-1]
    L = max(1, min(chunk, T))
    n = -(-T // L)
    pad = n * L - T

    def blocks(x: np.ndarray) -> np.ndarray:  # [T, nv, ...] -> [n, nv, L, ...]
        # Zero padding is inert: k = beta = 0 writes nothing and g = 0 does not decay the state.
        x = np.asarray(x, np.float32)
        x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), np.float32)]) if pad else x
        return x.reshape(n, L, *x.shape[1:]).swapaxes(1, 2)

    qc, kc, vc, bc = blocks(q), blocks(k), blocks(v), blocks(beta)
    # Cumulative decay in float64: G_i - G_j of two large sums would lose the small per-token g in float32.
    G = np.cumsum(blocks(g).astype(np.float64), axis=-1)  # [n, nv, L]
    lower = np.tril(np.ones((L, L), bool))
    # Mask before exp: above the diagonal G_i - G_j > 0 and could overflow.
    decay = np.exp(np.where(lower, G[..., :, None] - G[..., None, :], -np.inf)).astype(np.float32)
    eG = np.exp(G).astype(np.float32)[..., None]  # [n, nv, L, 1] decay from chunk start to i
    eTail = np.exp(G[..., -1:] - G).astype(np.float32)[..., None]  # decay from i to chunk end
    eLast = np.exp(G[..., -1]).astype(np.float32)[..., None, None]  # [n, nv, 1, 1] whole-chunk decay

    kb = kc * bc[..., None]
    kT = kc.swapaxes(-1, -2)
    M = np.tril((kb @ kT) * decay, -1) + np.eye(L, dtype=np.float32)  # I + A, A strictly lower
    # (I + A)^-1 by LAPACK: |A_ij| <= 1 and the pivot search keeps the first maximum, so partial pivoting
    # never swaps rows and this is forward substitution on the unit lower triangular I + A. Inverting the
    # L x L blocks and then one batched matmul is ~2x faster than solving for the dv+dk wide right side.
    rhs = np.concatenate([vc * bc[..., None], kb * eG], axis=-1)  # [n, nv, L, dv+dk]
    sol = np.linalg.inv(M) @ rhs
    Uv, W = sol[..., :dv], sol[..., dv:]  # U = Uv - W @ S0
    attn = (qc @ kT) * decay  # diagonal included: o_i reads after token i's write
    qd, kd = qc * eG, (kc * eTail).swapaxes(-1, -2)  # [n, nv, L, dk], [n, nv, dk, L]

    S = np.array(state, np.float32)
    o = np.empty((n, nv, L, dv), np.float32)
    for c in range(n):  # the only sequential part: carry the state from chunk to chunk
        U = Uv[c] - W[c] @ S
        o[c] = qd[c] @ S + attn[c] @ U
        S = S * eLast[c] + kd[c] @ U
    return o.swapaxes(1, 2).reshape(n * L, nv, dv)[:T], S


def gdn_prefill(conv_buf: np.ndarray, rec_buf: np.ndarray, slot: int, u: np.ndarray, g: np.ndarray,
                beta: np.ndarray, conv_w: np.ndarray, nk: int, dk: int, nv: int, dv: int,
                chunk: int = 64) -> np.ndarray:
    """One sequence's prefill chunk of T tokens (T >= 1) continuing from its state in row `slot`
    (which may be non-zero: prompts are prefilled in several chunks). u [T, C], g/beta [T, nv].
    Updates conv_buf[slot] and rec_buf[slot] in place. Returns o [T, nv*dv] float32.

    conv_buf ``[rows, K-1, C]``, rec_buf ``[rows, nv, dk, dv]``, conv_w ``[C, K]``; ``chunk`` is the
    WY/UT chunk length. Raises IndexError for a slot outside ``0..rows-1``, ValueError for bad shapes.
    """
    u, g, beta = (np.asarray(x, np.float32) for x in (u, g, beta))
    conv_w = np.asarray(conv_w, np.float32)
    _check(conv_buf, rec_buf, u, g, beta, conv_w, nk, dk, nv, dv)
    if u.shape[0] < 1:
        raise ValueError("gdn_prefill needs at least one token")
    s = int(_check_slots(np.array([slot]), conv_buf.shape[0], 1)[0])
    x, window = causal_conv_prefill(conv_buf[s], u, conv_w)
    q, k, v = _split_heads(x, nk, dk, nv, dv)
    o, S = chunked_delta_rule(rec_buf[s], q, k, v, g, beta, chunk)
    conv_buf[s], rec_buf[s] = window, S  # written last, so a failure leaves the slot untouched
    return o.reshape(u.shape[0], nv * dv)


def gdn_decode(conv_buf: np.ndarray, rec_buf: np.ndarray, slots: np.ndarray, u: np.ndarray, g: np.ndarray,
               beta: np.ndarray, conv_w: np.ndarray, nk: int, dk: int, nv: int, dv: int) -> np.ndarray:
    """One token for each of B sequences (B >= 1). slots [B] int64 (distinct for live sequences; padding
    rows may all point at the sink row rows-1 and may repeat). u [B, C], g/beta [B, nv].
    Updates the slots' rows in place. Returns o [B, nv*dv].

    conv_buf ``[rows, K-1, C]``, rec_buf ``[rows, nv, dk, dv]``, conv_w ``[C, K]``. Only the rows named
    in ``slots`` are written (the sink gets whichever padding row is scattered last).
    """
    u, g, beta = (np.asarray(x, np.float32) for x in (u, g, beta))
    conv_w = np.asarray(conv_w, np.float32)
    _check(conv_buf, rec_buf, u, g, beta, conv_w, nk, dk, nv, dv)
    idx = _check_slots(slots, conv_buf.shape[0], u.shape[0])
    x, window = causal_conv_step(conv_buf[idx], u, conv_w)  # fancy indexing gathers copies
    q, k, v = _split_heads(x, nk, dk, nv, dv)
    o, S = delta_rule_step(rec_buf[idx], q, k, v, g, beta)  # updates the gathered copy
    conv_buf[idx], rec_buf[idx] = window, S
    return o.reshape(u.shape[0], nv * dv)
