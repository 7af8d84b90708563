"""Shared by the serving-engine tests (CPU and GPU): a sink that collects the events of several requests."""

from __future__ import annotations

import threading

from hybrid_runtime.serving import Event


class Collect:
    """The events of several requests (``events``: request id -> its events in order; ``finals``: request id -> its
    final event); ``done`` is set when ``n`` requests had their final event. A second final event for one request
    fails the sink (an AssertionError in the engine's thread, which the tests' counts then show)."""

    def __init__(self, n: int) -> None:
        self.events: dict[str, list[Event]] = {}
        self.finals: dict[str, Event] = {}
        self.n = n
        self.done = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, ev: Event) -> None:
        with self.lock:
            self.events.setdefault(ev.request_id, []).append(ev)
            if ev.final:
                assert ev.request_id not in self.finals, "two final events"
                self.finals[ev.request_id] = ev
                if len(self.finals) == self.n:
                    self.done.set()

    def tokens(self, request_id: str) -> int:
        """Non-final events of one request: its streamed tokens."""
        return sum(not ev.final for ev in self.events.get(request_id, []))
