"""Mirror the serving engine's metrics into Triton's custom-metric API (the server's ``/metrics``).

One thread owns every ``pb_utils`` metric object: every ``period_s`` (or sooner after :meth:`poke`, which
the adapter calls on each final event) it takes ``engine.stats()`` and sets the gauges, increments the
counters by what changed since the previous snapshot, and adds the queued latency samples to
Prometheus-style histograms. ``pb`` is the ``triton_python_backend_utils`` module (a fake one in unit tests).

Every ``pb_utils`` metric call is a synchronous round trip to the server process that holds the GIL for
its whole duration (the Python backend's ``Metric`` binding releases nothing), so the engine thread
cannot run Python meanwhile. Pushing each token's latency sample with ``Histogram.observe`` cost a call
per token (over 1000 a second at 16 streams); the latency histograms are therefore exported as counters
in the histogram exposition format — ``<name>_bucket{le="..."}`` (cumulative), ``<name>_sum``,
``<name>_count`` — accumulated here and pushed once per update for the series that changed, and a gauge
is set only when its value changed. ``histogram_quantile(..., rate(<name>_bucket[...]))`` works on them
as on a native histogram.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from hybrid_runtime.metrics import LATENCY_BUCKETS

log = logging.getLogger("deploy.triton_metrics")

PREFIX = "hybrid_llm_"
GAUGES = {
    "requests_running": "Requests in the running batch",
    "requests_waiting": "Requests queued for admission",
    "slots_in_use": "Recurrent-state slots held by live sequences",
    "kv_pages_in_use": "KV-cache pages held by live sequences",
    "profile_switches": "Optimization-profile switches on the serving path (0 with per_context pinning)",
    "cuda_graphs_captured": "Decode CUDA graphs captured at load (cuda bundles; 0 otherwise)",
}
# snapshot key -> (metric name, description, label name or None for a plain number)
COUNTERS = {
    "tokens_generated": ("generated_tokens_total", "Tokens generated", None),
    "prompt_tokens": ("prompt_tokens_total", "Prompt tokens admitted", None),
    "finished": ("requests_finished_total", "Finished requests by finish reason", "reason"),
    "steps": ("engine_steps_total", "Engine steps by phase", "phase"),
    "attention_plans": ("attention_plans_total", "Decode-attention launch plans by kernel", "kernel"),
    "attention_fallbacks": ("attention_fallbacks_total", "Decode-attention plan fallbacks by reason", "reason"),
    "graph_replays": ("cuda_graph_replays_total", "Decode steps replayed from a CUDA graph, by graph "
                      "(b<bucket>x<chunks per sequence>)", "graph"),
    "decode_eager": ("decode_eager_steps_total", "Decode steps of a cuda bundle launched eagerly, by reason", "reason"),
    "async_steps": ("async_steps_total", "Decode steps prepared while the step before them ran (async_scheduling), "
                    "by outcome: launched, or dropped and scheduled afresh", "outcome"),
    "step_seconds": ("engine_step_seconds_total", "Wall time of engine steps by phase, from launch to tokens handed "
                     "out (run, sample, events; with async scheduling a step overlaps the one before it)", "phase"),
    "heap_trims": ("heap_trims_total", "glibc malloc_trim calls of the engine thread (heap_trim_interval_s)", None),
    "heap_trim_seconds": ("heap_trim_seconds_total", "Time spent in the engine thread's malloc_trim calls", None),
}
LATENCIES = {
    "ttft": ("time_to_first_token_seconds", "Time from request arrival to its first token"),
    "itl": ("inter_token_latency_seconds", "Time between consecutive tokens of a request"),
}
LE = [("+Inf" if b == float("inf") else f"{b:g}") for b in LATENCY_BUCKETS]  # the ``le`` label values
# Exported only with heap debugging on (config.pbtxt heap_debug_dir), labelled with the stub's pid: every
# model instance is its own process, and a soak follows each one's heap.
HEAP_GAUGES = {
    "python_heap_bytes": "Python heap traced by tracemalloc in this model instance's process (heap debugging)",
    "python_heap_peak_bytes": "Peak of the traced Python heap (heap debugging)",
    "tracemalloc_overhead_bytes": "tracemalloc's own memory, outside the traced heap (heap debugging)",
    # glibc's malloc_info (deploy.heap_debug.malloc_stats): which native allocator holds the process's memory
    "malloc_arenas": "glibc malloc arenas in this process (heap debugging)",
    "malloc_main_arena_bytes": "Size of glibc's main arena heap (heap debugging)",
    "malloc_thread_arenas_bytes": "Size of glibc's other (per-thread) arenas together (heap debugging)",
    "malloc_largest_thread_arena_bytes": "Size of the largest per-thread glibc arena (heap debugging)",
    "malloc_free_bytes": "Free memory glibc holds in its arenas (heap debugging)",
    "malloc_mmap_bytes": "Memory of glibc's mmapped chunks, above the mmap threshold (heap debugging)",
    "malloc_mmap_chunks": "Number of glibc's mmapped chunks (heap debugging)",
    "malloc_in_use_bytes": "Memory the process holds through malloc: arenas plus mmapped chunks minus free (heap "
                           "debugging)",
}


class TritonMetrics:
    """Owns the model's ``pb.MetricFamily`` objects; ``labels`` go on every metric (model, version).

    ``heap`` (optional, heap debugging): returns the :data:`HEAP_GAUGES` values of this process; they are
    exported with a ``pid`` label.
    """

    def __init__(self, pb: Any, snapshot: Callable[[], dict], labels: dict[str, str], period_s: float = 0.5,
                 heap: Callable[[], dict[str, float]] | None = None) -> None:
        self.pb, self.snapshot, self.labels, self.period_s = pb, snapshot, dict(labels), period_s
        self.heap = heap
        kinds = pb.MetricFamily
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple[str, str], Any] = {}
        self._last: dict[tuple[str, str], float] = {}
        self._gauges: dict[tuple[str, str], float] = {}
        # per latency kind: cumulative bucket counts (one per LATENCY_BUCKETS bound), sum and count
        self._latency = {kind: ([0] * len(LATENCY_BUCKETS), [0.0, 0]) for kind in LATENCIES}
        self._samples: collections.deque[tuple[str, float]] = collections.deque()
        self._rejected: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for key, desc in GAUGES.items():
            self._family(PREFIX + key, desc, kinds.GAUGE)
        for name, desc, _ in COUNTERS.values():
            self._family(PREFIX + name, desc, kinds.COUNTER)
        self._family(PREFIX + "requests_rejected_total", "Requests refused at validation, by error code",
                     kinds.COUNTER)
        if heap is not None:
            for key, desc in HEAP_GAUGES.items():
                self._family(PREFIX + key, desc, kinds.GAUGE)
        for name, desc in LATENCIES.values():
            self._family(PREFIX + name + "_bucket", desc + " (histogram buckets: samples <= le)", kinds.COUNTER)
            self._family(PREFIX + name + "_sum", desc + " (histogram sum, seconds)", kinds.COUNTER)
            self._family(PREFIX + name + "_count", desc + " (histogram count)", kinds.COUNTER)

    # ---- called from any thread -----------------------------------------------------------------
    def observe(self, kind: str, seconds: float) -> None:
        """Queue a latency sample (``kind`` is "ttft" or "itl"); cheap, safe on the engine thread."""
        self._samples.append((kind, seconds))

    def count_rejected(self, code: str) -> None:
        with self._lock:
            self._rejected[code] += 1
        self._wake.set()

    def poke(self) -> None:
        self._wake.set()

    def start(self) -> TritonMetrics:
        self._thread = threading.Thread(target=self._run, name="hybrid-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread, then drop metrics before their families (the backend insists on that order)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._metrics.clear()
        self._families.clear()

    # ---- the metrics thread -----------------------------------------------------------------------
    def update(self) -> None:
        """Push one snapshot into the Triton metrics."""
        snap = self.snapshot()
        for key in GAUGES:
            self._set(PREFIX + key, float(snap.get(key, 0)))
        for key, (name, _, label) in COUNTERS.items():
            value = snap.get(key, {} if label else 0)
            items = value.items() if label else [("", value)]
            for label_value, total in items:
                self._add(PREFIX + name, float(total), {label: str(label_value)} if label else {})
        if self.heap is not None:
            pid = {"pid": str(os.getpid())}
            for key, value in self.heap().items():
                if key in HEAP_GAUGES:
                    self._set(PREFIX + key, float(value), pid)
        with self._lock:
            rejected = dict(self._rejected)
        for code, total in rejected.items():
            self._add(PREFIX + "requests_rejected_total", float(total), {"code": code})
        while self._samples:
            kind, seconds = self._samples.popleft()
            counts, total = self._latency[kind]
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    counts[i] += 1  # cumulative: every bucket from the first that holds the sample
            total[0] += seconds
            total[1] += 1
        for kind, (counts, total) in self._latency.items():
            if not total[1]:
                continue
            name = PREFIX + LATENCIES[kind][0]
            for le, c in zip(LE, counts):
                self._metric(name + "_bucket", {"le": le})  # every bucket exists once the first sample does
                self._add(name + "_bucket", float(c), {"le": le})
            self._add(name + "_sum", total[0], {})
            self._add(name + "_count", float(total[1]), {})

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.update()
            except Exception as e:  # metrics must never take the model down
                log.warning("metrics update failed: %s", e)
            self._wake.wait(self.period_s)
            self._wake.clear()

    def _family(self, name: str, description: str, kind: Any) -> None:
        self._families[name] = self.pb.MetricFamily(name=name, description=description, kind=kind)

    def _metric(self, name: str, extra: dict[str, str] | None = None) -> Any:
        key = (name, repr(sorted((extra or {}).items())))
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._families[name].Metric(labels={**self.labels, **(extra or {})})
            self._metrics[key] = metric
        return metric

    def _set(self, name: str, value: float, extra: dict[str, str] | None = None) -> None:
        """Set gauge ``name`` when its value changed (each set is a GIL-holding round trip)."""
        key = (name, repr(sorted((extra or {}).items())))
        if self._gauges.get(key) != value:
            self._metric(name, extra).set(value)
            self._gauges[key] = value

    def _add(self, name: str, total: float, extra: dict[str, str]) -> None:
        """Bring counter ``name`` up to ``total`` (snapshots are cumulative; Triton counters only grow)."""
        key = (name, repr(sorted(extra.items())))
        delta = total - self._last.get(key, 0.0)
        if delta > 0:
            self._metric(name, extra).increment(delta)
            self._last[key] = total
