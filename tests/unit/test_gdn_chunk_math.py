"""The chunked (WY / UT-transform) gated delta rule exactly as ``ops/cuda/gdn_chunk.cu`` decomposes it,
in float64 numpy, against the token recurrence of :func:`hybrid_runtime.ops.gdn.delta_rule_step`.

The model mirrors the two kernels one to one (same chunk grid aligned to each sequence's token 0, same
workspace arrays, same zero padding of a partial last chunk, same order of the per-chunk steps), so the
CUDA is a transliteration of what this test verifies:

* ``prep`` (``gdn_chunk_prep``, one CTA per (chunk, value head, sequence)): l2 norms, decay cumsum G,
  A = strictly-lower(beta_i (k_i.k_j) e^{G_i-G_j}), Aqk = lower(q_i.k_j e^{G_i-G_j}), forward substitution
  (I + A) X = [beta v | beta e^G k] -> u = X[:, :dv], w = X[:, dv:], per-token scales
  sq_i = rq_i e^{G_i}, sk_i = rk_i e^{G_last - G_i} and e^{G_last}.
* ``state pass`` (``gdn_chunk_state``, one CTA per (32 value columns (``-DTC=3``: 64), value head, sequence),
  sequential over chunks): V = U - W S; o = sq * (q_raw S) + Aqk V; S = e^{G_last} S + k_raw^T (sk * V).

The tf32 builds (``-DTC=1``, ``-DTC=2``, ``-DTC=3``; 3 is 2's numerics in wider state CTAs, so the same model)
run the same decomposition with the operands of every product except the
forward substitution rounded to tf32 (``cvt.rna``); ``rnd=tf32`` applies that rounding here, which bounds
the error the GPU tests allow that build.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hybrid_runtime.ops.gdn import delta_rule_step

CH = 64  # chunk length of the CUDA kernels
Round = Callable[[np.ndarray], np.ndarray]


def exact(a: np.ndarray) -> np.ndarray:
    """The fp32 build's products: operands as they are (float64 here)."""
    return a


def tf32(a: np.ndarray) -> np.ndarray:
    """cvt.rna.tf32.f32 of float32(a): 10 mantissa bits, round to nearest, ties away from zero (adding half
    an ulp to the magnitude bits carries into the exponent correctly), back as float64."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def norms(x: np.ndarray, nk: int, dk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token and key head: rq = 1/|q|/sqrt(dk), rk = 1/|k| (with the +1e-6 of ops.gdn). ``[N, nk]`` each."""
    N = x.shape[0]
    q = x[:, :nk * dk].reshape(N, nk, dk)
    k = x[:, nk * dk:2 * nk * dk].reshape(N, nk, dk)
    rq = 1.0 / np.sqrt((q * q).sum(-1) + 1e-6) / np.sqrt(dk)
    rk = 1.0 / np.sqrt((k * k).sum(-1) + 1e-6)
    return rq, rk


def unit_lower_inverse(A: np.ndarray) -> np.ndarray:
    """(I + A)^-1 for a strictly lower 64 x 64 A, blockwise as gdn_chunk_prep's tf32 build (-DTC=2) computes
    it (float32 SIMT there): the four 16 x 16 diagonal blocks by forward substitution on the identity (one
    column per thread), then the off-diagonal blocks by distance d = i - j = 1, 2, 3 from the block
    recurrence T_ij = -T_ii sum_{k=j}^{i-1} A_ik T_kj (P = the sum first, one barrier, then T_ii P)."""
    B = 16
    T = np.zeros((CH, CH))
    for b in range(4):  # level 0: X = column c of T_bb; X_r = delta_rc - sum_{m<r} A_rm X_m
        Ab = A[B * b:B * (b + 1), B * b:B * (b + 1)]
        for c in range(B):
            X = np.zeros(B)
            for r in range(B):
                X[r] = float(r == c) - Ab[r, :r] @ X[:r]
            T[B * b:B * (b + 1), B * b + c] = X
    for d in range(1, 4):
        P = {i: sum(A[B * i:B * (i + 1), B * k:B * (k + 1)] @ T[B * k:B * (k + 1), B * (i - d):B * (i - d + 1)]
                    for k in range(i - d, i)) for i in range(d, 4)}
        for i in range(d, 4):
            T[B * i:B * (i + 1), B * (i - d):B * (i - d + 1)] = -T[B * i:B * (i + 1), B * i:B * (i + 1)] @ P[i]
    return T


