"""The CUDA backend of the stateful mixers, behind :class:`~hybrid_runtime.ops.base.StatefulOps`.

:class:`CudaOps` owns, on one :class:`~hybrid_runtime.cuda.driver.CudaDevice`, the recurrent state
(:class:`~hybrid_runtime.cuda.state.DeviceStateCache`), the paged KV pools
(:class:`~hybrid_runtime.cuda.state.DeviceKVCache`), the GDN kernels (:class:`~hybrid_runtime.cuda.gdn.CudaGdn`,
float32 activations) and the decode-attention kernels behind the guarded dispatcher
(:class:`~hybrid_runtime.cuda.attention.CudaDecodeAttention`). Every buffer stays on the device across
steps; per call the segment outputs (host float32 arrays from the engine) are uploaded in one copy, the
kernels run on the device's stream, and the result is downloaded (which synchronises the stream).

Prefill attention has no dedicated kernel: causal prefill of a chunk of ``T`` tokens is ``T``
single-token queries, query ``i`` of a sequence attending over its first ``start_pos + i + 1`` positions
through the sequence's page table, so the whole prefill batch is one launch of the guarded decode
kernels (the dispatcher plans and validates it like any decode step; its ``plans`` counter includes it).

MoE FFNs are not here: they stay numpy on the host in the runner for now.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..config import ModelConfig
from ..engine.base import Phase
from ..kv_cache import KVLayout
from ..ops.base import SeqStep
from ..state_cache import StateLayout
from .attention import CudaDecodeAttention
from .driver import CudaDevice, CudaError, DeviceArray
from .gdn import CudaGdn
from .state import DeviceKVCache, DeviceStateCache

ALIGN = 256  # byte alignment of each array packed into one upload (the kernels use up to 16-byte loads)


class CudaOps:
    """The stateful operators of one GPU (``ordinal``, or an existing ``device``)."""

    def __init__(self, cfg: ModelConfig, conv_w: Mapping[int, np.ndarray], num_slots: int, kv_layout: KVLayout,
                 multi_block_mode: str = "auto", ordinal: int = 0, device: CudaDevice | None = None) -> None:
        if kv_layout.dtype != np.float32:
            raise ValueError(f"the CUDA operators keep a float32 KV pool, layout says {kv_layout.dtype}")
        self.cfg = cfg
        self.cuda = device if device is not None else CudaDevice(ordinal)
        self.device = f"cuda:{self.cuda.ordinal}"
        self.state_layout = StateLayout.for_model(cfg, num_slots)
        self.kv_layout = kv_layout
        self.state = DeviceStateCache(self.cuda, self.state_layout, cfg.linear_layers)
        self.kv = DeviceKVCache(self.cuda, kv_layout, cfg.attention_layers)
        self.conv_w = {i: self.cuda.upload(np.ascontiguousarray(conv_w[i], np.float32)) for i in cfg.linear_layers}
        self._gdn = (CudaGdn(self.cuda, self.state_layout, cfg.linear_num_key_heads, act_dtype="float32")
                     if cfg.linear_layers else None)
        group = cfg.num_heads // max(1, cfg.num_kv_heads)
        prepare = [("float32", cfg.head_dim, group)] if cfg.attention_layers else []
        self.attn = CudaDecodeAttention(self.cuda, optin=True, prepare=prepare)
        self.dispatcher = self.attn.dispatcher(multi_block_mode)  # type: ignore[arg-type]

    def device_health(self) -> CudaError | None:
        """None while the device works; the sticky error that poisoned its context otherwise."""
        return self.cuda.health()

    # ------------------------------------------------------------------ transfers

    def _upload(self, *arrays: np.ndarray) -> list[DeviceArray]:
        """Host arrays (as float32) -> device arrays of the same shapes, views into one stream-ordered
        allocation filled by one copy (each part starts on an ``ALIGN``-byte boundary)."""
        hs = [np.ascontiguousarray(a, np.float32) for a in arrays]
        starts, total = [], 0
        for h in hs:
            starts.append(total)
            total += -(-h.nbytes // ALIGN) * ALIGN
        staging = np.empty(max(total, ALIGN) // 4, np.float32)
        for h, at in zip(hs, starts):
            staging[at // 4:at // 4 + h.size] = h.reshape(-1)
        buf = self.cuda.upload(staging, stream_ordered=True)  # freed in stream order once unreferenced
        return [DeviceArray(buf.ptr + at, h.shape, "float32", self.cuda.ordinal, owner=buf)
                for h, at in zip(hs, starts)]

    # ------------------------------------------------------------------ StatefulOps

    def reset_slot(self, slot: int) -> None:
        """Zero ``slot``'s conv and recurrent rows in every layer (``cuMemsetD32Async`` at layout offsets)."""
        self.state.reset(slot)

    def gdn(self, layer: int, phase: Phase, steps: list[SeqStep], bounds: np.ndarray, u: np.ndarray,
            g: np.ndarray, beta: np.ndarray) -> np.ndarray:
        """u ``[T, C]``, g/beta ``[T, nv]`` (host) -> core ``[T, nv*dv]`` host float32. DECODE: one token per
        step; PREFILL: every step's chunk packed into one launch sequence (slots must be distinct)."""
        assert self._gdn is not None
        u_d, g_d, b_d = self._upload(u, g, beta)
        conv, rec, w = self.state.conv[layer], self.state.recurrent[layer], self.conv_w[layer]
        slots = np.fromiter((s.slot for s in steps), np.int64, count=len(steps))
        if phase == Phase.DECODE:
            o = self._gdn.decode(conv, rec, slots, u_d, g_d, b_d, w)
        else:
            o = self._gdn.prefill(conv, rec, slots, np.diff(bounds), u_d, g_d, b_d, w)
        return self.cuda.download(o)

    def attention(self, layer: int, phase: Phase, steps: list[SeqStep], bounds: np.ndarray, positions: np.ndarray,
                  pages: np.ndarray, offsets: np.ndarray, q: np.ndarray, k: np.ndarray,
                  v: np.ndarray) -> np.ndarray:
        """q ``[T, H*hd]``, k/v ``[T, Hkv*hd]`` (host) -> ``[T, H*hd]`` host float32. The new K/V are written
        to the pool first (one kernel for the whole batch), then every token is one dispatcher query."""
        cfg = self.cfg
        T, H, Hkv, hd = len(positions), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_d, k_d, v_d = self._upload(q.reshape(T, H, hd), k.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd))
        rows = np.asarray(pages, np.int64) * self.kv_layout.page_size + np.asarray(offsets, np.int64)
        self.kv.write_rows(layer, rows, k_d, v_d)
        tables: list[np.ndarray] = []
        lens: list[int] = []
        for i, s in enumerate(steps):
            table = np.asarray(s.page_table, np.int64)
            n = int(bounds[i + 1]) - int(bounds[i])
            if phase == Phase.DECODE and n != 1:
                raise ValueError("a DECODE step carries exactly one token")
            tables += [table] * n
            lens += range(s.start_pos + 1, s.start_pos + n + 1)  # query i sees positions 0 .. start_pos + i
        k_buf, v_buf = self.kv.buffers(layer)
        out = self.dispatcher.run(q_d, k_buf, v_buf, tables, lens)  # type: ignore[arg-type]
        return self.cuda.download(out).reshape(T, H * hd)

    def state_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.state.download_layer(layer)

    def kv_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        k, v = self.kv.buffers(layer)
        return self.cuda.download(k), self.cuda.download(v)

    def synchronize(self) -> None:
        """Wait for everything queued on the device's stream (timing, tests)."""
        self.cuda.synchronize()
