"""Where every segment tensor of a TensorRT bundle lives when the runtime owns the device buffers.

The device-resident TensorRT path (:class:`~hybrid_runtime.cuda.trt_backend.TrtDeviceBackend`) binds every input
and output of every execution context once, at load, to a buffer of the runtime (invariant 2: the addresses never
change while serving). This module is the plan of those buffers, with no device code, so that CI checks it:

* ``step.input_ids`` / ``step.positions`` (int64 ``[T]``): the step's upload (written by its one host-to-device
  copy; the backend supplies these addresses).
* ``bank0.<name>`` / ``bank1.<name>`` (``[T, width]``): segment ``i`` writes its outputs (``x_next``, the next
  mixer's ``u z g beta`` / ``q k v gate``, the MoE's ``h``) into bank ``i % 2``; segment ``i + 1`` and the operator
  between them read bank ``i % 2`` while segment ``i + 1`` writes the other bank. So no context reads and writes
  one buffer (``post_mixer{i}`` reads ``z`` of layer i and writes ``z`` of layer i + 1), and an output stays valid
  until the segment after next runs: as long as the pipeline reads it (the same rule as the onnxruntime engine's
  two banks).
* ``core`` / ``attn`` / ``ffn_out`` (``[T, width]``): what the stateful operators write for the segment after them
  (``mix_core``, ``mix_attn``, ``ffn_out``): the GDN's core output, the attention output, the MoE's summed slots.
* ``head.x`` (``[R, H]``: the rows that need logits, gathered by the runtime) and ``head.logits`` (``[R, vocab]``,
  what the sampler reads).

``T`` = ``max_tokens`` (the largest step: a prefill chunk or a decode bucket), ``R`` = ``max_rows`` (logit rows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..config import BundleError
from ..pipeline import SegmentPlan
from .tensorrt import Bindings

# operator outputs -> (the buffer the operator writes, the segment output the operator reads it beside)
OPERATOR_OUTPUTS = {"mix_core": "core", "mix_attn": "attn", "ffn_out": "ffn_out"}
# segment inputs that are the previous segment's outputs, renamed
FROM_PREVIOUS = {"x": "x_next", "mix_z": "z", "mix_gate": "gate"}
STEP_INPUTS = {"input_ids": "step.input_ids", "positions": "step.positions"}


@dataclass(frozen=True)
class BufferSpec:
    """One runtime buffer: ``rows`` x ``width`` elements of ``dtype`` (``width`` 0: ``[rows]``), row-major, rows
    ``max(width, 1)`` elements apart."""

    key: str
    dtype: str
    rows: int
    width: int

    @property
    def nbytes(self) -> int:
        return self.rows * max(self.width, 1) * (8 if self.dtype == "int64" else 4)


class SegmentBuffers:
    """The buffer plan of a segment pipeline (``plans``: :func:`~hybrid_runtime.pipeline.plan_segments`, the head
    last): which buffer every segment input and output is (:meth:`key`), the buffers to allocate
    (:attr:`buffers`), and, once addresses exist, each segment's :class:`~.tensorrt.Bindings`."""

    def __init__(self, plans: Sequence[SegmentPlan], max_tokens: int, max_rows: int) -> None:
        if max_tokens < 1 or max_rows < 1:
            raise ValueError(f"max_tokens={max_tokens}, max_rows={max_rows}: need at least one row each")
        if not plans or plans[-1].exit[0] != "head":
            raise BundleError("the segment pipeline must end with the head segment")
        self.plans = list(plans)
        self.max_tokens, self.max_rows = max_tokens, max_rows
        self._keys: list[dict[str, str]] = []
        specs: dict[str, BufferSpec] = {}

        def use(key: str, dtype: str, width: int, rows: int) -> None:
            old = specs.get(key)
            if old is not None and old.dtype != dtype:
                raise BundleError(f"buffer {key}: {old.dtype} and {dtype} tensors share it")
            specs[key] = BufferSpec(key, dtype, rows, max(width, old.width if old else 0))

        head = len(self.plans) - 1
        for si, plan in enumerate(self.plans):
            keys: dict[str, str] = {}
            prev_out = {n for n, _, _ in self.plans[si - 1].outputs} if si > 0 else set()
            for name, dtype, width in plan.inputs:
                if si == head:
                    key, rows = "head.x", max_rows
                elif name in STEP_INPUTS:
                    key, rows = STEP_INPUTS[name], max_tokens
                elif name in OPERATOR_OUTPUTS:
                    key, rows = OPERATOR_OUTPUTS[name], max_tokens
                elif name in FROM_PREVIOUS and FROM_PREVIOUS[name] in prev_out:
                    key, rows = f"bank{(si - 1) % 2}.{FROM_PREVIOUS[name]}", max_tokens
                else:
                    raise BundleError(f"segment {plan.name} input {name}: no runtime buffer holds it (the segments "
                                      "do not match this runtime's pipeline; rebuild the bundle)")
                keys[name] = key
                use(key, dtype, width, rows)
            for name, dtype, width in plan.outputs:
                key, rows = (f"head.{name}", max_rows) if si == head else (f"bank{si % 2}.{name}", max_tokens)
                keys[name] = key
                use(key, dtype, width, rows)
            self._keys.append(keys)
        self.buffers: dict[str, BufferSpec] = specs

    def key(self, segment: int, name: str) -> str:
        """The buffer of tensor ``name`` (an input or output) of segment index ``segment``."""
        return self._keys[segment][name]

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer the runtime allocates for the segments (the step inputs excluded)."""
        return sum(b.nbytes for k, b in self.buffers.items() if not k.startswith("step."))

    def allocate(self, alloc: Callable[[BufferSpec], int], given: Mapping[str, int]) -> dict[str, int]:
        """Addresses of every buffer: ``given`` ones as they are (the step inputs, and buffers the runtime already
        has), the rest from ``alloc(spec)``. The step inputs must be given."""
        missing = [k for k in self.buffers if k.startswith("step.") and k not in given]
        if missing:
            raise ValueError(f"the step's upload must provide {missing}")
        return {k: int(given[k]) if k in given else int(alloc(b)) for k, b in self.buffers.items()}

    def bindings(self, segment: int, addresses: Mapping[str, int]) -> Bindings:
        """Segment ``segment``'s :class:`~.tensorrt.Bindings` over the allocated ``addresses``; ``rows`` is the
        fewest rows any of its buffers holds."""
        keys = self._keys[segment]
        return Bindings({name: addresses[key] for name, key in keys.items()},
                        min(self.buffers[key].rows for key in keys.values()))
