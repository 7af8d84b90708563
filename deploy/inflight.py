"""The adapter's two threads around in-flight requests, Triton-independent and unit-tested:

* :class:`SendQueue` — sends responses from one thread, in order, so the engine thread never waits on
  Triton's IPC; a failed send (client gone) cancels the request in the engine.
* :class:`CancelWatcher` — the Python backend never calls back on cancellation, so in-flight requests'
  ``is_cancelled()`` are polled and turned into ``engine.cancel(id)``; it also drains every in-flight
  request when the model is being unloaded.
* :class:`TerminationSignals` — SIGTERM / SIGINT delivered to the stub itself, seen from the watcher's thread:
  the shutdown signal that needs no call into Triton (see :class:`CancelWatcher` for why that matters).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
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


class TerminationSignals:
    """SIGTERM and SIGINT received by this process, readable from any thread without waiting.

    The Python-backend stub ignores both (its C++ handlers do nothing), and its main thread sits in C++ between
    ``execute`` calls, so a Python handler alone would run only at the next request. Instead the handlers are
    no-ops and the signal's number is written to a pipe by CPython's C-level handler (``signal.set_wakeup_fd``),
    which :meth:`received` reads without blocking. The stub keeps ignoring the signals otherwise: Triton still
    decides when it finalizes the model.

    :meth:`install` must run on the main thread (``signal.signal``'s rule; the stub calls ``initialize`` there)
    and does nothing elsewhere, or when another wakeup fd is set (an asyncio loop's): it returns whether it
    installed. :meth:`uninstall` puts back the previous Python handlers (a handler set from C, such as the stub's,
    cannot be put back: the signal is then ignored, which is what the stub's did) and clears the wakeup fd.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._pipe: tuple[int, int] | None = None
        self._previous: dict[int, object] = {}
        self.signum: int | None = None  # the first signal received

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            log.info("termination signals not watched: initialize() ran outside the main thread")
            return False
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError as e:  # not the main thread of the main interpreter
            os.close(r)
            os.close(w)
            log.info("termination signals not watched: %s", e)
            return False
        if old != -1:  # someone else (an event loop) reads the wakeup fd: leave it to them
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            log.info("termination signals not watched: a wakeup fd is already set")
            return False
        self._pipe = (r, w)
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, _ignore_signal)
        return True

    def received(self) -> int | None:
        """The first SIGTERM / SIGINT received since :meth:`install` (its number), or None."""
        if self.signum is None and self._pipe is not None:
            with contextlib.suppress(BlockingIOError, OSError):
                for byte in os.read(self._pipe[0], 64):
                    if byte in self.SIGNALS:
                        self.signum = int(byte)
                        break
        return self.signum

    def uninstall(self) -> None:
        if self._pipe is None:
            return
        with contextlib.suppress(ValueError):  # not on the main thread: leave the handlers (the process is ending)
            for sig, handler in self._previous.items():
                # None: a handler installed outside Python (the stub's own, which ignores the signal)
                signal.signal(sig, signal.SIG_IGN if handler is None else handler)  # type: ignore[arg-type]
            signal.set_wakeup_fd(-1)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
            self._previous.clear()


def _ignore_signal(signum: int, frame: object) -> None:
    """The Python-level handler: nothing (the wakeup fd carries the signal to :meth:`TerminationSignals.received`)."""


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

    Draining: when the server shuts down it unloads the model, but Triton waits for every in-flight
    decoupled request to finish before it calls ``finalize``; a stream that would run for minutes then
    outlives the exit timeout and the server is killed mid-unload (leaking its shared memory). So once the
    shutdown is seen, every in-flight request is cancelled (and any that still arrives): each gets its final
    "cancelled" response and the unload proceeds. Two ways to see it, checked on every round:

    * ``terminated()`` (optional, :meth:`TerminationSignals.received`): SIGTERM / SIGINT reached the stub
      (``deploy.triton.TritonServer.stop`` signals the stubs before the server; ``tini -g`` signals the whole
      process group; Ctrl-C in a terminal reaches the stubs too).
      Nothing is asked of Triton, and no readiness call is made after it.
    * ``model_ready()`` (optional), every ``ready_period_s`` while requests are in flight: the fallback when
      only the server got the signal, or the model is unloaded through the repository API. Once the server
      is exiting, that call fails, and Triton 2.51's Python backend has a race on that failure path (the
      stub reads the error text after it let the server free it): the stub crashed in 5-7 of 25 such shutdowns
      on the 2-core machine (deploy/README.md, "Shutdown with requests in flight"). Hence the signal first.
    """

    def __init__(self, is_cancelled: Callable[[Any], bool], cancel: Callable[[str], None],
                 period_s: float = 0.05, model_ready: Callable[[], bool] | None = None,
                 ready_period_s: float = 0.25, terminated: Callable[[], int | None] | None = None) -> None:
        self._is_cancelled, self._cancel, self.period_s = is_cancelled, cancel, period_s
        self._model_ready, self.ready_period_s = model_ready, ready_period_s
        self._terminated = terminated
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
        if not self.draining and self._terminated is not None:
            signum = self._terminated()
            if signum is not None:
                self.draining = True
                log.warning("signal %d received: the server is shutting down, cancelling %d in-flight request(s)",
                            signum, len(todo))
        if todo and not self.draining and self._model_ready is not None and \
                time.monotonic() >= self._next_ready_check:
            self._next_ready_check = time.monotonic() + self.ready_period_s
            self.draining = not self._ready()
            # a signal that reached the stub while readiness was asked (the server is told right after its stubs)
            signum = self._terminated() if self.draining and self._terminated is not None else None
            if signum is not None:
                log.warning("signal %d received: the server is shutting down, cancelling %d in-flight request(s)",
                            signum, len(todo))
            elif self.draining:
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
