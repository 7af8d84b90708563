"""Sparse MoE FFN on CPU: only the routed experts run, so cost grows with top-k, not with E."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..config import ModelConfig


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class MoE:
    """One MoE layer's weights (views of the bundle's memory-mapped state weights)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray], layer: int) -> None:
        p = f"layers.{layer}.mlp."
        self.top_k = cfg.num_experts_per_tok
        self.renorm = cfg.norm_topk_prob
        self.router_t = np.ascontiguousarray(weights[p + "gate"].T)  # [H, E]
        self.gate, self.up, self.down = (weights[p + "experts.gate_proj"], weights[p + "experts.up_proj"],
                                         weights[p + "experts.down_proj"])  # [E, I, H], [E, I, H], [E, H, I]
        self.shared = cfg.shared_expert_intermediate_size > 0
        if self.shared:
            s = p + "shared_expert."
            # One fused matmul for gate|up|shared_expert_gate (the gate's weight is one row).
            self.shared_in_t = np.ascontiguousarray(np.concatenate(
                [weights[s + "gate_proj"], weights[s + "up_proj"], weights[p + "shared_expert_gate"]]).T)
            self.shared_down_t = np.ascontiguousarray(weights[s + "down_proj"].T)
            self.si = weights[s + "gate_proj"].shape[0]

    def route(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-k expert ids ``[T, k]`` (descending probability) and their weights ``[T, k]``."""
        logits = h @ self.router_t
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        k = self.top_k
        top = np.argpartition(-probs, k - 1, axis=-1)[:, :k] if k < probs.shape[1] else np.tile(
            np.arange(probs.shape[1]), (probs.shape[0], 1))
        wts = np.take_along_axis(probs, top, axis=-1)
        order = np.argsort(-wts, axis=-1, kind="stable")
        top, wts = np.take_along_axis(top, order, -1), np.take_along_axis(wts, order, -1)
        if self.renorm:
            wts = wts / wts.sum(-1, keepdims=True)
        return top, wts.astype(np.float32)

    def __call__(self, h: np.ndarray) -> np.ndarray:
        """``h [T, H]`` (post-attention-normed) -> FFN output ``[T, H]``."""
        top, wts = self.route(h)
        out = np.zeros_like(h)
        flat_e = top.reshape(-1)
        order = np.argsort(flat_e, kind="stable")
        experts, starts = np.unique(flat_e[order], return_index=True)
        bounds = [*starts[1:], len(order)]
        for e, a, b in zip(experts, starts, bounds):
            idx = order[a:b]  # positions in the flattened [T*k] routing table
            tok = idx // self.top_k
            x = h[tok]
            y = (_silu(x @ self.gate[e].T) * (x @ self.up[e].T)) @ self.down[e].T
            out[tok] += y * wts.reshape(-1)[idx, None]  # a token routes to an expert at most once
        if self.shared:
            z = h @ self.shared_in_t
            si = self.si
            y = (_silu(z[:, :si]) * z[:, si:2 * si]) @ self.shared_down_t
            out += y / (1.0 + np.exp(-z[:, 2 * si:]))
        return out
