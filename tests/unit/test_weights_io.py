"""save_safetensors writes atomically and checks its header on disk before the file takes its name."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from hybrid_runtime import weights_io
from hybrid_runtime.weights_io import SafetensorsFile, WeightsFormatError, bf16_to_f32, save_safetensors

TENSORS = {"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.float16),
           "c": np.array([1.5, -2.25, 3.0], np.float32)}


def corrupting_fsync() -> tuple[list[int], object]:
    """An os.fsync that overwrites the header's last byte on disk with NUL before syncing (a disk that
    did not keep what it was given)."""
    real = os.fsync
    calls: list[int] = []

    def fake(fd: int) -> None:
        calls.append(fd)
        with open(os.readlink(f"/proc/self/fd/{fd}"), "r+b") as f:  # the file behind the writer's fd
            (n,) = struct.unpack("<Q", f.read(8))
            f.seek(8 + n - 1)
            f.write(b"\0")
        real(fd)
    return calls, fake


def test_round_trip_leaves_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "w.safetensors"
    save_safetensors(p, TENSORS, bf16=frozenset({"c"}), metadata={"format": "pt"})
    f = SafetensorsFile(p)
    assert f.metadata == {"format": "pt"}
    np.testing.assert_array_equal(f.header["a.weight"]["shape"], [3, 4])
    assert sorted(x.name for x in tmp_path.iterdir()) == ["w.safetensors"]
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0 and raw[8:8 + n].rstrip(b" ").endswith(b"}")
    c = np.frombuffer(raw[8 + n + f.header["c"]["data_offsets"][0]:8 + n + f.header["c"]["data_offsets"][1]],
                      np.uint16)
    np.testing.assert_array_equal(bf16_to_f32(c), TENSORS["c"])


def test_a_bad_write_is_an_error_and_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "w.safetensors"
    save_safetensors(p, {"old": np.zeros(2, np.float32)})
    before = p.read_bytes()
    calls, fake = corrupting_fsync()
    monkeypatch.setattr(weights_io.os, "fsync", fake)
    with pytest.raises(WeightsFormatError, match=r"does not read back as written: .*\\x00.*the file differs from "
                                                 r"the bytes written at 1 offsets"):
        save_safetensors(p, TENSORS)
    assert len(calls) == 1
    assert p.read_bytes() == before  # never replaced by the bad copy
    assert sorted(x.name for x in tmp_path.iterdir()) == ["w.safetensors"]


def test_unsupported_dtype_writes_nothing(tmp_path: Path) -> None:
    p = tmp_path / "w.safetensors"
    with pytest.raises(WeightsFormatError, match="cannot store"):
        save_safetensors(p, {"z": np.zeros(2, np.complex64)})
    assert list(tmp_path.iterdir()) == []


def test_spooled_writer_streams_tensors_of_unknown_shapes(tmp_path: Path) -> None:
    from hybrid_runtime.weights_io import SafetensorsSpool, f32_to_bf16_bits

    rng = np.random.default_rng(0)
    a, b, c = rng.standard_normal((3, 5)).astype(np.float32), rng.integers(0, 255, (7,), dtype=np.uint8), np.arange(4)
    w = SafetensorsSpool(tmp_path / "w.safetensors", metadata={"k": "v"})
    w.write("a_bf16", a, "BF16")
    w.write("b", b)
    w.write("c", c)
    w.write("a_f16", a, "F16")
    with pytest.raises(WeightsFormatError, match="written twice"):
        w.write("b", b)
    w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no data or temporary file left
    f = SafetensorsFile(tmp_path / "w.safetensors")
    assert f.metadata == {"k": "v"} and f.keys() == ["a_bf16", "b", "c", "a_f16"]
    assert np.array_equal(f.raw("a_bf16"), f32_to_bf16_bits(a)) and f.dtype("a_bf16") == "BF16"
    assert np.array_equal(f.raw("b"), b) and f.dtype("b") == "U8"
    assert np.array_equal(f.raw("c"), c) and f.dtype("c") == "I64"
    assert np.array_equal(f.raw("a_f16"), a.astype(np.float16))
    w2 = SafetensorsSpool(tmp_path / "x.safetensors")
    w2.write("a", a)
    w2.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]
