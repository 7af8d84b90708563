"""GPU tests: everything marked ``gpu`` here is skipped cleanly unless PyTorch sees a CUDA device and the
CUDA driver is reachable through cuda-bindings. Unmarked tests in this folder (NVRTC compiles, launch
logic) run on any machine."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda sees no GPU"
    try:
        from hybrid_runtime.cuda.driver import device_count
    except ImportError as e:
        return f"hybrid_runtime.cuda unavailable: {e}"
    if device_count() < 1:
        return "cuda-bindings finds no CUDA device"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [it for it in items if it.get_closest_marker("gpu") and HERE in Path(str(it.path)).resolve().parents]
    if not mine:
        return
    reason = _gpu_reason()
    if reason:
        for it in mine:
            it.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


@pytest.fixture(scope="module")
def dev():
    """The project's ``CudaDevice`` on GPU 0 (one per module; a file may define its own ``dev``)."""
    import torch

    torch.cuda.init()
    from hybrid_runtime.cuda.driver import CudaDevice

    return CudaDevice(0)
