"""benchmarks.gpu_common.time_on_stream, the queue-filled timing the GPU kernel benchmarks share, on a fake
device and a fake torch (the benchmarks themselves run only on a GPU)."""

from __future__ import annotations

import sys
import types

import pytest

from benchmarks.gpu_common import time_on_stream


class FakeDevice:
    """Events are timestamps of a clock that each fn call advances by its index + 1 ms."""

    def __init__(self, log: list) -> None:
        self.log, self.clock = log, 0.0

    def synchronize(self) -> None:
        self.log.append("sync")

    def event(self) -> list:
        return []

    def record(self, e: list) -> None:
        e.append(self.clock)
        self.log.append("record")

    def elapsed_ms(self, e0: list, e1: list) -> float:
        return e1[0] - e0[0]


def test_time_on_stream_warms_up_spins_and_times_each_run(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list = []
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(_sleep=lambda c: log.append(("spin", c))))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    dev = FakeDevice(log)

    def fn(i: int) -> None:
        log.append(i)
        dev.clock += 1.0 if i < 100 else 3.0  # ms: the run offset by 100+ is slower

    t = time_on_stream(dev, fn, 2, runs=3, warmup=(7, 8), spin_cycles=123, offset_by_run=False)
    assert log[:3] == [7, 8, "sync"]
    assert log[3:] == [("spin", 123), "record", 0, 1, "record"] * 3
    assert t == pytest.approx(1e-3)  # 2 calls of 1 ms each: 1 ms per call, in seconds

    log.clear()
    t = time_on_stream(dev, fn, 50, runs=3, warmup=(), offset_by_run=True)
    calls = [x for x in log if isinstance(x, int)]
    assert calls == list(range(150))  # run r calls fn(r * 50 + i): a fresh input set per run
    assert t == pytest.approx(1e-3)  # runs 0 and 1: 1 ms per call, run 2 (fn(100..149)): 3 ms; median 1 ms
