"""The one table of compile workarounds, keyed on toolkit, toolkit version and target architecture.

Invariant 4 (DESIGN.md): a workaround never depends on max batch size, or on any other serving
limit. :func:`select` takes no limits at all, so it *cannot*; the manifest records what was applied
and why, and the runtime logs it at load.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Workaround:
    """One entry: applies when toolkit matches and version / arch match their regular expressions."""

    id: str
    toolkit: str  # "onnxruntime" | "tensorrt" | "tensorrt_rtx"
    version: str  # regex over the toolkit version, e.g. r"10\..*"
    arch: str  # regex over the target, e.g. "cpu", r"sm_(89|90)"
    action: str  # what the builder/runtime does
    reason: str  # why (the failure it avoids)

    def record(self) -> dict[str, str]:
        return asdict(self)


TABLE: tuple[Workaround, ...] = (
    Workaround("ort-cpu-fp32-activations", "onnxruntime", r".*", r"cpu",
               "build segments in float32 whatever the checkpoint dtype",
               "the CPU execution provider lacks float16/bfloat16 kernels for Softplus, ReduceMean and "
               "Sigmoid, so a half-precision graph would fall back op by op or fail to load"),
    Workaround("ort-cpu-extended-graph-opt", "onnxruntime", r".*", r"cpu",
               "session graph_optimization_level = ORT_ENABLE_EXTENDED (not ALL)",
               "ALL adds NCHWc layout transforms meant for convolutions; for these MatMul graphs they "
               "only lengthen session creation"),
    Workaround("trt-fp32-norm-reductions", "tensorrt", r".*", r".*",
               "pin RMSNorm square/mean/sqrt layers and softplus gate layers to float32",
               "squaring half-precision activations above 256 overflows float16 and turns a norm into inf"),
    Workaround("trt-fp32-norm-reductions", "tensorrt_rtx", r".*", r".*",
               "pin RMSNorm square/mean/sqrt layers and softplus gate layers to float32",
               "squaring half-precision activations above 256 overflows float16 and turns a norm into inf"),
)


def select(toolkit: str, version: str, arch: str) -> list[Workaround]:
    """The workarounds for one toolkit build; deliberately has no batch-size (or any limit) input."""
    return [w for w in TABLE if w.toolkit == toolkit and re.fullmatch(w.version, version)
            and re.fullmatch(w.arch, arch)]
