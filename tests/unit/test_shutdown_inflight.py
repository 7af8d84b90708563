"""loadtests.shutdown_inflight's reading of how a stub died (the rest of it runs a real server: deploy/README.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loadtests.shutdown_inflight import _stub_exit_signal


def _zombie(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # not reaped: it stays a zombie until wait()
        if Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return proc
        time.sleep(0.01)
    raise AssertionError("the child did not exit")


def test_stub_exit_signal_reads_the_signal_of_a_zombie_only() -> None:
    assert _stub_exit_signal(os.getpid()) is None  # running
    segv = _zombie("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    exited = _zombie("raise SystemExit(3)")
    try:
        assert _stub_exit_signal(segv.pid) == signal.SIGSEGV
        assert _stub_exit_signal(exited.pid) is None  # an exit code, not a signal
    finally:
        assert segv.wait(10) == -signal.SIGSEGV and exited.wait(10) == 3
    assert _stub_exit_signal(segv.pid) is None  # reaped: gone
