"""Plain numpy reference forward pass: float32, full recompute, no caches, one token at a time in the
recurrences. It is the oracle every other code path is tested against, so it favours being obviously
the math of MODEL_MATH.md over being fast.
"""

from __future__ import annotations

import numpy as np

from .config import DENSE, LINEAR, ModelConfig

Weights = dict[str, np.ndarray]


def rmsnorm1p(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + w)`` over the last axis."""
    x = x.astype(np.float32)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def rope_tables(positions: np.ndarray, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[T, rotary_dim]`` for the rotate-half convention."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x ``[T, heads, hd]``; rotates the first ``cos.shape[-1]`` dims of each head."""
    rd = cos.shape[-1]
    if rd == 0:
        return x
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot = np.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = xr * cos[:, None, :] + rot * sin[:, None, :]
    return np.concatenate([out, xp], axis=-1)


def swiglu(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(h @ gate.T) * (h @ up.T)) @ down.T


def gated_deltanet(cfg: ModelConfig, w: Weights, i: int, h: np.ndarray) -> np.ndarray:
    """Gated DeltaNet mixer over a whole sequence ``h [T, hidden]`` -> ``[T, hidden]``."""
    p = f"layers.{i}.linear_attn."
    T = h.shape[0]
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    K, r = cfg.conv_kernel, nv // nk
    u = h @ w[p + "in_proj_qkv"].T  # [T, C]
    z = (h @ w[p + "in_proj_z"].T).reshape(T, nv, dv)
    b = h @ w[p + "in_proj_b"].T
    a = h @ w[p + "in_proj_a"].T
    upad = np.concatenate([np.zeros((K - 1, u.shape[1]), np.float32), u], axis=0)
    conv = np.stack([np.sum(upad[t:t + K].T * w[p + "conv1d"], axis=1) for t in range(T)])
    conv = silu(conv)
    q = conv[:, :cfg.key_dim].reshape(T, nk, dk)
    k = conv[:, cfg.key_dim:2 * cfg.key_dim].reshape(T, nk, dk)
    v = conv[:, 2 * cfg.key_dim:].reshape(T, nv, dv)
    q = l2norm(q) / np.sqrt(dk)
    k = l2norm(k)
    q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)  # value head j uses key head j // r
    beta = sigmoid(b)
    g = -np.exp(w[p + "A_log"]) * softplus(a + w[p + "dt_bias"])
    S = np.zeros((nv, dk, dv), np.float32)
    out = np.empty((T, nv, dv), np.float32)
    for t in range(T):
        S = S * np.exp(g[t])[:, None, None]
        pred = np.einsum("hkv,hk->hv", S, k[t])
        S = S + k[t][:, :, None] * (beta[t][:, None] * (v[t] - pred))[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    o = out / np.sqrt(np.mean(out * out, axis=-1, keepdims=True) + cfg.rms_norm_eps) * w[p + "norm"]
    o = o * silu(z)
    return o.reshape(T, -1) @ w[p + "out_proj"].T


def gated_attention(cfg: ModelConfig, w: Weights, i: int, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Gated causal softmax attention over a whole sequence ``h [T, hidden]`` -> ``[T, hidden]``."""
    p = f"layers.{i}.self_attn."
    T, H, Hkv, hd = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def proj(name: str) -> np.ndarray:
        y = h @ w[p + name].T
        return y + w[p + name + "_bias"] if cfg.attention_bias else y

    qg = proj("q_proj").reshape(T, H, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, H * hd)
    k = proj("k_proj").reshape(T, Hkv, hd)
    v = proj("v_proj").reshape(T, Hkv, hd)
    q = rmsnorm1p(q, w[p + "q_norm"], cfg.rms_norm_eps)
    k = rmsnorm1p(k, w[p + "k_norm"], cfg.rms_norm_eps)
    cos, sin = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = H // Hkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((T, T), bool))[None], scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    pr = np.exp(scores)
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", pr, v).reshape(T, H * hd) * sigmoid(gate)
    out = o @ w[p + "o_proj"].T
    return out + w[p + "o_proj_bias"] if cfg.attention_bias else out


def moe(cfg: ModelConfig, w: Weights, i: int, h: np.ndarray) -> np.ndarray:
    """Top-k routed experts plus the sigmoid-gated shared expert, ``[T, hidden]`` -> ``[T, hidden]``."""
    p = f"layers.{i}.mlp."
    logits = h @ w[p + "gate"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[:cfg.num_experts_per_tok]
        wt = probs[t, top]
        if cfg.norm_topk_prob:
            wt = wt / wt.sum()
        for e, we in zip(top, wt):
            out[t] += we * swiglu(h[t:t + 1], w[p + "experts.gate_proj"][e], w[p + "experts.up_proj"][e],
                                  w[p + "experts.down_proj"][e])[0]
    if cfg.shared_expert_intermediate_size:
        s = p + "shared_expert."
        shared = swiglu(h, w[s + "gate_proj"], w[s + "up_proj"], w[s + "down_proj"])
        out += sigmoid(h @ w[p + "shared_expert_gate"].T) * shared
    return out


def forward(cfg: ModelConfig, w: Weights, ids: np.ndarray) -> np.ndarray:
    """Logits ``[T, vocab]`` (float32) for one sequence of token ids ``[T]``, positions 0..T-1."""
    ids = np.asarray(ids, dtype=np.int64)
    positions = np.arange(len(ids))
    x = w["embed_tokens"][ids].astype(np.float32)
    for i in range(cfg.num_layers):
        h = rmsnorm1p(x, w[f"layers.{i}.input_layernorm"], cfg.rms_norm_eps)
        if cfg.layer_types[i] == LINEAR:
            x = x + gated_deltanet(cfg, w, i, h)
        else:
            x = x + gated_attention(cfg, w, i, h, positions)
        h = rmsnorm1p(x, w[f"layers.{i}.post_attention_layernorm"], cfg.rms_norm_eps)
        if cfg.ffn_types[i] == DENSE:
            p = f"layers.{i}.mlp."
            x = x + swiglu(h, w[p + "gate_proj"], w[p + "up_proj"], w[p + "down_proj"])
        else:
            x = x + moe(cfg, w, i, h)
    x = rmsnorm1p(x, w["norm"], cfg.rms_norm_eps)
    return x @ w["lm_head"].T


def greedy_generate(cfg: ModelConfig, w: Weights, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by full recompute (slow; tests only)."""
    seq = list(ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(np.argmax(forward(cfg, w, np.array(seq))[-1]))
        out.append(tok)
        seq.append(tok)
    return out
