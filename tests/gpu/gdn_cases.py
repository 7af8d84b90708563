"""Shared by the GDN GPU tests and the sanitizer workload: a GPU layer and its numpy twin, kept in step.

Inputs are drawn in float32, rounded to the activation dtype on the host, and the same rounded values
feed the GPU kernels and the numpy reference (hybrid_runtime/ops/gdn.py), so the two differ only by
float32 arithmetic order (and the final rounding of o to the activation dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybrid_runtime.cuda.driver import CudaDevice, DeviceArray
from hybrid_runtime.cuda.gdn import CudaGdn
from hybrid_runtime.cuda.state import DeviceStateCache
from hybrid_runtime.ops import gdn as ref
from hybrid_runtime.state_cache import StateLayout


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even)."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_act(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(device payload, the float32 values it represents)."""
    x = np.asarray(x, np.float32)
    if dtype == "bfloat16":
        bits = bf16_bits(x)
        return bits, bits_to_f32(bits)
    if dtype == "float16":
        h = x.astype(np.float16)
        return h, h.astype(np.float32)
    return x, x


@dataclass
class Shape:
    nk: int = 2
    nv: int = 4
    dk: int = 32
    dv: int = 32
    K: int = 4

    @property
    def C(self) -> int:
        return 2 * self.nk * self.dk + self.nv * self.dv


class Twin:
    """One GDN layer on the GPU and the same layer in numpy, with identical (random) initial state."""

    def __init__(self, dev: CudaDevice, shape: Shape, num_slots: int, act: str, seed: int,
                 random_state: bool = True) -> None:
        self.dev, self.s, self.act = dev, shape, act
        self.rng = np.random.default_rng(seed)
        self.layout = StateLayout(num_slots, (shape.K - 1, shape.C), (shape.nv, shape.dk, shape.dv))
        self.cache = DeviceStateCache(dev, self.layout, layers=[0])
        self.gdn = CudaGdn(dev, self.layout, shape.nk, act)
        self.conv_np, self.rec_np = self.layout.allocate()
        if random_state:
            self.conv_np[:] = self.rng.standard_normal(self.conv_np.shape, np.float32)
            self.rec_np[:] = 0.1 * self.rng.standard_normal(self.rec_np.shape, np.float32)
            self.cache.upload_layer(0, self.conv_np, self.rec_np)
        self.w_np = (0.5 * self.rng.standard_normal((shape.C, shape.K))).astype(np.float32)
        self.w_dev = dev.upload(self.w_np)

    @property
    def sink(self) -> int:
        return self.layout.sink

    def inputs(self, n: int) -> tuple[tuple[DeviceArray, DeviceArray, DeviceArray], tuple[np.ndarray, ...]]:
        s = self.s
        u_payload, u = round_act(self.rng.standard_normal((n, s.C), np.float32), self.act)
        g = (-np.abs(self.rng.standard_normal((n, s.nv))) * 0.5).astype(np.float32)
        beta = (1 / (1 + np.exp(-self.rng.standard_normal((n, s.nv))))).astype(np.float32)
        d = self.dev
        dev_in = (d.upload(u_payload, dtype=self.act, stream_ordered=True), d.upload(g, stream_ordered=True),
                  d.upload(beta, stream_ordered=True))
        return dev_in, (u, g, beta)

    def reset(self, slot: int) -> None:
        self.cache.reset(slot)
        (c_off, c_len), (r_off, r_len) = self.layout.offsets(slot)
        self.conv_np.reshape(-1).view(np.uint8)[c_off:c_off + c_len] = 0
        self.rec_np.reshape(-1).view(np.uint8)[r_off:r_off + r_len] = 0

    def decode(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One decode step on both sides; returns (gpu o as float32, numpy o)."""
        s = self.s
        (u_d, g_d, b_d), (u, g, beta) = self.inputs(len(slots))
        o_d = self.gdn.decode(self.cache.conv[0], self.cache.recurrent[0], slots, u_d, g_d, b_d, self.w_dev)
        o_ref = ref.gdn_decode(self.conv_np, self.rec_np, np.asarray(slots, np.int64), u, g, beta, self.w_np,
                               s.nk, s.dk, s.nv, s.dv)
        return self.dev.download(o_d), o_ref

    def prefill(self, slots: list[int], lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        s = self.s
        N = int(sum(lens))
        (u_d, g_d, b_d), (u, g, beta) = self.inputs(N)
        o_d = self.gdn.prefill(self.cache.conv[0], self.cache.recurrent[0], slots, lens, u_d, g_d, b_d, self.w_dev)
        outs, at = [], 0
        for slot, n in zip(slots, lens):
            outs.append(ref.gdn_prefill(self.conv_np, self.rec_np, slot, u[at:at + n], g[at:at + n],
                                        beta[at:at + n], self.w_np, s.nk, s.dk, s.nv, s.dv))
            at += n
        return self.dev.download(o_d), np.concatenate(outs)

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        return self.cache.download_layer(0)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30))
