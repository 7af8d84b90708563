"""benchmarks.gpu_common.time_on_stream (the queue-filled timing the GPU kernel benchmarks share), time_graph (the
calls captured once in a CUDA graph and replayed) and host_seconds_per_call, on a fake device, a fake graph and a
fake torch (the benchmarks themselves run only on a GPU)."""

from __future__ import annotations

import sys
import types

import pytest

from benchmarks.gpu_common import host_seconds_per_call, time_graph, time_on_stream


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


class FakeGraph:
    """Records fn()'s calls at capture (no clock) and replays them, each advancing the device clock."""

    def __init__(self, dev: FakeDevice, body) -> None:
        self.dev, self.calls, self.destroyed = dev, [], False
        dev.log.append("capture")
        dev.capturing = self.calls
        try:
            body()
        finally:
            dev.capturing = None

    def launch(self) -> None:
        self.dev.log.append("replay")
        for ms in self.calls:
            self.dev.clock += ms

    def destroy(self) -> None:
        self.destroyed = True


def test_time_graph_captures_once_and_times_each_replay() -> None:
    log: list = []
    dev = FakeDevice(log)
    dev.capturing = None
    graphs: list[FakeGraph] = []

    def fn(i: int) -> None:
        log.append(i)
        if dev.capturing is not None:
            dev.capturing.append(2.0 + i)  # ms on the GPU when replayed
        else:
            dev.clock += 1000.0  # an eager call (the warm-up): never inside a timed replay

    def graph(d: FakeDevice, body) -> FakeGraph:
        graphs.append(FakeGraph(d, body))
        return graphs[-1]

    t = time_graph(dev, fn, 3, runs=5, warmup=(9,), graph_cls=graph)
    assert log[:4] == [9, "sync", "capture", 0] and log[4:7] == [1, 2, "replay"]
    assert log[7:] == ["record", "replay", "record"] * 5
    assert t == pytest.approx((2.0 + 3.0 + 4.0) / 3 * 1e-3)  # the replays' GPU time per call, in seconds
    assert len(graphs) == 1 and graphs[0].destroyed


def test_host_seconds_per_call_is_the_enqueue_time_alone() -> None:
    log: list = []
    dev = FakeDevice(log)
    now = [0.0]

    def fn(i: int) -> None:
        log.append(i)
        now[0] += 0.5 + i  # host seconds this call takes

    t = host_seconds_per_call(dev, fn, 4, clock=lambda: now[0])
    assert log == ["sync", 0, 1, 2, 3, "sync"]
    assert t == pytest.approx((0.5 + 1.5 + 2.5 + 3.5) / 4)
