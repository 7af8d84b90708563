"""Serving metrics: counters and latency summaries written by the engine thread, read by anyone.

The engine thread is the only writer; readers take a :meth:`Metrics.snapshot` under the lock. The Triton
adapter mirrors the snapshot into the Python backend's custom-metric API; tests and the offline CLI
read it directly.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

# Histogram bucket upper bounds in seconds, shared by time-to-first-token and inter-token latency.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram (Prometheus style)."""

    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: float = 0.0
    n: int = 0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                break
        self.total += seconds
        self.n += 1

    def quantile(self, q: float) -> float:
        """Bucket upper bound at quantile ``q`` (coarse; exact figures come from the load tests)."""
        if not self.n:
            return 0.0
        target, acc = q * self.n, 0
        for bound, c in zip(LATENCY_BUCKETS, self.counts):
            acc += c
            if acc >= target:
                return bound
        return LATENCY_BUCKETS[-1]


class Metrics:
    """All runtime metrics of one serving engine."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests_running = 0
        self.requests_waiting = 0
        self.slots_in_use = 0
        self.kv_pages_in_use = 0
        self.profile_switches = 0
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.steps = Counter[str]()
        # wall time of whole steps (launch to tokens handed out: run + sample + postprocess) by phase; with async
        # scheduling a step launched ahead overlaps the one before it
        self.step_seconds = Counter[str]()
        self.step_tokens = Counter[str]()  # tokens processed by phase (prompt tokens / decoded tokens)
        self.finished = Counter[str]()  # by finish reason
        self.rejected = Counter[str]()  # validation errors by code
        self.attention_plans = Counter[str]()
        self.attention_fallbacks = Counter[str]()
        # cuda bundles: decode graphs captured, steps replayed per graph ("b<bucket>x<chunks>"), eager decode
        # steps by reason (no graph of the step's class, graphs off, class plan invalid for the batch)
        self.cuda_graphs_captured = 0
        self.graph_replays = Counter[str]()
        self.decode_eager = Counter[str]()
        # async scheduling: decode steps prepared while the step before ran, "launched" or "dropped" (an EOS or
        # stop token, an arrival or a cancel in the meantime: the step was scheduled afresh)
        self.async_steps = Counter[str]()
        # glibc malloc_trim calls of the engine thread (RuntimeOptions.heap_trim_interval_s) and their time
        self.heap_trims = 0
        self.heap_trim_seconds = 0.0
        self.ttft = Histogram()
        self.itl = Histogram()

    def snapshot(self) -> dict:
        with self.lock:
            return {
                "requests_running": self.requests_running,
                "requests_waiting": self.requests_waiting,
                "slots_in_use": self.slots_in_use,
                "kv_pages_in_use": self.kv_pages_in_use,
                "profile_switches": self.profile_switches,
                "tokens_generated": self.tokens_generated,
                "prompt_tokens": self.prompt_tokens,
                "steps": dict(self.steps),
                "step_seconds": dict(self.step_seconds),
                "step_tokens": dict(self.step_tokens),
                "finished": dict(self.finished),
                "rejected": dict(self.rejected),
                "attention_plans": dict(self.attention_plans),
                "attention_fallbacks": dict(self.attention_fallbacks),
                "cuda_graphs_captured": self.cuda_graphs_captured,
                "graph_replays": dict(self.graph_replays),
                "decode_eager": dict(self.decode_eager),
                "async_steps": dict(self.async_steps),
                "heap_trims": self.heap_trims,
                "heap_trim_seconds": self.heap_trim_seconds,
                "ttft": {"n": self.ttft.n, "sum": self.ttft.total, "buckets": list(self.ttft.counts)},
                "itl": {"n": self.itl.n, "sum": self.itl.total, "buckets": list(self.itl.counts)},
            }
