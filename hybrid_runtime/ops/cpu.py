"""The CPU backend of the stateful mixers: host state and KV buffers, and both mixers through onnxruntime:
the GDN conv + delta rule (:mod:`.gdn_ort`; :mod:`.gdn` is its numpy oracle) and paged attention
(:mod:`.attention_ort`, behind the guarded dispatcher for decode; :mod:`.attention` is its numpy oracle).
Every operator computes a token's result with the same bits whatever else is in the batch."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..config import ModelConfig
from ..engine.base import Phase
from ..kv_cache import KVCache, KVLayout
from ..state_cache import StateCache
from .attention_ort import OrtAttention
from .base import SeqStep
from .dispatcher import DecodeAttentionDispatcher
from .gdn_ort import OrtGdn


class CpuOps:
    """Owns a :class:`StateCache` (``state``) and a :class:`KVCache` (``kv``) on the host."""

    device = "cpu"

    def __init__(self, cfg: ModelConfig, conv_w: Mapping[int, np.ndarray], num_slots: int, kv_layout: KVLayout,
                 multi_block_mode: str = "auto") -> None:
        self.cfg = cfg
        self.conv_w = dict(conv_w)  # layer -> [C, K] float32
        self.state = StateCache(cfg, num_slots)
        self.state_layout = self.state.layout
        self.kv_layout = kv_layout
        self.kv = KVCache(kv_layout, cfg.attention_layers)
        self._attn = OrtAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) if cfg.attention_layers else None
        self.dispatcher = DecodeAttentionDispatcher(  # type: ignore[arg-type]
            mode=multi_block_mode, **({"kernels": self._attn.kernels()} if self._attn else {}))
        self._gdn = OrtGdn(cfg)

    def reset_slot(self, slot: int) -> None:
        self.state.reset(slot)

    def gdn(self, layer: int, phase: Phase, steps: list[SeqStep], bounds: np.ndarray, u: np.ndarray,
            g: np.ndarray, beta: np.ndarray) -> np.ndarray:
        """u ``[T, C]``, g/beta ``[T, nv]`` -> core ``[T, nv*dv]``: one onnxruntime run for the whole batch
        (:class:`.gdn_ort.OrtGdn`), DECODE and PREFILL alike."""
        conv, rec, w = self.state.conv[layer], self.state.recurrent[layer], self.conv_w[layer]
        slots = np.fromiter((s.slot for s in steps), np.int64, count=len(steps))
        if phase == Phase.DECODE:
            return self._gdn.decode(conv, rec, slots, u, g, beta, w)
        return self._gdn.prefill(conv, rec, slots, bounds, u, g, beta, w)

    def attention(self, layer: int, phase: Phase, steps: list[SeqStep], bounds: np.ndarray, positions: np.ndarray,
                  pages: np.ndarray, offsets: np.ndarray, q: np.ndarray, k: np.ndarray,
                  v: np.ndarray) -> np.ndarray:
        """q ``[T, H*hd]``, k/v ``[T, Hkv*hd]`` -> ``[T, H*hd]``: K/V written first, then DECODE through the
        dispatcher (whose kernels are :class:`.attention_ort.OrtAttention`'s), PREFILL as causal attention of
        every chunk of the step in one run."""
        cfg = self.cfg
        T, H, Hkv, hd = len(positions), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        k_buf, v_buf = self.kv.buffers(layer)
        k_buf[pages, offsets] = k.reshape(T, Hkv, hd)
        v_buf[pages, offsets] = v.reshape(T, Hkv, hd)
        q3 = q.reshape(T, H, hd)
        tables = [np.asarray(s.page_table, np.int64) for s in steps]
        if phase == Phase.DECODE:
            lens = np.fromiter((s.start_pos + 1 for s in steps), np.int64, count=len(steps))
            return self.dispatcher.run(q3, k_buf, v_buf, tables, lens).reshape(T, H * hd)
        assert self._attn is not None
        starts = np.fromiter((s.start_pos for s in steps), np.int64, count=len(steps))
        return self._attn.prefill(q3, k_buf, v_buf, tables, starts, np.asarray(bounds, np.int64)).reshape(T, H * hd)

    def state_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.state.conv[layer].copy(), self.state.recurrent[layer].copy()

    def kv_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        k, v = self.kv.buffers(layer)
        return k.copy(), v.copy()
