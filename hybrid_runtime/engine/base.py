"""Backend interface: engine, execution context, profile.

Invariant 2 (DESIGN.md): with ``profile_pinning=per_context`` every (segment, profile) pair has its own
execution context, bound to its profile once at load; the serving path never switches a profile and
:attr:`Engine.profile_switches` stays 0. ``single_context`` (for memory-tight devices) keeps one context
per segment that switches, and rebinds every input and output after each switch; switches are counted.

Invariant 3: :meth:`ExecutionContext.check` validates shapes against the bound profile before any
enqueue and raises :class:`ShapeError`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping

import numpy as np

from ..config import ProfileSpec, SegmentSpec


class Phase(enum.IntEnum):
    """Optimization profile index: PREFILL = 0, DECODE = 1 (the order of the manifest's profiles)."""

    PREFILL = 0
    DECODE = 1


PINNING_MODES = ("per_context", "single_context")


class ShapeError(ValueError):
    """Inputs that do not fit the profile the context is bound to (raised before enqueue)."""


class ExecutionContext(ABC):
    """One segment bound to one profile. ``run`` takes and returns ``[num_tokens, width]`` arrays."""

    def __init__(self, spec: SegmentSpec, profile: ProfileSpec) -> None:
        self.spec = spec
        self.profile = profile

    def check(self, inputs: Mapping[str, np.ndarray]) -> int:
        """Validate names, dtypes and shapes against the spec and the bound profile; returns num_tokens."""
        expected = {name for name, _, _ in self.spec.inputs}
        if set(inputs) != expected:
            raise ShapeError(f"segment {self.spec.name}: inputs {sorted(inputs)} != expected {sorted(expected)}")
        n = -1
        for name, dtype, width in self.spec.inputs:
            arr = inputs[name]
            ok_shape = arr.ndim == 1 if width == 0 else (arr.ndim == 2 and arr.shape[1] == width)
            if arr.dtype != np.dtype(dtype) or not ok_shape:
                raise ShapeError(f"segment {self.spec.name} input {name}: got {arr.dtype}{list(arr.shape)}, "
                                 f"expected {dtype}[num_tokens{'' if width == 0 else f', {width}'}]")
            if n < 0:
                n = arr.shape[0]
            elif arr.shape[0] != n:
                raise ShapeError(f"segment {self.spec.name}: inputs disagree on num_tokens ({n} vs {arr.shape[0]})")
        p = self.profile
        if not p.min_tokens <= n <= p.max_tokens:
            raise ShapeError(f"segment {self.spec.name}: {n} tokens outside the {p.name} profile range "
                             f"{p.min_tokens}..{p.max_tokens}")
        return n

    @abstractmethod
    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Check, then execute. Returned arrays may be views of engine-owned buffers that stay valid until
        the engine runs another segment after the next one (onnxruntime: two banks shared by alternating
        segments), which is as long as the runner reads them: the mixer after a segment and the next segment."""


class Engine(ABC):
    """All segments of a bundle with their execution contexts; owned by one engine thread."""

    profile_switches: int = 0

    @property
    @abstractmethod
    def segments(self) -> tuple[SegmentSpec, ...]: ...

    @abstractmethod
    def run(self, segment: int, phase: Phase, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run segment index ``segment`` on the context for ``phase``."""

    @abstractmethod
    def num_contexts(self) -> int:
        """How many execution contexts exist (2 per segment per_context, 1 single_context)."""
