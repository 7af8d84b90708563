"""Device buffers for recurrent state and the paged KV pool (DESIGN.md invariant 5).

* :class:`DeviceStateCache`: per linear-attention layer, a conv-window buffer ``[rows, K-1, C]`` and a
  recurrent buffer ``[rows, nv, dk, dv]`` (float32), ``rows = num_slots + 1`` with the sink last. Both are
  allocated once from :class:`~hybrid_runtime.state_cache.StateLayout` and a slot is reset with
  ``cuMemsetD32Async`` at the byte offsets that same layout gives (bounds-checked before the call).
* :class:`DeviceKVCache`: per full-attention layer, K and V pools ``[num_pages, page_size, Hkv, hd]``
  allocated once from :class:`~hybrid_runtime.kv_cache.KVLayout`; :meth:`DeviceKVCache.write` stores
  new tokens through the page table (host-checked) with the ``kv_write`` kernel.

Everything runs on the owning :class:`~hybrid_runtime.cuda.driver.CudaDevice`'s stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ..kv_cache import KVLayout
from ..state_cache import StateLayout
from .driver import CudaDevice, DeviceArray, dtype_of
from .kernels import load_module


class DeviceStateCache:
    """Conv and recurrent state of every linear-attention layer on one device, from one layout."""

    def __init__(self, device: CudaDevice, layout: StateLayout, layers: Iterable[int]) -> None:
        if layout.dtype != "float32":
            raise ValueError(f"GPU state is float32, layout says {layout.dtype}")
        self.device = device
        self.layout = layout
        self.conv: dict[int, DeviceArray] = {}
        self.recurrent: dict[int, DeviceArray] = {}
        for layer in layers:
            # Sizes from the layout's byte geometry; zeroed once, so the sink starts clean too.
            self.conv[layer] = device.zeros((layout.rows, *layout.conv_shape), layout.dtype)
            self.recurrent[layer] = device.zeros((layout.rows, *layout.recurrent_shape), layout.dtype)
            assert self.conv[layer].nbytes == layout.rows * layout.conv_row_bytes
            assert self.recurrent[layer].nbytes == layout.rows * layout.recurrent_row_bytes

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes * len(self.conv)

    def reset(self, slot: int) -> None:
        """Zero both buffers of ``slot`` in every layer (on admission, before the first prefill)."""
        (c_off, c_len), (r_off, r_len) = self.layout.offsets(slot)  # raises IndexError out of range
        for layer in self.conv:
            for buf, off, n in ((self.conv[layer], c_off, c_len), (self.recurrent[layer], r_off, r_len)):
                if off < 0 or off + n > buf.nbytes or off % 4 or n % 4:
                    raise IndexError(f"reset of slot {slot}: bytes {off}..{off + n} outside a {buf.nbytes}-byte "
                                     f"buffer or not word aligned")
                if n:
                    self.device.memset_d32(buf.ptr + off, 0, n // 4)

    def upload_layer(self, layer: int, conv: np.ndarray, recurrent: np.ndarray) -> None:
        """Overwrite a layer's buffers from host arrays of the layout's full shapes (tests, checkpoints)."""
        self.device.upload(np.asarray(conv, np.float32), out=self.conv[layer])
        self.device.upload(np.asarray(recurrent, np.float32), out=self.recurrent[layer])

    def download_layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.device.download(self.conv[layer]), self.device.download(self.recurrent[layer])


class DeviceKVCache:
    """K/V page pools of every full-attention layer on one device, from one :class:`KVLayout`.

    ``dtype`` overrides the layout's numpy dtype by name (``"bfloat16"`` has no numpy dtype); the
    geometry (pages, page size, heads, head_dim) always comes from the layout.
    """

    def __init__(self, device: CudaDevice, layout: KVLayout, layer_ids: Sequence[int] | None = None,
                 dtype: str | None = None) -> None:
        ids = list(range(layout.num_layers)) if layer_ids is None else list(layer_ids)
        if len(ids) != layout.num_layers or len(set(ids)) != len(ids):
            raise ValueError(f"need {layout.num_layers} distinct attention layer ids, got {ids}")
        self.device = device
        self.layout = layout
        self.dtype = dtype_of(dtype or layout.dtype.name)
        self.k = {i: device.zeros(layout.buffer_shape, self.dtype) for i in ids}
        self.v = {i: device.zeros(layout.buffer_shape, self.dtype) for i in ids}
        row_bytes = layout.num_kv_heads * layout.head_dim * self.dtype.itemsize
        self._word = next(w for w in (16, 4, 1) if row_bytes % w == 0)
        self._row_words = row_bytes // self._word
        self._module = load_module("kv_cache.cu", (), device.arch)

    def buffers(self, layer: int) -> tuple[DeviceArray, DeviceArray]:
        return self.k[layer], self.v[layer]

    def rows(self, page_table: Sequence[int], start_pos: int, num_tokens: int) -> np.ndarray:
        """Pool rows (``page * page_size + offset``) of positions ``start_pos ..``, bounds-checked."""
        if start_pos < 0 or num_tokens < 0:
            raise ValueError(f"bad positions: start {start_pos}, count {num_tokens}")
        ps = self.layout.page_size
        pos = np.arange(start_pos, start_pos + num_tokens, dtype=np.int64)
        table = np.asarray(page_table, np.int64)
        if -(-(start_pos + num_tokens) // ps) > len(table):
            raise IndexError(f"page table of {len(table)} pages does not cover position {start_pos + num_tokens - 1}")
        pages = table[pos // ps]
        if num_tokens and (pages.min() < 0 or pages.max() >= self.layout.num_pages):
            raise IndexError(f"page index outside the pool of {self.layout.num_pages} pages")
        return pages * ps + pos % ps

    def _check_kv(self, k: DeviceArray, v: DeviceArray) -> None:
        shape = (k.shape[0], self.layout.num_kv_heads, self.layout.head_dim)
        if k.shape != shape or v.shape != shape or k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(f"k/v must be {shape} {self.dtype}, got {k.shape} {k.dtype} and {v.shape} {v.dtype}")

    def write(self, layer: int, page_table: Sequence[int], start_pos: int, k: DeviceArray, v: DeviceArray) -> None:
        """Store ``k``, ``v`` ``[T, Hkv, hd]`` (device, pool dtype) at positions ``start_pos .. start_pos+T-1``."""
        self._check_kv(k, v)
        self.write_rows(layer, self.rows(page_table, start_pos, k.shape[0]), k, v)

    def write_rows(self, layer: int, rows: np.ndarray, k: DeviceArray, v: DeviceArray) -> None:
        """Store ``k``, ``v`` ``[T, Hkv, hd]`` (device, pool dtype) at pool rows ``rows [T]``
        (``page * page_size + offset``; tokens of several sequences at once). Rows are bounds-checked."""
        self._check_kv(k, v)
        T = k.shape[0]
        rows = np.asarray(rows, np.int64).reshape(-1)
        if rows.shape != (T,):
            raise ValueError(f"{rows.size} rows for {T} tokens")
        if T == 0:
            return
        if rows.min() < 0 or rows.max() >= self.layout.num_pages * self.layout.page_size:
            raise IndexError(f"KV row outside the pool of {self.layout.num_pages} pages")
        dst = self.device.upload(rows, stream_ordered=True)
        self.write_rows_device(layer, dst.ptr, k.ptr, v.ptr, T)

    def write_rows_device(self, layer: int, rows_ptr: int, k_ptr: int, v_ptr: int, T: int) -> None:
        """Store ``T`` rows of k and v (device, contiguous ``[T, Hkv * hd]`` of the pool dtype, 16-byte aligned) at
        the pool rows of the int64 device array ``rows_ptr`` ``[T]``, already on the device and bounds-checked by
        the caller (a step's upload: ``slot_mapping`` checked every page before packing). No host work, no
        allocation: what the device-resident TensorRT path launches between a plan and the attention."""
        if T == 0:
            return
        kp, vp = self.k[layer], self.v[layer]
        kern = self._module.kernel(f"kv_write{self._word}")
        kern.launch(self.device, (T, 1, 1), (128, 1, 1), 0,
                    [("ptr", k_ptr), ("ptr", v_ptr), ("ptr", kp.ptr), ("ptr", vp.ptr), ("ptr", rows_ptr), ("i32", T),
                     ("i32", self._row_words)])
