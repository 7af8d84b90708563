"""A real device fault on the GPU (the host-side flow is tested on the CPU in tests/unit/test_device_faults.py
and through tritonserver in tests/integration/test_device_fault.py):

* sticky: a kernel writes to an illegal address before a decode step (CUDA_ERROR_ILLEGAL_ADDRESS): every request
  in flight gets its final error event within seconds, the engine stops, ``on_fatal`` fires once with a
  DeviceLost whose cause is the illegal address, and the process does not hang (it runs in a subprocess: a sticky
  error poisons the context of the whole process);
* launch: a launch the driver refuses (non-sticky): only that step's requests fail, the context stays healthy and
  the engine serves the next request;
* the memory budget on the device: the plan at load, and a fraction too small for the state slots refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_runtime.config import ConfigError
from hybrid_runtime.serving import RuntimeOptions, ServingEngine

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
REPORT = Path(os.environ.get("GPU_REPORT_DIR", "/tmp")) / "device_fault_report.json"


@pytest.fixture(scope="module")
def cuda_bundle(default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from builder.bundle import BuildOptions, build_bundle

    out = tmp_path_factory.mktemp("fault") / "cuda_bf16"
    build_bundle(default_checkpoint, out, BuildOptions(backend="cuda", dtype="bfloat16", max_batch_size=8,
                                                       max_input_len=128, max_seq_len=256), progress=lambda _m: None)
    return out


def _case(bundle: Path, kind: str, step: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, str(REPO / "tests" / "gpu" / "device_fault_case.py"), str(bundle), kind,
                          str(step)], capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    report = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    report[kind] = res
    REPORT.write_text(json.dumps(report, indent=1))
    print(f"[device-fault] {kind}: {res}")
    return res


def test_a_sticky_fault_fails_every_request_and_stops(cuda_bundle: Path) -> None:
    res = _case(cuda_bundle, "sticky", 6)
    assert res["answered"] and res["seconds"] < 30, res
    assert len(res["finals"]) == 4
    assert all(f["reason"] == "error" and "device failure" in f["error"] for f in res["finals"].values()), res
    assert res["fatal"] == "DeviceLost" and res["on_fatal_calls"] == 1
    assert res["cause"] == "CUDA_ERROR_ILLEGAL_ADDRESS", res
    assert res["health"] == "CUDA_ERROR_ILLEGAL_ADDRESS"  # sticky: the context stays poisoned


def test_a_refused_launch_fails_only_its_step(cuda_bundle: Path) -> None:
    res = _case(cuda_bundle, "launch", 6)
    assert res["answered"], res
    errors = [f for f in res["finals"].values() if f["reason"] == "error"]
    assert errors and all("CUDA_ERROR_INVALID_VALUE" in f["error"] for f in errors), res
    assert res["fatal"] is None and res["on_fatal_calls"] == 0 and res["health"] is None
    assert res["after"] == "length"


def test_memory_budget_on_the_device(cuda_bundle: Path) -> None:
    eng = ServingEngine(cuda_bundle, RuntimeOptions(gpu_memory_fraction=0.9))
    try:
        be = eng.runner.backend
        plan = be.memory_plan
        assert plan is not None and not plan.capped
        assert eng.scheduler.pages.num_pages == be.num_pages == eng.manifest.limits.num_kv_pages
        free, total = be.dev.mem_info()
        report = json.loads(REPORT.read_text()) if REPORT.exists() else {}
        report["memory"] = {"plan": plan.describe(), "capture_mib": round(be.capture_bytes / 2**20, 1),
                            "free_after_load_gib": round(free / 2**30, 2), "total_gib": round(total / 2**30, 2)}
        REPORT.write_text(json.dumps(report, indent=1))
        print(f"[device-fault] memory: {report['memory']}")
        assert be.capture_bytes < plan.reserve_bytes  # graphs and workspaces fit the reserve
    finally:
        eng.shutdown()
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        ServingEngine(cuda_bundle, RuntimeOptions(gpu_memory_fraction=0.001))
