"""The adapter's two threads around in-flight requests, Triton-independent and unit-tested:

* :class:`SendQueue` — sends responses from one thread, in order, so the engine thread never waits on
  Triton's IPC; a failed send (client gone) cancels the request in the engine.
* :class:`CancelWatcher` — the Python backend never calls back on cancellation, so in-flight requests'
  ``is_cancelled()`` are polled and turned into ``engine.cancel(id)``; it also drains every in-flight
  request when the model is being unloaded.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("deploy.inflight")


class SendQueue:
    """Sends responses from one thread, in order, so the engine thread never waits on Triton's IPC.

    A ``response_sender.send`` is a synchronous round trip to the server process (~0.4 ms measured on
    2 CPU cores); made on the engine thread it would stall every step by that much per running request.
    ``put(request_id, send)`` queues a zero-argument ``send``; one that raises (the client went away)
    is reported to ``on_error(request_id, exc)`` — the adapter cancels the request in the engine then.

    ``gate`` (optional, ``ServingEngine.device_wait``): building a response holds the GIL (~0.1 ms per reply
    in the stub, measured with py-spy on the H200), and done while the engine thread packs the next step it
    stretched that host work (the decode step took 3.86 ms inside the stub against 3.48 ms offline). With a
    gate, the sender waits until the gate is set — the engine blocked on its device, GIL released — or
    ``gate_timeout_s`` passed (an idle or host-bound engine delays a reply by at most that much), then sends
    every reply queued by then, in order, without waiting again.
    """

    _STOP = object()

    def __init__(self, on_error: Callable[[str, Exception], None], gate: threading.Event | None = None,
                 gate_timeout_s: float = 0.002) -> None:
        self._on_error = on_error
        self._gate, self.gate_timeout_s = gate, gate_timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, request_id: str, send: Callable[[], None]) -> None:
        self._queue.put((request_id, send))

    def start(self) -> SendQueue:
        self._thread = threading.Thread(target=self._run, name="hybrid-response-sender", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Send everything queued so far, then stop the thread."""
        self._queue.put(self._STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            # Wait for the gate once, then send everything queued by now without waiting again: replies
            # arrive a batch per engine step, and a wait per reply would let the queue fall behind the
            # engine whenever its device waits are short (measured: a 4-layer soak's TTFT went from 0.6 s
            # to 10 s that way).
            gate = self._gate
            if item is not self._STOP and gate is not None and not gate.is_set():
                gate.wait(self.gate_timeout_s)
            while True:
                if item is self._STOP:
                    return
                self._send(*item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break

    def _send(self, request_id: str, send: Callable[[], None]) -> None:
        try:
            send()
        except Exception as e:  # the client is gone (or the request was already completed)
            log.info("sending a response of %s failed: %s", request_id, e)
            try:
                self._on_error(request_id, e)
            except Exception:
                log.exception("on_error(%s) failed", request_id)


@dataclass(eq=False, slots=True)
class _Watched:
    handle: Any
    lock: threading.Lock
    armed: bool = False
    closed: bool = False
    cancelled: bool = False


class CancelWatcher:
    """Polls in-flight requests for client cancellation and cancels them in the engine.

    Rules for callers: :meth:`add` a request before submitting it, :meth:`arm` it once submitted (a
    cancel that reached the engine before the request would be lost), and :meth:`remove` it *before*
    sending its final response. ``is_cancelled(handle)`` is called from this watcher's thread only and
    never after :meth:`remove` returned: Triton frees a request's response factory once the final
    response is sent, and asking a freed factory whether it is cancelled crashes the server
    (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled, seen with Triton 2.51). ``cancel(request_id)``
    is called once per cancelled request.

    ``model_ready()`` (optional) is checked every ``ready_period_s`` while requests are in flight. When
    the server shuts down it unloads the model, but Triton waits for every in-flight decoupled request
    to finish before it calls ``finalize``; a stream that would run for minutes then outlives the exit
    timeout and the server is killed mid-unload (leaking its shared memory). So once the model reports
    not ready, every in-flight request is cancelled: each gets its final "cancelled" response and the
    unload proceeds.
    """

    def __init__(self, is_cancelled: Callable[[Any], bool], cancel: Callable[[str], None],
                 period_s: float = 0.05, model_ready: Callable[[], bool] | None = None,
                 ready_period_s: float = 0.25) -> None:
        self._is_cancelled, self._cancel, self.period_s = is_cancelled, cancel, period_s
        self._model_ready, self.ready_period_s = model_ready, ready_period_s
        self._next_ready_check = 0.0
        self.draining = False
        self._live: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def add(self, request_id: str, handle: Any) -> None:
        with self._lock:
            self._live[request_id] = _Watched(handle, threading.Lock())

    def arm(self, request_id: str) -> None:
        """Start polling a submitted request (no-op if it already finished)."""
        with self._lock:
            entry = self._live.get(request_id)
            if entry is not None:
                entry.armed = True

    def remove(self, request_id: str) -> None:
        """Stop watching; waits for an ``is_cancelled`` call on this request that is under way."""
        with self._lock:
            entry = self._live.pop(request_id, None)
        if entry is not None:
            with entry.lock:
                entry.closed = True

    def poll_once(self) -> list[str]:
        """Check every registered request once; returns the ids newly cancelled."""
        with self._lock:
            todo = [(rid, e) for rid, e in self._live.items() if e.armed and not e.cancelled]
        if todo and not self.draining and self._model_ready is not None and \
                time.monotonic() >= self._next_ready_check:
            self._next_ready_check = time.monotonic() + self.ready_period_s
            self.draining = not self._ready()
            if self.draining:
                log.warning("the model is being unloaded: cancelling %d in-flight request(s)", len(todo))
        hit = []
        for rid, entry in todo:
            with entry.lock:
                if entry.closed:
                    continue
                if not self.draining:
                    try:
                        if not self._is_cancelled(entry.handle):
                            continue
                    except Exception as e:
                        log.debug("is_cancelled(%s) failed: %s", rid, e)
                        continue
                entry.cancelled = True
            log.info("request %s cancelled%s", rid, " (unloading)" if self.draining else " by the client")
            self._cancel(rid)
            hit.append(rid)
        return hit

    def _ready(self) -> bool:
        try:
            return bool(self._model_ready())  # type: ignore[misc]
        except Exception as e:  # the server is going away
            log.debug("model_ready() failed: %s", e)
            return False

    def start(self) -> CancelWatcher:
        self._thread = threading.Thread(target=self._run, name="hybrid-cancel-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.poll_once()
