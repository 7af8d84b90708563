"""A model instance that loses its device, through a real tritonserver: every request in flight is
answered with an error, the model turns not ready within seconds (it unloads itself), the server stays up,
the model can be loaded again through the repository API, and the server still exits cleanly.

The fault is injected by the engine's test-only hook (``HYBRID_LLM_INJECT_FAULT``). On this CPU machine
the host backend stands in for the device with a simulated sticky error (a test double at the device
boundary: a CPU has no sticky errors); ``tests/gpu/test_device_fault_gpu.py`` makes the real one on the
GPU (a kernel that writes to an illegal address).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import pytest

from client.lib import ClientError, generate_stream_grpc
from deploy.triton import TritonServer

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox jumps over the lazy dog."
GREEDY = {"temperature": 0, "ignore_eos": True}
FAULT_STEP = 12  # engine steps: the 4 prompts' prefills, then decode steps with all 4 in flight


def _post(server: TritonServer, path: str, timeout: float = 60.0) -> int:
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _wait(condition, timeout: float) -> float:
    """Seconds until ``condition()`` held; AssertionError after ``timeout``."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.parametrize("kind", ["sticky", "launch"])
def test_device_fault_through_the_server(default_bundle: Path, kind: str) -> None:
    server = TritonServer(parameters={"engine_dir": str(default_bundle)}, exit_timeout_s=20,
                          env={"HYBRID_LLM_INJECT_FAULT": f"{kind}@{FAULT_STEP}"})
    server.start()
    try:
        server.wait("ready", timeout=120)
        outcomes: list[tuple[str, str]] = []
        lock = threading.Lock()
        started = threading.Barrier(4)

        def run(i: int) -> None:
            started.wait(30)
            gen = generate_stream_grpc(server.grpc_url, f"{i}: {PROMPT}", max_tokens=200, sampling=GREEDY,
                                       timeout=60)
            try:
                res = gen.wait()
                out = ("finished", res.finish_reason or "")
            except ClientError as e:
                out = ("error", str(e))
            with lock:
                outcomes.append(out)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert len(outcomes) == 4, f"a request was never answered: {outcomes}\n{server.log_tail(40)}"
        if kind == "launch":
            # a non-sticky launch error fails only that step's requests; the model keeps serving
            failed = [o for o in outcomes if o[0] == "error"]
            assert failed and all("injected launch failure" in msg for _, msg in failed), outcomes
            assert server.model_ready()
            after = generate_stream_grpc(server.grpc_url, PROMPT, max_tokens=4, sampling=GREEDY, timeout=60).wait()
            assert after.finish_reason == "length"
        else:
            assert all(o[0] == "error" and "device failure" in o[1] for o in outcomes), outcomes
            # not ready within 5 s of the last answer (the goal), the server itself still up
            seconds = _wait(lambda: not server.model_ready(), 5.0)
            assert server.is_live()
            with pytest.raises(ClientError):
                generate_stream_grpc(server.grpc_url, PROMPT, max_tokens=4, sampling=GREEDY, timeout=30).wait()
            # recovery without a server restart: load it again (a fresh stub, engine and device context)
            assert _post(server, "/v2/repository/models/hybrid_llm/load", timeout=120) == 200, server.log_tail(40)
            assert server.model_ready()
            after = generate_stream_grpc(server.grpc_url, PROMPT, max_tokens=4, sampling=GREEDY, timeout=60).wait()
            assert after.finish_reason == "length"
            print(f"model not ready {seconds:.2f} s after the fault's answers")
    finally:
        code = server.stop(timeout=40)
        tail = server.log_tail(40)
        server.cleanup()
    assert code == 0, tail
    assert not server.leaked_shm
