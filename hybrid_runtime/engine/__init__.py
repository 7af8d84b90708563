"""Execution backends behind one interface (:mod:`.base`), picked by name with lazy imports."""

from __future__ import annotations

from pathlib import Path

from ..config import BundleError, Manifest
from .base import PINNING_MODES, Engine, ExecutionContext, Phase, ShapeError

BACKENDS = ("onnxruntime", "tensorrt")

__all__ = ["BACKENDS", "PINNING_MODES", "Engine", "ExecutionContext", "Phase", "ShapeError", "load_engine"]


def load_engine(bundle_dir: str | Path, manifest: Manifest, pinning: str = "per_context",
                intra_op_threads: int = 0) -> Engine:
    """The engine for ``manifest.backend``; an unknown backend names the supported ones."""
    if manifest.backend == "onnxruntime":
        from .onnxruntime import OrtEngine

        return OrtEngine(bundle_dir, manifest, pinning, intra_op_threads)
    if manifest.backend == "tensorrt":
        from .tensorrt import TrtEngine  # imports TensorRT and cuda-python only when a TensorRT bundle is loaded

        return TrtEngine(bundle_dir, manifest, pinning)
    raise BundleError(f"bundle backend {manifest.backend!r} is not supported by this runtime "
                      f"(supported: {', '.join(BACKENDS)})")
