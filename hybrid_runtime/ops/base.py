"""The interface of the stateful operators the runner calls between stateless engine segments.

One object owns every cache of one device (DESIGN.md invariant 1: only the engine thread calls it) and
implements the two stateful mixers plus the slot reset the scheduler calls on admission:

* :class:`~hybrid_runtime.ops.cpu.CpuOps`: numpy kernels over host buffers (the CI path).
* :class:`~hybrid_runtime.cuda.operators.CudaOps`: the CUDA kernels over device buffers on one GPU.

Activations cross the interface as host float32 numpy arrays (what the engine segments produce and
consume), so the runner is the same for every backend. Shapes, with ``T`` the tokens of the batch:

* ``gdn(layer, phase, steps, bounds, u [T, C], g [T, nv], beta [T, nv]) -> core [T, nv*dv]``
* ``attention(layer, phase, steps, bounds, positions [T], pages [T], offsets [T], q [T, H*hd],
  k [T, Hkv*hd], v [T, Hkv*hd]) -> [T, H*hd]``

``bounds`` ``[len(steps)+1]`` int64: step ``i`` owns tokens ``bounds[i]:bounds[i+1]``. ``pages`` /
``offsets``: where each token's K/V goes in the paged pool (already bounds-checked by the runner).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..config import ConfigError, ModelConfig
from ..engine.base import Phase
from ..kv_cache import KVLayout
from ..state_cache import StateLayout
from .dispatcher import DecodeAttentionDispatcher

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


@dataclass(slots=True)
class SeqStep:
    """One sequence's part of a batch: ``token_ids`` go to positions ``start_pos..``; its state lives in
    ``slot`` and its KV in ``page_table`` (which already covers ``start_pos + len(token_ids)`` tokens): a list,
    or (from the scheduler) the allocator's read-only int64 view, which backends read without converting."""

    slot: int
    page_table: list[int] | np.ndarray
    start_pos: int
    token_ids: list[int]
    need_logits: bool = True


def parse_device(device: str) -> tuple[str, int]:
    """``"cpu"`` -> ``("cpu", 0)``, ``"cuda"`` -> ``("cuda", 0)``, ``"cuda:N"`` -> ``("cuda", N)``;
    ConfigError for anything else (``"cpu:1"`` included)."""
    m = _DEVICE_RE.match(str(device))
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise ConfigError(f"device={device!r}: choose 'cpu', 'cuda' or 'cuda:N'")
    return m.group(1), int(m.group(2) or 0)


@runtime_checkable
class StatefulOps(Protocol):
    """What the runner needs from a backend of the stateful mixers (see the module docstring)."""

    device: str  # "cpu" | "cuda:N"
    dispatcher: DecodeAttentionDispatcher  # the guarded decode-attention dispatcher of this device
    state_layout: StateLayout
    kv_layout: KVLayout

    def reset_slot(self, slot: int) -> None:
        """Zero the conv and recurrent state of ``slot`` in every linear-attention layer."""
        ...

    def gdn(self, layer: int, phase: Phase, steps: list[SeqStep], bounds: np.ndarray, u: np.ndarray,
            g: np.ndarray, beta: np.ndarray) -> np.ndarray:
        """Gated DeltaNet mixer of ``layer``: updates the steps' slots, returns core ``[T, nv*dv]`` float32."""
        ...

    def attention(self, layer: int, phase: Phase, steps: list[SeqStep], bounds: np.ndarray, positions: np.ndarray,
                  pages: np.ndarray, offsets: np.ndarray, q: np.ndarray, k: np.ndarray,
                  v: np.ndarray) -> np.ndarray:
        """Writes the new K/V of ``layer`` to the pool, returns causal attention ``[T, H*hd]`` float32."""
        ...

    def state_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of ``layer``'s conv ``[rows, K-1, C]`` and recurrent ``[rows, nv, dk, dv]`` buffers."""
        ...

    def kv_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of ``layer``'s K and V pools ``[num_pages, page_size, Hkv, hd]``."""
        ...


def make_ops(device: str, cfg: ModelConfig, conv_w: Mapping[int, np.ndarray], num_slots: int,
             kv_layout: KVLayout, multi_block_mode: str = "auto") -> StatefulOps:
    """The operators of ``device`` ("cpu" | "cuda" | "cuda:N"). ``conv_w[layer]``: ``[C, K]`` float32.

    A CUDA device that cannot be opened (no driver, no GPU, bad ordinal) is a ConfigError naming it.
    """
    kind, ordinal = parse_device(device)
    if kind == "cpu":
        from .cpu import CpuOps

        return CpuOps(cfg, conv_w, num_slots, kv_layout, multi_block_mode)
    from ..cuda.driver import CudaError
    from ..cuda.operators import CudaOps

    try:
        return CudaOps(cfg, conv_w, num_slots, kv_layout, multi_block_mode, ordinal=ordinal)
    except CudaError as e:
        raise ConfigError(f"device={device!r}: the CUDA operators cannot start: {e}") from e
