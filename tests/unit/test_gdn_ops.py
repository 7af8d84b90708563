"""Gated DeltaNet state operators (hybrid_runtime.ops.gdn) against a plain per-token recurrence.

The recurrence below mirrors the loop of ``reference.gated_deltanet`` but can start from a non-zero
conv window and state; ``test_oracle_matches_reference`` ties it to the reference itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_runtime import reference
from hybrid_runtime.config import DENSE, LINEAR, ModelConfig
from hybrid_runtime.ops import gdn

ATOL = 1e-4
# (nk, nv, dk, dv): equal head counts, and the GQA-like ratio nv/nk = 2.
SHAPES = [(2, 2, 8, 6), (2, 4, 8, 6)]


def recurrence(u, g, beta, conv_w, nk, dk, nv, dv, window=None, S=None):
    """Per-token oracle: returns (o [T, nv*dv], final window [K-1, C], final state [nv, dk, dv])."""
    T, C = u.shape
    K, kd, r = conv_w.shape[1], nk * dk, nv // nk
    window = np.zeros((K - 1, C), np.float32) if window is None else window
    S = np.zeros((nv, dk, dv), np.float32) if S is None else S.copy()
    x = np.concatenate([window, u], axis=0)
    out = np.empty((T, nv, dv), np.float32)
    for t in range(T):
        c = reference.silu(np.sum(x[t:t + K].T * conv_w, axis=1))
        q = np.repeat(reference.l2norm(c[:kd].reshape(nk, dk)) / np.sqrt(dk), r, axis=0)
        k = np.repeat(reference.l2norm(c[kd:2 * kd].reshape(nk, dk)), r, axis=0)
        v = c[2 * kd:].reshape(nv, dv)
        S = S * np.exp(g[t])[:, None, None]
        pred = np.einsum("hkv,hk->hv", S, k)
        S = S + k[:, :, None] * (beta[t][:, None] * (v - pred))[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q)
    return out.reshape(T, nv * dv), x[T:], S


def inputs(rng, T, nk, dk, nv, dv, K):
    """Random (u [T, C], g [T, nv], beta [T, nv], conv_w [C, K]) with g spanning weak to strong decay."""
    C = 2 * nk * dk + nv * dv
    u = rng.standard_normal((T, C)).astype(np.float32)
    g = (-np.exp(rng.uniform(-4, 1, (T, nv)))).astype(np.float32)
    beta = rng.uniform(0, 1, (T, nv)).astype(np.float32)
    conv_w = (rng.standard_normal((C, K)) * 0.7).astype(np.float32)
    return u, g, beta, conv_w


def buffers(rng, rows, nk, dk, nv, dv, K):
    """Non-zero state buffers, so that a stray write or a missed read shows."""
    C = 2 * nk * dk + nv * dv
    conv = rng.standard_normal((rows, K - 1, C)).astype(np.float32)
    rec = (rng.standard_normal((rows, nv, dk, dv)) * 0.3).astype(np.float32)
    return conv, rec


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_oracle_matches_reference(shape, K):
    """gdn_prefill + gated norm + out_proj equals reference.gated_deltanet (so does the test oracle)."""
    nk, nv, dk, dv = shape
    rng = np.random.default_rng(1)
    T, C, vd = 70, 2 * nk * dk + nv * dv, nv * dv
    hidden = C + 2 * nv + vd  # h = [u | b | a | z], so each projection just selects its columns
    cfg = ModelConfig(model_type="qwen3_5_text", vocab_size=8, hidden_size=hidden, num_layers=1,
                      layer_types=(LINEAR,), ffn_types=(DENSE,), rms_norm_eps=1e-6, tie_word_embeddings=False,
                      num_heads=1, num_kv_heads=1, head_dim=8, rotary_dim=8, rope_theta=1e4,
                      attention_bias=False, max_position_embeddings=256, linear_num_key_heads=nk,
                      linear_num_value_heads=nv, linear_key_head_dim=dk, linear_value_head_dim=dv,
                      conv_kernel=K, intermediate_size=8)
    eye = np.eye(hidden, dtype=np.float32)
    p = "layers.0.linear_attn."
    w = {p + "in_proj_qkv": eye[:C], p + "in_proj_b": eye[C:C + nv], p + "in_proj_a": eye[C + nv:C + 2 * nv],
         p + "in_proj_z": eye[C + 2 * nv:],
         p + "conv1d": (rng.standard_normal((C, K)) * 0.7).astype(np.float32),
         p + "A_log": rng.uniform(-2, 1, nv).astype(np.float32),
         p + "dt_bias": rng.standard_normal(nv).astype(np.float32),
         p + "norm": rng.uniform(0.5, 1.5, dv).astype(np.float32),
         p + "out_proj": (rng.standard_normal((hidden, vd)) * 0.2).astype(np.float32)}
    h = rng.standard_normal((T, hidden)).astype(np.float32)
    want = reference.gated_deltanet(cfg, w, 0, h)

    u, b, a, z = h[:, :C], h[:, C:C + nv], h[:, C + nv:C + 2 * nv], h[:, C + 2 * nv:]
    g = (-np.exp(w[p + "A_log"]) * reference.softplus(a + w[p + "dt_bias"])).astype(np.float32)
    beta = reference.sigmoid(b)

    def post(o):
        o = o.reshape(T, nv, dv)
        o = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps) * w[p + "norm"]
        return (o * reference.silu(z.reshape(T, nv, dv))).reshape(T, vd) @ w[p + "out_proj"].T

    conv, rec = np.zeros((2, K - 1, C), np.float32), np.zeros((2, nv, dk, dv), np.float32)
    got = gdn.gdn_prefill(conv, rec, 0, u, g, beta, w[p + "conv1d"], nk, dk, nv, dv)
    np.testing.assert_allclose(post(got), want, atol=ATOL, rtol=1e-4)
    oracle = recurrence(u, g, beta, w[p + "conv1d"], nk, dk, nv, dv)[0]
    np.testing.assert_allclose(post(oracle), want, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 200])
def test_prefill_matches_recurrence(T, shape, K, fresh):
    nk, nv, dk, dv = shape
    rng = np.random.default_rng(T * 7 + K)
    u, g, beta, conv_w = inputs(rng, T, nk, dk, nv, dv, K)
    conv, rec = buffers(rng, 6, nk, dk, nv, dv, K)
    slot = 3
    if fresh:
        conv[slot], rec[slot] = 0.0, 0.0
    conv0, rec0 = conv.copy(), rec.copy()
    o = gdn.gdn_prefill(conv, rec, slot, u, g, beta, conv_w, nk, dk, nv, dv)
    want, window, S = recurrence(u, g, beta, conv_w, nk, dk, nv, dv, conv0[slot], rec0[slot])
    assert o.shape == (T, nv * dv) and o.dtype == np.float32
    np.testing.assert_allclose(o, want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(conv[slot], window, atol=0, rtol=0)
    np.testing.assert_allclose(rec[slot], S, atol=ATOL, rtol=0)
    others = np.arange(6) != slot
    assert np.array_equal(conv[others], conv0[others]) and np.array_equal(rec[others], rec0[others])


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("splits", [[1, 63, 70, 66], [2, 1, 1, 5, 64, 127], [200]])
def test_prefill_split_equals_single(splits, K):
    nk, nv, dk, dv = SHAPES[1]
    rng = np.random.default_rng(5)
    u, g, beta, conv_w = inputs(rng, sum(splits), nk, dk, nv, dv, K)
    conv1, rec1 = buffers(rng, 3, nk, dk, nv, dv, K)
    conv2, rec2 = conv1.copy(), rec1.copy()
    whole = gdn.gdn_prefill(conv1, rec1, 1, u, g, beta, conv_w, nk, dk, nv, dv)
    parts, t = [], 0
    for n in splits:
        sl = slice(t, t + n)
        parts.append(gdn.gdn_prefill(conv2, rec2, 1, u[sl], g[sl], beta[sl], conv_w, nk, dk, nv, dv,
                                     chunk=16))
        t += n
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(conv2, conv1)
    np.testing.assert_allclose(rec2, rec1, atol=1e-5, rtol=0)


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_then_decode(shape, K):
    """Two sequences prefilled into slots 4 and 1, then decoded together with a padding row."""
    nk, nv, dk, dv = shape
    rng = np.random.default_rng(11)
    rows, slots, T0, steps = 6, [4, 1], [70, 5], 6
    conv = np.zeros((rows, K - 1, 2 * nk * dk + nv * dv), np.float32)
    rec = np.zeros((rows, nv, dk, dv), np.float32)
    seqs = [inputs(rng, T0[i] + steps, nk, dk, nv, dv, K)[:3] for i in range(2)]
    conv_w = inputs(rng, 1, nk, dk, nv, dv, K)[3]
    for s, n, (u, g, beta) in zip(slots, T0, seqs):
        gdn.gdn_prefill(conv, rec, s, u[:n], g[:n], beta[:n], conv_w, nk, dk, nv, dv)
    got = []
    for t in range(steps):
        pad = inputs(rng, 1, nk, dk, nv, dv, K)[:3]  # garbage for the padding row
        rows_in = [(u[T0[i] + t], g[T0[i] + t], beta[T0[i] + t]) for i, (u, g, beta) in enumerate(seqs)]
        u_b, g_b, b_b = (np.stack([r[j] for r in rows_in] + [pad[j][0]]) for j in range(3))
        o = gdn.gdn_decode(conv, rec, np.array([*slots, rows - 1], np.int64), u_b, g_b, b_b, conv_w,
                           nk, dk, nv, dv)
        got.append(o[:2])
    got = np.stack(got)  # [steps, 2, nv*dv]
    for i, (u, g, beta) in enumerate(seqs):
        want, window, S = recurrence(u, g, beta, conv_w, nk, dk, nv, dv)
        np.testing.assert_allclose(got[:, i], want[T0[i]:], atol=ATOL, rtol=0)
        np.testing.assert_allclose(conv[slots[i]], window, atol=0, rtol=0)
        np.testing.assert_allclose(rec[slots[i]], S, atol=ATOL, rtol=0)
    assert not conv[[0, 2, 3]].any() and not rec[[0, 2, 3]].any()


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("B", [1, 2, 3, 16])
def test_decode_batch_and_untouched_rows(B, K):
    nk, nv, dk, dv = SHAPES[1]
    rng = np.random.default_rng(B)
    rows = 41
    live = np.sort(rng.choice(np.arange(0, rows - 1, 2), B, replace=False))  # non-contiguous
    slots = np.concatenate([live, np.full(3, rows - 1)]).astype(np.int64)
    rng.shuffle(slots)
    conv, rec = buffers(rng, rows, nk, dk, nv, dv, K)
    conv0, rec0 = conv.copy(), rec.copy()
    steps = 3
    u, g, beta, conv_w = inputs(rng, steps * len(slots), nk, dk, nv, dv, K)
    u, g, beta = (x.reshape(steps, len(slots), -1) for x in (u, g, beta))
    o = np.stack([gdn.gdn_decode(conv, rec, slots, u[t], g[t], beta[t], conv_w, nk, dk, nv, dv)
                  for t in range(steps)])
    for i, s in enumerate(slots):
        if s == rows - 1:
            continue
        want, window, S = recurrence(u[:, i], g[:, i], beta[:, i], conv_w, nk, dk, nv, dv, conv0[s], rec0[s])
        np.testing.assert_allclose(o[:, i], want, atol=ATOL, rtol=0)
        np.testing.assert_array_equal(conv[s], window)
        np.testing.assert_allclose(rec[s], S, atol=ATOL, rtol=0)
    untouched = np.setdiff1d(np.arange(rows), slots)
    assert np.array_equal(conv[untouched], conv0[untouched])
    assert np.array_equal(rec[untouched], rec0[untouched])


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_delta_rule_equals_steps(chunk):
    """Also with decays strong enough that e^{cumsum g} underflows within a chunk: no inf/NaN."""
    rng = np.random.default_rng(chunk)
    T, nv, dk, dv = 150, 3, 8, 5
    q, k = (gdn._l2norm(rng.standard_normal((T, nv, dk)).astype(np.float32)) for _ in range(2))
    v = rng.standard_normal((T, nv, dv)).astype(np.float32)
    g = (-np.exp(rng.uniform(-6, 4, (T, nv)))).astype(np.float32)  # down to about -55 per token
    g[40:60] = -1e3
    beta = rng.uniform(0, 1, (T, nv)).astype(np.float32)
    S0 = rng.standard_normal((nv, dk, dv)).astype(np.float32)
    o, S = gdn.chunked_delta_rule(S0, q, k, v, g, beta, chunk)
    S_ref, want = S0[None].copy(), []
    for t in range(T):
        ot, S_ref = gdn.delta_rule_step(S_ref, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
        want.append(ot[0])
    assert np.isfinite(o).all() and np.isfinite(S).all()
    np.testing.assert_allclose(o, np.stack(want), atol=ATOL, rtol=0)
    np.testing.assert_allclose(S, S_ref[0], atol=ATOL, rtol=0)


def test_causal_conv_prefill_window_shorter_than_kernel():
    rng = np.random.default_rng(0)
    C, K = 5, 4
    w = rng.standard_normal((C, K)).astype(np.float32)
    window = rng.standard_normal((K - 1, C)).astype(np.float32)
    u = rng.standard_normal((2, C)).astype(np.float32)
    out, new = gdn.causal_conv_prefill(window, u, w)
    x = np.concatenate([window, u])
    want = [reference.silu(np.sum(x[t:t + K].T * w, axis=1)) for t in range(2)]
    np.testing.assert_allclose(out, np.stack(want), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(new, np.concatenate([window[2:], u]))


def test_bad_slots_raise():
    nk, nv, dk, dv = SHAPES[1]
    rng = np.random.default_rng(0)
    u, g, beta, conv_w = inputs(rng, 2, nk, dk, nv, dv, 4)
    conv, rec = buffers(rng, 5, nk, dk, nv, dv, 4)
    conv0, rec0 = conv.copy(), rec.copy()
    for slot in (5, -1, 100):
        with pytest.raises(IndexError, match="out of range"):
            gdn.gdn_prefill(conv, rec, slot, u, g, beta, conv_w, nk, dk, nv, dv)
    for slots in ([0, 5], [-1, 2], [4, 7]):
        with pytest.raises(IndexError, match="out of range"):
            gdn.gdn_decode(conv, rec, np.array(slots, np.int64), u, g, beta, conv_w, nk, dk, nv, dv)
    with pytest.raises(ValueError, match="distinct"):
        gdn.gdn_decode(conv, rec, np.array([2, 2], np.int64), u, g, beta, conv_w, nk, dk, nv, dv)
    with pytest.raises(ValueError, match="shape"):
        gdn.gdn_decode(conv, rec, np.array([0], np.int64), u, g, beta, conv_w, nk, dk, nv, dv)
    assert np.array_equal(conv, conv0) and np.array_equal(rec, rec0)
    # Padding rows may repeat the sink.
    gdn.gdn_decode(conv, rec, np.array([4, 4], np.int64), u, g, beta, conv_w, nk, dk, nv, dv)
    assert np.array_equal(conv[:4], conv0[:4]) and np.array_equal(rec[:4], rec0[:4])
