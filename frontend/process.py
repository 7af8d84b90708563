"""Run ``python -m frontend`` as a child process (what ``make serve`` and the tests do).

:class:`FrontendProcess` starts it on 127.0.0.1 (a free port unless given), waits until ``/health``
answers 200 (Triton ready) with a timeout that reports the log's tail, and stops it by PID (SIGTERM, then
SIGKILL). Only the standard library is used here, so importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


class FrontendError(RuntimeError):
    """The frontend did not start or died."""


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the frontend if the process that started it dies (no orphans)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FrontendProcess:
    """``python -m frontend --triton-url TRITON_GRPC`` on ``127.0.0.1:port`` (a context manager).

    ``log_path=None`` writes the log to a temporary file (:meth:`log_tail`); ``"-"`` inherits stdout/stderr.
    ``extra_args`` go to the command line as they are (e.g. ``["--bundle", "m=/path"]``).
    """

    def __init__(self, triton_grpc_url: str, *, port: int | None = None, host: str = "127.0.0.1",
                 log_path: str | Path | None = None, extra_args: list[str] | None = None,
                 python: str = sys.executable) -> None:
        self.triton_grpc_url = triton_grpc_url
        self.host = host
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])
        self.python = python
        self._log_arg = log_path
        self.log_path: Path | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        return [self.python, "-m", "frontend", "--host", self.host, "--port", str(self.port),
                "--triton-url", self.triton_grpc_url, *self.extra_args]

    def start(self) -> FrontendProcess:
        if self.proc is not None:
            raise FrontendError("frontend already started")
        if self._log_arg == "-":
            out = None
        else:
            if self._log_arg:
                self.log_path = Path(self._log_arg)
            else:
                self._tmp = tempfile.TemporaryDirectory(prefix="frontend-")
                self.log_path = Path(self._tmp.name) / "frontend.log"
            out = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child, closed below
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT if out else None, env=env,
                                         cwd=Path(__file__).resolve().parents[1], start_new_session=True,
                                         preexec_fn=_die_with_parent)
        finally:
            if out is not None:
                out.close()
        return self

    def health(self, timeout: float = 2.0) -> int:
        """HTTP status of ``GET /health`` (0 when nothing answers)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def wait(self, timeout: float = 60.0) -> FrontendProcess:
        """Until ``/health`` answers 200; raises FrontendError with the log's tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise FrontendError(f"the frontend exited with code {code}\n{self.log_tail()}")
            if self.health() == 200:
                return self
            time.sleep(0.1)
        raise FrontendError(f"the frontend was not healthy within {timeout:.0f} s\n{self.log_tail()}")

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_text()
        return "\n".join(text.splitlines()[-lines:]) if text else "(no frontend log captured)"

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM by PID, SIGKILL after ``timeout``; returns the exit code, 0 for a clean shutdown.

        uvicorn re-raises the SIGTERM it handled once its graceful shutdown is done, so a frontend that
        stopped on our SIGTERM ends with -SIGTERM: that counts as 0. SIGKILL gives -9.
        """
        if self.proc is None:
            return None
        terminated = False
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
                terminated = True
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        code = self.proc.returncode
        return 0 if terminated and code == -signal.SIGTERM else code

    def cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> FrontendProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.cleanup()
