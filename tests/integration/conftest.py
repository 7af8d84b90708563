"""A live tritonserver (the nvidia-pytriton wheel's) serving the default bundle, shared by the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.triton import TritonServer


@pytest.fixture(scope="session")
def triton_server(default_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """Serves ``default_bundle`` (max batch 16) on free 127.0.0.1 ports; stopped by PID at the end, when
    its stubs must be gone and their /dev/shm regions removed.

    The server log stays in pytest's temporary directory (``.../triton0/tritonserver.log``).
    """
    log_path = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    server = TritonServer(parameters={"engine_dir": str(default_bundle)}, exit_timeout_s=3, log_path=log_path)
    server.start()
    try:
        server.wait("ready", timeout=120)
        yield server
    finally:
        code = server.stop()
        log_tail = server.log_tail(30)
        server.cleanup()
    assert not server.leaked_shm, f"shared-memory regions left behind: {sorted(server.leaked_shm)}\n{log_tail}"
    assert code == 0, f"tritonserver exited with {code}\n{log_tail}"
