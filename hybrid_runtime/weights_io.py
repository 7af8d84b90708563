"""Minimal safetensors reader/writer over numpy (no torch): memory-mapped reads, exact bfloat16.

The format: an 8-byte little-endian header length, a JSON header mapping names to
``{dtype, shape, data_offsets}``, then the raw little-endian data.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

_READ = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
         "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_WRITE = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
          np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
          np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


class WeightsFormatError(ValueError):
    """A weights file that is not valid safetensors or holds an unsupported dtype."""


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Exact bfloat16 -> float32 (``bits`` is the raw uint16 storage)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round-to-nearest-even (as torch does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + 0x7FFF
    return ((u + rounding) >> 16).astype(np.uint16)


class SafetensorsFile:
    """A memory-mapped ``.safetensors`` file; tensors are read lazily."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise WeightsFormatError(f"{self.path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise WeightsFormatError(f"{self.path}: implausible safetensors header length {n}")
            raw_header = f.read(n)
            try:
                header = json.loads(raw_header)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise WeightsFormatError(f"{self.path}: malformed safetensors header ({n} bytes, {len(raw_header)} "
                                         f"read): {_where(e, raw_header)}") from e
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._base = 8 + n
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.header: dict[str, dict] = header

    def keys(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def raw(self, name: str) -> np.ndarray:
        """The stored array without conversion (bfloat16 as uint16 bits), read-only, zero-copy."""
        info = self.header[name]
        if info["dtype"] not in _READ:
            raise WeightsFormatError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        dt = np.dtype(_READ[info["dtype"]])
        start, end = info["data_offsets"]
        return np.frombuffer(self._mm, dtype=dt, count=(end - start) // dt.itemsize,
                             offset=self._base + start).reshape(info["shape"])

    def data_range(self, name: str) -> tuple[int, int]:
        """``(offset, length)`` in bytes of a tensor's raw data within the file (ONNX external data can
        point there, so a session reads the tensor from this file without a copy of its own)."""
        start, end = self.header[name]["data_offsets"]
        return self._base + start, end - start

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 for floating types (bf16/f16 widened exactly), else its own type."""
        arr = self.raw(name)
        if self.header[name]["dtype"] == "BF16":
            return bf16_to_f32(arr)
        if arr.dtype.kind == "f":
            return arr.astype(np.float32, copy=False)  # float32 stays a zero-copy read-only view
        return arr.copy()


def save_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray], bf16: frozenset[str] = frozenset(),
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path``; names in ``bf16`` are stored as BF16 (given as float32 arrays).

    Atomic and checked: the file is written next to ``path``, synced, its header read back and parsed,
    and only then renamed onto ``path`` (a reader never sees a half-written file). A header that does
    not read back as written is a :class:`WeightsFormatError` that says whether the disk or the bytes
    handed to it were wrong, and the old file at ``path`` stays."""
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        if name in bf16:
            data, dtype = f32_to_bf16_bits(arr).tobytes(), "BF16"
        else:
            if arr.dtype not in _WRITE:
                raise WeightsFormatError(f"cannot store {name} of dtype {arr.dtype}")
            data, dtype = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes(), _WRITE[arr.dtype]
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = dict(metadata)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the data section starts 8-byte aligned
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for b in blobs:
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        if problem := _header_problem(tmp, header, 8 + len(hb) + offset, hb):
            raise WeightsFormatError(f"{path}: the written file does not read back as written: {problem}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _header_problem(path: Path, header: Mapping[str, object], size: int, written: bytes) -> str:
    """Why the file at ``path`` is not ``header`` followed by ``size`` bytes in all; "" if it is.
    ``written``: the header bytes handed to ``write``; a message says whether the file differs from them
    (the disk did not keep them) or they were wrong already (the process's memory)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        hb = f.read(max(n, 0))
    actual = path.stat().st_size
    if actual != size:
        return f"{actual} bytes on disk, {size} written"
    try:
        if json.loads(hb) != header:
            return "the header differs"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        diff = [i for i, (a, b) in enumerate(zip(hb, written)) if a != b]
        where = (f"the file differs from the bytes written at {len(diff)} offsets from {diff[0]} to {diff[-1]}"
                 if diff else "the file holds exactly the bytes written: they were wrong in memory")
        return f"header of {n} bytes: {_where(e, hb)}; {where}; written tail {written[-12:]!r}"
    return ""


def _where(e: json.JSONDecodeError | UnicodeDecodeError, raw: bytes) -> str:
    """A header parse error with the bytes around the place it stopped."""
    at = getattr(e, "pos", getattr(e, "start", 0))
    return f"{e}; bytes there: {raw[max(0, at - 8):at + 16]!r}"


_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


class SafetensorsWriter:
    """Streams tensors into a safetensors file whose header is known up front, one tensor at a time (a
    70 GB checkpoint never sits in memory whole). ``specs``: ``(name, dtype, shape)`` in file order, dtype
    ``F32`` / ``F16`` / ``BF16``; :meth:`write` takes float arrays in that order and converts them.
    Written next to ``path`` and renamed into place by :meth:`close` after an fsync and a header read-back,
    like :func:`save_safetensors`; :meth:`abort` removes the partial file."""

    def __init__(self, path: str | Path, specs: list[tuple[str, str, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        header: dict[str, object] = {}
        offset = 0
        self._order: list[tuple[str, str, tuple[int, ...], int]] = []
        for name, dtype, shape in specs:
            if dtype not in _ITEMSIZE:
                raise WeightsFormatError(f"cannot stream {name} as {dtype}; supported: {sorted(_ITEMSIZE)}")
            n = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._order.append((name, dtype, tuple(shape), n))
            offset += n
        if metadata:
            header["__metadata__"] = dict(metadata)
        self._header = header
        hb = json.dumps(header, separators=(",", ":")).encode()
        self._hb = hb + b" " * (-len(hb) % 8)
        self._size = 8 + len(self._hb) + offset
        self._next = 0
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._f.write(struct.pack("<Q", len(self._hb)))
        self._f.write(self._hb)

    @property
    def remaining(self) -> list[str]:
        return [o[0] for o in self._order[self._next:]]

    def write(self, name: str, arr: np.ndarray) -> None:
        if self._next >= len(self._order):
            raise WeightsFormatError(f"{self.path}: {name} written after the last tensor")
        want, dtype, shape, n = self._order[self._next]
        if name != want:
            raise WeightsFormatError(f"{self.path}: expected {want} next, got {name}")
        a = np.asarray(arr)
        if tuple(a.shape) != shape:
            raise WeightsFormatError(f"{self.path}: {name} has shape {a.shape}, the header says {shape}")
        if dtype == "BF16":
            data = f32_to_bf16_bits(a.astype(np.float32, copy=False))
        else:
            data = np.ascontiguousarray(a, np.float32 if dtype == "F32" else np.float16)
        assert data.nbytes == n
        self._f.write(memoryview(data.reshape(-1).view(np.uint8)))
        self._next += 1

    def close(self) -> None:
        """Finish: every tensor must have been written; then sync, check and rename."""
        if self._next != len(self._order):
            self.abort()
            raise WeightsFormatError(f"{self.path}: closed with {len(self._order) - self._next} tensors unwritten "
                                     f"(next: {self._order[self._next][0]})")
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            if problem := _header_problem(self._tmp, self._header, self._size, self._hb):
                raise WeightsFormatError(f"{self.path}: the written file does not read back as written: {problem}")
            os.replace(self._tmp, self.path)
        finally:
            self._tmp.unlink(missing_ok=True)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()
        self._tmp.unlink(missing_ok=True)


class SafetensorsSpool:
    """Streams tensors whose shapes are not known up front (a GPTQ checkpoint's packed layouts are known only
    once a layer is read): :meth:`write` appends each tensor's bytes to a data file beside ``path`` and notes
    its header entry; :meth:`close` writes the header, then copies the data after it (the only way to put a
    header first without knowing it), syncs, reads the header back and renames into place. Host memory holds
    one tensor at a time; the disk holds the data twice until :meth:`close` ends. :meth:`abort` removes both."""

    def __init__(self, path: str | Path, metadata: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        self._header: dict[str, object] = {}
        self._offset = 0
        self._metadata = dict(metadata or {})
        self._data = self.path.with_name(f".{self.path.name}.{os.getpid()}.data")
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._f = open(self._data, "wb")  # noqa: SIM115 - closed in close()/abort()

    def write(self, name: str, arr: np.ndarray, dtype: str | None = None) -> None:
        """Append ``arr``: ``dtype`` ``BF16`` / ``F16`` / ``F32`` converts a float array (bfloat16
        round-to-nearest-even); None stores it in its own dtype."""
        if name in self._header:
            raise WeightsFormatError(f"{self.path}: {name} written twice")
        a = np.asarray(arr)
        if dtype == "BF16":
            data = f32_to_bf16_bits(a.astype(np.float32, copy=False))
        elif dtype in ("F16", "F32"):
            data = np.ascontiguousarray(a, np.float32 if dtype == "F32" else np.float16)
        elif dtype is None:
            if a.dtype not in _WRITE:
                raise WeightsFormatError(f"cannot store {name} of dtype {a.dtype}")
            data, dtype = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False), _WRITE[a.dtype]
        else:
            raise WeightsFormatError(f"cannot stream {name} as {dtype}; supported: BF16, F16, F32 or None")
        n = data.nbytes
        self._header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [self._offset, self._offset + n]}
        self._f.write(memoryview(data.reshape(-1).view(np.uint8)))
        self._offset += n

    def close(self) -> None:
        header = dict(self._header)
        if self._metadata:
            header["__metadata__"] = self._metadata
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        try:
            self._f.close()
            with open(self._tmp, "wb") as out, open(self._data, "rb") as data:
                out.write(struct.pack("<Q", len(hb)))
                out.write(hb)
                shutil.copyfileobj(data, out, 64 << 20)
                out.flush()
                os.fsync(out.fileno())
            if problem := _header_problem(self._tmp, header, 8 + len(hb) + self._offset, hb):
                raise WeightsFormatError(f"{self.path}: the written file does not read back as written: {problem}")
            os.replace(self._tmp, self.path)
        finally:
            self._tmp.unlink(missing_ok=True)
            self._data.unlink(missing_ok=True)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()
        self._tmp.unlink(missing_ok=True)
        self._data.unlink(missing_ok=True)
