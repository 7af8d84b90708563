"""Recurrent-state slots (invariant 5, DESIGN.md).

* :class:`SlotAllocator` — plain Python over integers. Slots ``0..num_slots-1`` go to requests; row
  ``num_slots`` is the padding sink and is never handed out.
* :class:`StateLayout` — the one description of a layer's conv-window and recurrent-state buffers
  (dtype, per-slot shape, row stride, total bytes). Buffers are allocated from it, and per-slot reset
  offsets are computed from the same object, so allocation and reset cannot disagree.
* :class:`StateCache` — per linear-attention layer, a conv buffer ``[rows, K-1, C]`` and a recurrent
  buffer ``[rows, nv, dk, dv]`` (float32), with ``rows = num_slots + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .host_memory import resident_zeros


class NoFreeSlot(RuntimeError):
    """All state slots are taken (callers wait; requests are never dropped for this)."""


class SlotAllocator:
    """Hands out slot indices ``0..num_slots-1``, lowest first; the sink row is never given out."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() yields the lowest index
        self._owner: dict[int, str] = {}

    @property
    def sink(self) -> int:
        return self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def allocate(self, owner: str) -> int:
        if not self._free:
            raise NoFreeSlot(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        self._owner[slot] = owner
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._owner:
            raise KeyError(f"slot {slot} is not allocated (double free or never allocated)")
        del self._owner[slot]
        self._free.append(slot)
        self._free.sort(reverse=True)

    def owner(self, slot: int) -> str | None:
        return self._owner.get(slot)


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Shapes and byte geometry of one linear-attention layer's state buffers."""

    num_slots: int
    conv_shape: tuple[int, int]  # (K-1, C), time-major window of pre-conv inputs
    recurrent_shape: tuple[int, int, int]  # (nv, dk, dv)
    dtype: str = "float32"

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_slots: int) -> StateLayout:
        return cls(num_slots, (cfg.conv_kernel - 1, cfg.conv_dim),
                   (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))

    @property
    def rows(self) -> int:
        return self.num_slots + 1

    @property
    def sink(self) -> int:
        return self.num_slots

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def conv_row_bytes(self) -> int:
        return int(np.prod(self.conv_shape)) * self.itemsize

    @property
    def recurrent_row_bytes(self) -> int:
        return int(np.prod(self.recurrent_shape)) * self.itemsize

    @property
    def total_bytes(self) -> int:
        """Bytes of one layer's two buffers."""
        return self.rows * (self.conv_row_bytes + self.recurrent_row_bytes)

    def check_slot(self, slot: int) -> int:
        if not 0 <= slot < self.rows:
            raise IndexError(f"state slot {slot} out of range 0..{self.rows - 1}")
        return int(slot)

    def offsets(self, slot: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Byte ``(offset, length)`` of ``slot``'s conv row and recurrent row (bounds-checked)."""
        s = self.check_slot(slot)
        return (s * self.conv_row_bytes, self.conv_row_bytes), (s * self.recurrent_row_bytes, self.recurrent_row_bytes)

    def allocate(self) -> tuple[np.ndarray, np.ndarray]:
        """Zeroed conv and recurrent buffers of one layer, the request slots' rows resident from the start
        (host_memory); the sink row is mapped only if something writes it (the host operators never do:
        they run the batch's own rows, no padding)."""
        return (resident_zeros((self.rows, *self.conv_shape), self.dtype, self.num_slots),
                resident_zeros((self.rows, *self.recurrent_shape), self.dtype, self.num_slots))


class StateCache:
    """Conv and recurrent buffers of every linear-attention layer, allocated once from one layout."""

    def __init__(self, cfg: ModelConfig, num_slots: int) -> None:
        self.layout = StateLayout.for_model(cfg, num_slots)
        self.conv: dict[int, np.ndarray] = {}
        self.recurrent: dict[int, np.ndarray] = {}
        for layer in cfg.linear_layers:
            self.conv[layer], self.recurrent[layer] = self.layout.allocate()

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes * len(self.conv)

    def reset(self, slot: int) -> None:
        """Zero both buffers of ``slot`` in every layer (on admission, before the first prefill)."""
        (c_off, c_len), (r_off, r_len) = self.layout.offsets(slot)
        for layer in self.conv:
            # Byte views over the same buffers: offsets come from the layout that allocated them.
            self.conv[layer].reshape(-1).view(np.uint8)[c_off:c_off + c_len] = 0
            self.recurrent[layer].reshape(-1).view(np.uint8)[r_off:r_off + r_len] = 0