def prep(x: np.ndarray, g: np.ndarray, beta: np.ndarray, starts: np.ndarray, nk: int, nv: int, dk: int,
         dv: int, rnd: Round = exact, inverse: bool = False) -> dict[str, np.ndarray]:
    """The workspace gdn_chunk_prep writes: w ``[N, nv, dk]``, u ``[N, nv, dv]``, aqk ``[N, nv, 64]`` (row i of
    its chunk's Aqk), sc ``[N, nv, 4]`` = (sq, sk, e^{G_last}, 0). Rows are token rows of the packed batch.
    ``rnd`` rounds the operands of K K^T and Q K^T (the tensor-core products of the tf32 builds).
    ``inverse`` is the -DTC=2 build (precision "tf32"): instead of the forward substitution,
    T = (I + A)^-1 (:func:`unit_lower_inverse`), then u = rnd(T diag(beta)) rnd(v) and
    w = rnd(rnd(T diag(beta e^G)) rnd(k)) on tensor cores (w is stored rounded: it is only ever a tf32
    operand; so is Aqk)."""
    N = x.shape[0]
    w, u = np.zeros((N, nv, dk)), np.zeros((N, nv, dv))
    aqk, sc = np.zeros((N, nv, CH)), np.zeros((N, nv, 4))
    rq, rk = norms(x, nk, dk)
    r = nv // nk
    for s in range(len(starts) - 1):
        T = starts[s + 1] - starts[s]
        for c in range(-(-T // CH)):  # grid x: chunks of this sequence
            t0 = starts[s] + CH * c
            n = min(CH, T - CH * c)
            for h in range(nv):  # grid y
                kh = h // r
                # shared memory of the CTA: 64 rows, rows >= n zero
                qs, ks = np.zeros((CH, dk)), np.zeros((CH, dk))
                qs[:n] = x[t0:t0 + n, kh * dk:(kh + 1) * dk] * rq[t0:t0 + n, kh, None]
                ks[:n] = x[t0:t0 + n, nk * dk + kh * dk:nk * dk + (kh + 1) * dk] * rk[t0:t0 + n, kh, None]
                gg, bt = np.zeros(CH), np.zeros(CH)
                gg[:n], bt[:n] = g[t0:t0 + n, h], beta[t0:t0 + n, h]
                G = np.cumsum(gg)  # padding adds 0: G[63] = G[n-1]
                low = np.tril(np.ones((CH, CH), bool))
                dec = np.where(low, np.exp(np.where(low, G[:, None] - G[None, :], 0.0)), 0.0)
                A = np.tril(bt[:, None] * (rnd(ks) @ rnd(ks).T) * dec, -1)
                Aqk = (rnd(qs) @ rnd(ks).T) * dec
                eG = np.exp(G)
                vraw = np.zeros((CH, dv))
                vraw[:n] = x[t0:t0 + n, 2 * nk * dk + h * dv:2 * nk * dk + (h + 1) * dv]
                if inverse:
                    Tinv = unit_lower_inverse(A)
                    u[t0:t0 + n, h] = (rnd(Tinv * bt[None, :]) @ rnd(vraw))[:n]
                    w[t0:t0 + n, h] = rnd(rnd(Tinv * (bt * eG)[None, :]) @ rnd(ks))[:n]
                    aqk[t0:t0 + n, h] = rnd(Aqk)[:n]
                else:
                    # thread `col` of the CTA: one column of X = [beta v | beta e^G k], forward substitution
                    X = np.concatenate([bt[:, None] * vraw, (bt * eG)[:, None] * ks], axis=1)
                    for i in range(1, CH):
                        X[i] = X[i] - A[i, :i] @ X[:i]
                    u[t0:t0 + n, h], w[t0:t0 + n, h] = X[:n, :dv], X[:n, dv:]
                    aqk[t0:t0 + n, h] = Aqk[:n]
                sc[t0:t0 + n, h, 0] = rq[t0:t0 + n, kh] * eG[:n]
                sc[t0:t0 + n, h, 1] = rk[t0:t0 + n, kh] * np.exp(G[CH - 1] - G[:n])
                sc[t0:t0 + n, h, 2] = np.exp(G[CH - 1])
    return {"w": w, "u": u, "aqk": aqk, "sc": sc}


def chunk_stages(x: np.ndarray, ws: dict[str, np.ndarray], starts: np.ndarray, nk: int, nv: int, dk: int,
                 dv: int) -> Iterator[tuple[int, int, int, int, dict[str, np.ndarray]]]:
    """The state kernels' cp.async stages, per (sequence, value head) chunk after chunk: (s, h, t0, n, stage) with
    stage W, U ``[64, dk / dv]``, Q, K (raw x rows of the key head), A ``[64, 64]``, sc ``[64, 4]``; rows >= n zero."""
    r = nv // nk
    for s in range(len(starts) - 1):
        T = starts[s + 1] - starts[s]
        for h in range(nv):
            kh = h // r
            for c in range(-(-T // CH)):
                t0, n = starts[s] + CH * c, min(CH, T - CH * c)
                st = {"W": np.zeros((CH, dk)), "U": np.zeros((CH, dv)), "Q": np.zeros((CH, dk)),
                      "K": np.zeros((CH, dk)), "A": np.zeros((CH, CH)), "sc": np.zeros((CH, 4))}
                st["W"][:n], st["U"][:n] = ws["w"][t0:t0 + n, h], ws["u"][t0:t0 + n, h]
                st["A"][:n], st["sc"][:n] = ws["aqk"][t0:t0 + n, h], ws["sc"][t0:t0 + n, h]
                st["Q"][:n] = x[t0:t0 + n, kh * dk:(kh + 1) * dk]
                st["K"][:n] = x[t0:t0 + n, nk * dk + kh * dk:nk * dk + (kh + 1) * dk]
                yield s, h, t0, n, st


def state_pass(x: np.ndarray, ws: dict[str, np.ndarray], starts: np.ndarray, states: np.ndarray, nk: int,
               nv: int, dk: int, dv: int, rnd: Round = exact) -> tuple[np.ndarray, np.ndarray]:
    """gdn_chunk_state: per (sequence, value head), chunk after chunk. states ``[S, nv, dk, dv]`` (copied).
    Returns (o ``[N, nv, dv]``, final states). The CUDA splits dv into CTAs of 32 columns; columns are
    independent in every step, so the split does not show here. ``rnd`` rounds the operands of the four
    products (tf32 build); the state itself and the sums stay unrounded (float32 accumulators there)."""
    o = np.zeros((x.shape[0], nv, dv))
    out = np.array(states, np.float64)
    for s, h, t0, n, st in chunk_stages(x, ws, starts, nk, nv, dk, dv):
        S, sc = out[s, h], st["sc"]
        V = st["U"] - rnd(st["W"]) @ rnd(S)  # step a
        Vk = sc[:, 1:2] * V
        o_c = sc[:, 0:1] * (rnd(st["Q"]) @ rnd(S)) + rnd(st["A"]) @ rnd(V)  # step b
        o[t0:t0 + n, h] = o_c[:n]
        out[s, h] = sc[0, 2] * S + rnd(st["K"]).T @ rnd(Vk)  # step c
    return o, out


def token_reference(x: np.ndarray, g: np.ndarray, beta: np.ndarray, starts: np.ndarray, states: np.ndarray,
                    nk: int, nv: int, dk: int, dv: int) -> tuple[np.ndarray, np.ndarray]:
    """The token recurrence (ops.gdn.delta_rule_step) in float64, sequence by sequence."""
    N = x.shape[0]
    rq, rk = norms(x, nk, dk)
    r = nv // nk
    q = np.repeat(x[:, :nk * dk].reshape(N, nk, dk) * rq[..., None], r, axis=1)
    k = np.repeat(x[:, nk * dk:2 * nk * dk].reshape(N, nk, dk) * rk[..., None], r, axis=1)
    v = x[:, 2 * nk * dk:].reshape(N, nv, dv)
    o = np.zeros((N, nv, dv))
    out = np.array(states, np.float64)
    for s in range(len(starts) - 1):
        S = out[s:s + 1].copy()
        for t in range(starts[s], starts[s + 1]):
            ot, S = delta_rule_step(S, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
            o[t] = ot[0]
        out[s] = S[0]
    return o, out


def case(lens: list[int], nk: int, nv: int, dk: int, dv: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    N = sum(lens)
    C = 2 * nk * dk + nv * dv
    x = rng.standard_normal((N, C))
    g = -np.abs(rng.standard_normal((N, nv))) * 0.3
    beta = 1 / (1 + np.exp(-rng.standard_normal((N, nv))))
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    states = 0.3 * rng.standard_normal((len(lens), nv, dk, dv))
    return x, g, beta, starts, states


@pytest.mark.parametrize("lens", [[1], [63], [64], [65], [130], [1, 64, 200, 7, 129]])
def test_chunked_equals_token_recurrence(lens: list[int]) -> None:
    nk, nv, dk, dv = 2, 4, 16, 12  # GQA 2 value heads per key head, dk != dv
    x, g, beta, starts, states = case(lens, nk, nv, dk, dv, seed=sum(lens))
    ws = prep(x, g, beta, starts, nk, nv, dk, dv)
    o, S = state_pass(x, ws, starts, states, nk, nv, dk, dv)
    o_ref, S_ref = token_reference(x, g, beta, starts, states, nk, nv, dk, dv)
    assert np.abs(o - o_ref).max() < 1e-10 * max(1.0, np.abs(o_ref).max())
    assert np.abs(S - S_ref).max() < 1e-10 * max(1.0, np.abs(S_ref).max())


def test_strong_decay_underflows_cleanly() -> None:
    """g of -30 per token: e^{G} underflows to 0 inside a chunk; the factored form must not make inf/nan
    (every exponent the kernels take is <= 0)."""
    nk, nv, dk, dv = 1, 2, 8, 8
    x, g, beta, starts, states = case([150], nk, nv, dk, dv, seed=3)
    g[:] = -30.0
    ws = prep(x, g, beta, starts, nk, nv, dk, dv)
    o, S = state_pass(x, ws, starts, states, nk, nv, dk, dv)
    o_ref, S_ref = token_reference(x, g, beta, starts, states, nk, nv, dk, dv)
    assert np.isfinite(o).all() and np.isfinite(S).all()
    assert np.abs(o - o_ref).max() < 1e-10 and np.abs(S - S_ref).max() < 1e-10


def test_cuts_at_chunk_multiples_do_not_change_the_result() -> None:
    """Prefilling 200 tokens as 128 + 72 (a cut at a multiple of 64, state through the slot) runs the same
    chunks in the same order as one piece of 200: the batch invariance the backend's PREFILL_ALIGN relies on."""
    nk, nv, dk, dv = 1, 1, 8, 4
    x, g, beta, starts, states = case([200], nk, nv, dk, dv, seed=9)
    whole_o, whole_S = state_pass(x, prep(x, g, beta, starts, nk, nv, dk, dv), starts, states, nk, nv, dk, dv)
    a, b = slice(0, 128), slice(128, 200)
    sa, sb = np.array([0, 128]), np.array([0, 72])
    o1, S1 = state_pass(x[a], prep(x[a], g[a], beta[a], sa, nk, nv, dk, dv), sa, states, nk, nv, dk, dv)
    o2, S2 = state_pass(x[b], prep(x[b], g[b], beta[b], sb, nk, nv, dk, dv), sb, S1, nk, nv, dk, dv)
    assert np.array_equal(np.concatenate([o1, o2]), whole_o) and np.array_equal(S2, whole_S)


def test_tf32_rounding_model() -> None:
    """The rounding the tf32 build applies: 10 mantissa bits, nearest, ties away from zero."""
    one_ulp = 2.0**-10
    a = np.array([1.0, 1.0 + one_ulp / 2, -(1.0 + one_ulp / 2), 1.0 + one_ulp / 4, 3.0 + 0.75 * 2 * one_ulp])
    assert tf32(a).tolist() == [1.0, 1.0 + one_ulp, -(1.0 + one_ulp), 1.0, 3.0 + 2 * one_ulp]


@pytest.mark.parametrize("lens", [[300], [64, 1, 129]])
def test_tf32_operands_stay_near_float64(lens: list[int]) -> None:
    """The tf32 build's decomposition (operands of K K^T, Q K^T, W S, Q S, Aqk V, K^T V rounded to tf32) at
    the Qwen3.5 head size, from a non-zero state: relative (Frobenius) error a few 1e-4, the scale of the GPU
    test's tolerance for that build (TF32_TOL in tests/gpu/test_gdn_chunk_gpu.py)."""
    nk, nv, dk, dv = 1, 2, 128, 128
    x, g, beta, starts, states = case(lens, nk, nv, dk, dv, seed=len(lens))
    o_ref, S_ref = token_reference(x, g, beta, starts, states, nk, nv, dk, dv)
    o, S = state_pass(x, prep(x, g, beta, starts, nk, nv, dk, dv, tf32), starts, states, nk, nv, dk, dv, tf32)
    eo = np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref)
    es = np.linalg.norm(S - S_ref) / np.linalg.norm(S_ref)
    print(f"tf32 model: o {eo:.2e}, state {es:.2e}")
    assert 1e-6 < eo < 2e-3 and 1e-6 < es < 2e-3


@pytest.mark.parametrize("lens", [[1], [65], [1, 64, 200, 7, 129]])
def test_blockwise_inverse_equals_forward_substitution(lens: list[int]) -> None:
    """The -DTC=2 prep (T = (I + A)^-1 blockwise, then u = T diag(beta) v, w = T diag(beta e^G) k) writes the
    forward substitution's workspace in exact arithmetic, partial chunks included."""
    nk, nv, dk, dv = 2, 4, 16, 12
    x, g, beta, starts, _states = case(lens, nk, nv, dk, dv, seed=sum(lens) + 1)
    a, b = prep(x, g, beta, starts, nk, nv, dk, dv), prep(x, g, beta, starts, nk, nv, dk, dv, inverse=True)
    for key in a:
        assert np.abs(a[key] - b[key]).max() < 1e-12 * max(1.0, np.abs(a[key]).max()), key
    A = np.tril(np.random.default_rng(0).uniform(-1, 1, (CH, CH)), -1)
    assert np.abs(unit_lower_inverse(A) @ (np.eye(CH) + A) - np.eye(CH)).max() < 1e-8


@pytest.mark.parametrize("lens", [[300], [64, 1, 129]])
def test_tf32_inverse_build_stays_near_float64(lens: list[int]) -> None:
    """precision "tf32" (-DTC=2): the inverse form with T diag(beta), T diag(beta e^G), v and k rounded to tf32
    for the u / w products (w and Aqk stored rounded), plus the state pass's tf32 operands. The model gives
    o ~5e-4, state ~4e-4 at dk = dv = 128 (the forward-substitution build: ~4e-4, ~3e-4)."""
    nk, nv, dk, dv = 1, 2, 128, 128
    x, g, beta, starts, states = case(lens, nk, nv, dk, dv, seed=len(lens))
    o_ref, S_ref = token_reference(x, g, beta, starts, states, nk, nv, dk, dv)
    ws = prep(x, g, beta, starts, nk, nv, dk, dv, tf32, inverse=True)
    o, S = state_pass(x, ws, starts, states, nk, nv, dk, dv, tf32)
    eo = np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref)
    es = np.linalg.norm(S - S_ref) / np.linalg.norm(S_ref)
    print(f"tf32 inverse model: o {eo:.2e}, state {es:.2e}")
    assert 1e-6 < eo < 1e-3 and 1e-6 < es < 1e-3


def bf16(a: np.ndarray) -> np.ndarray:
    """cvt.rn.bf16(x2).f32 of float32(a): 8-bit significand, round to nearest even, back as float64."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return r.view(np.float32).astype(np.float64)


def split_pass(x: np.ndarray, ws: dict[str, np.ndarray], starts: np.ndarray, states: np.ndarray, nk: int,
               nv: int, dk: int, dv: int, rnd: Round | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The "bf16" build (-DTC=4): gdn_chunk_h then gdn_chunk_o, with the kernels' bf16 roundings (W and Aqk
    stored bf16 by the prep, raw q / k rows in bf16, S published in bf16 as the B operand and as the chunk's
    H, V stored bf16, sk V rounded once); float32-like accumulators and the state unrounded. Per chunk:
    V = U - W bf16(S); H_c = bf16(S); S = e^{G_last} S + K^T bf16(sk V); then o = sq (Q H_c) + Aqk bf16(V).
    ``rnd`` replaces bf16 (``exact``: the split in exact arithmetic)."""
    b = bf16 if rnd is None else rnd
    o = np.zeros((x.shape[0], nv, dv))
    out = np.array(states, np.float64)
    for s, h, t0, n, st in chunk_stages(x, ws, starts, nk, nv, dk, dv):
        S, sc = out[s, h], st["sc"]
        H = b(S)
        V = st["U"] - b(st["W"]) @ H  # gdn_chunk_h step a
        o[t0:t0 + n, h] = (sc[:, 0:1] * (b(st["Q"]) @ H) + b(st["A"]) @ b(V))[:n]  # gdn_chunk_o
        out[s, h] = sc[0, 2] * S + b(st["K"]).T @ b(sc[:, 1:2] * V)  # gdn_chunk_h step c
    return o, out


@pytest.mark.parametrize("lens", [[300], [64, 1, 129]])
def test_bf16_split_build_stays_near_float64(lens: list[int]) -> None:
    """precision "bf16" (-DTC=4): the tf32 inverse prep, then the state pass split in two on bf16 operands. The
    model gives o ~2e-3, state ~2e-3 at dk = dv = 128 (the H200 measured 2.2e-3 / 2.3e-3 against the float64
    token recurrence): the scale of BF16_TOL in tests/gpu/test_gdn_chunk_gpu.py. The split itself (o formed from
    the stored H_c and V after the state pass) is exact: without rounding it equals the fused state pass."""
    nk, nv, dk, dv = 1, 2, 128, 128
    x, g, beta, starts, states = case(lens, nk, nv, dk, dv, seed=len(lens))
    o_ref, S_ref = token_reference(x, g, beta, starts, states, nk, nv, dk, dv)
    ws = prep(x, g, beta, starts, nk, nv, dk, dv, tf32, inverse=True)
    o, S = split_pass(x, ws, starts, states, nk, nv, dk, dv)
    eo = np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref)
    es = np.linalg.norm(S - S_ref) / np.linalg.norm(S_ref)
    print(f"bf16 split model: o {eo:.2e}, state {es:.2e}")
    assert 5e-4 < eo < 5e-3 and 5e-4 < es < 5e-3
    ws64 = prep(x, g, beta, starts, nk, nv, dk, dv)
    for a, b in zip(split_pass(x, ws64, starts, states, nk, nv, dk, dv, exact),
                    state_pass(x, ws64, starts, states, nk, nv, dk, dv)):
        assert np.abs(a - b).max() < 1e-10 * max(1.0, np.abs(b).max())
    assert bf16(np.array([1.0 + 2.0**-9, 1.0 + 3 * 2.0**-9, -3.0])).tolist() == [1.0, 1.0 + 2.0**-7, -3.0]
