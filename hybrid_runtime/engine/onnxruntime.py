"""onnxruntime (CPU) backend: one InferenceSession per segment (weights loaded once), IOBinding contexts.

A context owns an IOBinding and output buffers sized to its profile's maximum token count. Each run
binds the inputs and views of the first ``num_tokens`` rows of those buffers, then runs with the
binding; nothing is allocated on the serving path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..config import Manifest, ProfileSpec, SegmentSpec
from .base import PINNING_MODES, Engine, ExecutionContext, Phase

log = logging.getLogger("hybrid_runtime.engine")


class OrtContext(ExecutionContext):
    """A segment bound to a profile through its own IOBinding and output buffers."""

    def __init__(self, session: ort.InferenceSession, spec: SegmentSpec, profile: ProfileSpec) -> None:
        super().__init__(spec, profile)
        self.session = session
        self.binding = session.io_binding()
        self._buffers: dict[str, np.ndarray] = {}
        self.bind(profile)

    def bind(self, profile: ProfileSpec) -> None:
        """(Re)bind to ``profile``: fresh output buffers sized to its max, every binding cleared."""
        self.profile = profile
        self.binding.clear_binding_inputs()
        self.binding.clear_binding_outputs()
        self._buffers = {name: np.zeros((profile.max_tokens, width), np.dtype(dt))
                         for name, dt, width in self.spec.outputs}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = self.check(inputs)
        b = self.binding
        for name, arr in inputs.items():
            b.bind_cpu_input(name, np.ascontiguousarray(arr))
        outs = {}
        for name, buf in self._buffers.items():
            view = buf[:n]
            b.bind_output(name, "cpu", 0, view.dtype, list(view.shape), view.ctypes.data)
            outs[name] = view
        self.session.run_with_iobinding(b)
        return outs


class OrtEngine(Engine):
    """All segments of an onnxruntime bundle."""

    def __init__(self, bundle_dir: str | Path, manifest: Manifest, pinning: str = "per_context",
                 intra_op_threads: int = 0) -> None:
        if pinning not in PINNING_MODES:
            raise ValueError(f"profile_pinning={pinning!r}: choose one of {', '.join(PINNING_MODES)}")
        self.pinning = pinning
        self.profile_switches = 0
        self._specs = manifest.segments
        self._profiles = manifest.profiles
        opts = ort.SessionOptions()
        # Workaround ort-cpu-extended-graph-opt (recorded in the manifest).
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self._contexts: list[list[OrtContext]] = []
        for spec in self._specs:
            sess = ort.InferenceSession(str(Path(bundle_dir) / spec.onnx), sess_options=opts,
                                        providers=["CPUExecutionProvider"])
            if pinning == "per_context":
                self._contexts.append([OrtContext(sess, spec, p) for p in self._profiles])
            else:
                self._contexts.append([OrtContext(sess, spec, self._profiles[Phase.PREFILL])])
        log.info("onnxruntime engine: %d segments, %d contexts (%s)", len(self._specs), self.num_contexts(), pinning)

    @property
    def segments(self) -> tuple[SegmentSpec, ...]:
        return self._specs

    def num_contexts(self) -> int:
        return sum(len(c) for c in self._contexts)

    def context(self, segment: int, phase: Phase) -> OrtContext:
        ctxs = self._contexts[segment]
        if self.pinning == "per_context":
            return ctxs[phase]
        ctx = ctxs[0]
        want = self._profiles[phase]
        if ctx.profile != want:
            ctx.bind(want)  # switch, then rebind every input and output (single_context mode)
            self.profile_switches += 1
        return ctx

    def run(self, segment: int, phase: Phase, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.context(segment, phase).run(inputs)
