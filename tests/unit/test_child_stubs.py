"""deploy.triton.child_stubs: the Python-backend stubs of a server, found by walking /proc (real processes: a
stand-in executable named ``triton_python_backend_stub``), as children and, under a launcher, as grandchildren."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from deploy.triton import child_stubs

REGION = "triton_python_backend_shm_region_test-1234"


def _wait_for(pid: int, want: int) -> dict[int, str]:
    deadline = time.monotonic() + 20
    found: dict[int, str] = {}
    while time.monotonic() < deadline:
        found = child_stubs(pid)
        if len(found) >= want:
            return found
        time.sleep(0.05)
    return found


def test_child_stubs_finds_children_and_grandchildren_only(tmp_path: Path) -> None:
    stub = tmp_path / "triton_python_backend_stub"  # what the server executes, by its name
    stub.symlink_to(os.path.realpath(sys.executable))
    sleeper = f"{shlex.quote(str(stub))} -c 'import time; time.sleep(60)' {REGION}"
    other = f"{shlex.quote(os.path.realpath(sys.executable))} -c 'import time; time.sleep(60)' {REGION}"
    # "server": one stub as its child, one under a nested shell (a launcher's grandchild), one process that is
    # not a stub; a stub outside the tree is not its own.
    server = subprocess.Popen(["sh", "-c", f"{sleeper} & sh -c \"{sleeper} & wait\" & {other} & wait"],
                              start_new_session=True)
    stranger = subprocess.Popen(["sh", "-c", f"exec {sleeper}"])
    try:
        found = _wait_for(server.pid, 2)
        assert len(found) == 2 and set(found.values()) == {REGION}
        assert stranger.pid not in found
        assert child_stubs(stranger.pid) == {}  # it is a stub, not a parent of one
    finally:
        os.killpg(server.pid, 9)
        stranger.kill()
        server.wait(10)
        stranger.wait(10)
