"""Backends of the runner's one pipeline: what executes segments, mixers, MoE, head and sampler, and where
their tensors live.

:class:`~hybrid_runtime.runner.ModelRunner` walks the segment pipeline once per step (``_forward``), calling
the backend for every piece; the backend decides the tensor type. Two kinds:

* :class:`HostBackend` (bundle backend ``onnxruntime``, and ``tensorrt`` on the host path: ``device="cpu"`` or
  ``trt_path="host"``): the engine's segments (onnxruntime on the CPU; TensorRT plans whose outputs are copied
  back), the stateful operators of ``device`` (:class:`~hybrid_runtime.ops.cpu.CpuOps`, onnxruntime sessions, or
  the CUDA kernels of :class:`~hybrid_runtime.cuda.operators.CudaOps`), MoE through onnxruntime
  (:mod:`hybrid_runtime.ops.moe`) and the host sampler. Tensors between the pieces are host numpy arrays.
* :class:`~hybrid_runtime.cuda.backend.CudaBackend` (bundle backend ``cuda``): everything on one GPU (program
  ops as fused kernels + cuBLASLt, device MoE, device sampler, whole-step CUDA graphs for decode). Tensors are
  device matrices; per step one upload and one download.
* :class:`~hybrid_runtime.cuda.trt_backend.TrtDeviceBackend` (bundle backend ``tensorrt`` on a GPU, the default
  there): the same, with the segments as TensorRT contexts bound to the runtime's device buffers (no CUDA graphs).

Per-row sampling inputs are :class:`SampleRow`; a step returns a :class:`StepResult`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .config import LINEAR, Manifest
from .engine import Engine, Phase, load_engine
from .kv_cache import KVLayout
from .ops.base import SeqStep, StatefulOps, make_ops
from .ops.dispatcher import VECTOR_MIN
from .ops.moe import MoE
from .quant import check_state_weights
from .sampler import TokenLogprobs, sample, token_logprobs
from .sampling import SamplingParams
from .weights_io import SafetensorsFile


class DeviceLost(RuntimeError):
    """The backend's device can run nothing more in this process (a sticky CUDA error such as an illegal
    address poisons the context): every request in flight fails and the model instance must be restarted.
    ``cause`` is the error that showed it."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


# Test-only fault injection (ServingEngine's HYBRID_LLM_INJECT_FAULT): "sticky" = a fault that loses the
# device (the cuda backend launches a kernel that writes to an illegal address), "launch" = a launch the
# driver refuses (non-sticky: only that step's requests fail).
FAULT_KINDS = ("sticky", "launch")


@dataclass(frozen=True, slots=True)
class SampleRow:
    """How to draw one row's next token. ``rng``: the host sampler's per-request generator; ``seed`` and
    ``counter`` (the position of the token being drawn): the device sampler's counter-based generator;
    ``logprobs``: None, or how many top tokens to report (0..20) besides the drawn one."""

    params: SamplingParams
    rng: np.random.Generator | None = None
    seed: int = 0
    counter: int = 0
    logprobs: int | None = None


@dataclass
class StepResult:
    """``tokens [R]`` for the rows that needed logits (in step order); ``logprobs[r]`` when row r asked for
    them; ``logits [R, vocab]`` float32 only when the caller asked for them (tests, ``run``)."""

    tokens: np.ndarray
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    logits: np.ndarray | None = None


class Backend(Protocol):
    """What :meth:`ModelRunner._forward` and the runner's step call (see the module docstring)."""

    kind: str
    device: str
    ops: Any  # the state owner: reset_slot, state_arrays, kv_arrays, dispatcher, state_layout, kv_layout
    timings: Counter

    @property
    def profile_switches(self) -> int: ...
    def prepare(self, phase: Phase, steps: list[SeqStep], rows: Sequence[SampleRow] | None,
                want_logits: bool) -> Any: ...
    def inputs(self, ctx: Any) -> dict[str, Any]: ...
    def segment(self, index: int, ctx: Any, env: dict[str, Any]) -> dict[str, Any]: ...
    def gdn(self, layer: int, ctx: Any, out: dict[str, Any]) -> Any: ...
    def attention(self, layer: int, ctx: Any, out: dict[str, Any]) -> Any: ...
    def moe(self, layer: int, ctx: Any, h: Any) -> Any: ...
    def head(self, ctx: Any, x: Any) -> Any: ...
    def execute(self, ctx: Any, forward: Callable[[Any], Any]) -> StepResult: ...
    def inject_fault(self, kind: str) -> None: ...


def check_steps(phase: Phase, steps: list[SeqStep]) -> None:
    if phase == Phase.DECODE and any(len(s.token_ids) != 1 for s in steps):
        raise ValueError("a DECODE batch carries exactly one token per sequence")


def slot_mapping(steps: list[SeqStep], positions: np.ndarray, bounds: np.ndarray, page_size: int,
                 num_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """(page, offset) of every token of the batch, bounds-checked once per step for all attention layers.

    From :data:`~hybrid_runtime.ops.dispatcher.VECTOR_MIN` sequences up every table's coverage is checked at once
    (numpy); smaller batches go one sequence at a time. A sequence of one token (decode) reads one page of its
    table; longer ones the pages their tokens touch (a long list table is never converted whole)."""
    B, T = len(steps), len(positions)
    bounds = np.asarray(bounds)
    starts = None
    if B >= VECTOR_MIN and isinstance(page_size, int) and page_size >= 1:
        try:
            starts = np.fromiter((s.start_pos for s in steps), np.int64, count=B)
            have = np.fromiter((len(s.page_table) for s in steps), np.int64, count=B)
        except (OverflowError, TypeError, ValueError):
            starts = None
    if starts is None:
        pages = np.empty(T, np.int64)
        bl = bounds.tolist()
        for i, s in enumerate(steps):
            a, b = int(bl[i]), int(bl[i + 1])
            need = -(-(s.start_pos + b - a) // page_size)
            if need > len(s.page_table):
                raise IndexError(f"page table of {len(s.page_table)} pages does not cover {s.start_pos + b - a} "
                                 f"tokens")
            if a == b:
                continue
            if b - a == 1 and (p := int(positions[a])) >= 0:
                pages[a] = s.page_table[p // page_size]
            else:
                _gather(pages, s.page_table, positions, a, b, page_size)
    else:
        counts = bounds[1:B + 1] - bounds[:B]
        short = -(-(starts + counts) // page_size) > have
        i = int(short.argmax())
        if short[i]:  # the first sequence whose table does not cover its tokens
            s, a, b = steps[i], int(bounds[i]), int(bounds[i + 1])
            raise IndexError(f"page table of {len(s.page_table)} pages does not cover {s.start_pos + b - a} tokens")
        index = (positions // page_size).tolist() if T == B and (counts == 1).all() else None
        if index is not None and min(index) >= 0:  # one token per sequence (decode): one page of each table
            pages = np.array([s.page_table[p] for s, p in zip(steps, index)], np.int64)
        else:
            pages = np.empty(T, np.int64)
            bl = bounds.tolist()
            for i, s in enumerate(steps):
                if bl[i] != bl[i + 1]:
                    _gather(pages, s.page_table, positions, int(bl[i]), int(bl[i + 1]), page_size)
    if T and (pages.min() < 0 or pages.max() >= num_pages):
        raise IndexError(f"page index outside the pool of {num_pages} pages")
    return pages, positions % page_size


def _gather(pages: np.ndarray, table: Any, positions: np.ndarray, a: int, b: int, page_size: int) -> None:
    """``pages[a:b]``: the pages of tokens a..b-1 (one sequence), converting only the part of its table they touch."""
    first, last = int(positions[a]) // page_size, int(positions[b - 1]) // page_size
    pages[a:b] = np.asarray(table[first:last + 1], np.int64)[positions[a:b] // page_size - first]


@dataclass
class HostCtx:
    phase: Phase
    steps: list[SeqStep]
    bounds: np.ndarray
    ids: np.ndarray
    positions: np.ndarray
    pages: np.ndarray
    offsets: np.ndarray
    rows: Sequence[SampleRow] | None
    want_logits: bool


class HostBackend:
    """Engine segments + the stateful operators of ``device`` + host MoE (onnxruntime) + the host sampler."""

    def __init__(self, bundle_dir: str | Path, manifest: Manifest, *, pinning: str = "per_context",
                 multi_block_mode: str = "auto", num_kv_pages: int | None = None, intra_op_threads: int = 0,
                 engine: Engine | None = None, device: str = "cpu") -> None:
        cfg, lim = manifest.model, manifest.limits
        self.cfg = cfg
        self.kind = manifest.backend
        self.engine = engine or load_engine(bundle_dir, manifest, pinning, intra_op_threads)
        sw = SafetensorsFile(Path(bundle_dir) / manifest.state_weights)
        names = list(sw.keys())
        check_state_weights(manifest.quantization, names,
                            {n.removesuffix(".nbits_meta"): sw.get(n) for n in names if n.endswith(".nbits_meta")})
        conv_w = {i: np.ascontiguousarray(sw.get(f"layers.{i}.linear_attn.conv1d")) for i in cfg.linear_layers}
        self.moe_layers = {i: MoE(cfg, sw, i) for i in range(cfg.num_layers) if cfg.ffn_types[i] == "moe"}
        pages = num_kv_pages or lim.num_kv_pages
        self.kv_layout = KVLayout(pages, lim.page_size, cfg.num_kv_heads, cfg.head_dim, np.float32,
                                  len(cfg.attention_layers))
        self.ops: StatefulOps = make_ops(device, cfg, conv_w, lim.num_state_slots, self.kv_layout, multi_block_mode)
        self.device = self.ops.device
        self.num_pages = pages
        self._fault: str | None = None
        self.head_index = len(manifest.segments) - 1
        # Seconds inside engine segments and each stateful operator (the benchmarks' step split).
        self.timings: Counter[str] = Counter()

    @property
    def profile_switches(self) -> int:
        return self.engine.profile_switches

    def prepare(self, phase: Phase, steps: list[SeqStep], rows: Sequence[SampleRow] | None,
                want_logits: bool) -> HostCtx:
        check_steps(phase, steps)
        lens = [len(s.token_ids) for s in steps]
        bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        ids = np.fromiter((t for s in steps for t in s.token_ids), np.int64, count=int(bounds[-1]))
        positions = (np.concatenate([np.arange(s.start_pos, s.start_pos + n) for s, n in zip(steps, lens)])
                     if steps else np.zeros(0, np.int64))
        pages, offsets = slot_mapping(steps, positions, bounds, self.kv_layout.page_size, self.kv_layout.num_pages)
        return HostCtx(phase, steps, bounds, ids, positions, pages, offsets, rows, want_logits)

    def inputs(self, ctx: HostCtx) -> dict[str, np.ndarray]:
        return {"input_ids": ctx.ids, "positions": ctx.positions}

    def segment(self, index: int, ctx: HostCtx, env: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        spec = self.engine.segments[index]
        out = self.engine.run(index, ctx.phase, {n: env[n] for n, _, _ in spec.inputs})
        self.timings["segments"] += time.perf_counter() - t0
        return out

    def gdn(self, layer: int, ctx: HostCtx, out: dict[str, np.ndarray]) -> np.ndarray:
        t0 = time.perf_counter()
        core = self.ops.gdn(layer, ctx.phase, ctx.steps, ctx.bounds, out["u"], out["g"], out["beta"])
        self.timings["gdn"] += time.perf_counter() - t0
        return core

    def attention(self, layer: int, ctx: HostCtx, out: dict[str, np.ndarray]) -> np.ndarray:
        t0 = time.perf_counter()
        o = self.ops.attention(layer, ctx.phase, ctx.steps, ctx.bounds, ctx.positions, ctx.pages, ctx.offsets,
                               out["q"], out["k"], out["v"])
        self.timings["attention"] += time.perf_counter() - t0
        return o

    def moe(self, layer: int, ctx: HostCtx, h: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        y = self.moe_layers[layer](h)
        self.timings["moe"] += time.perf_counter() - t0
        return y

    def head(self, ctx: HostCtx, x: np.ndarray) -> np.ndarray:
        rows = [int(ctx.bounds[i + 1]) - 1 for i, s in enumerate(ctx.steps) if s.need_logits]
        if not rows:
            return np.zeros((0, self.cfg.vocab_size), np.float32)
        t0 = time.perf_counter()
        logits = self.engine.run(self.head_index, ctx.phase, {"x": np.ascontiguousarray(x[rows])})["logits"]
        self.timings["segments"] += time.perf_counter() - t0
        return logits.copy()

    def inject_fault(self, kind: str) -> None:
        """Test-only: the next step fails with a :data:`FAULT_KINDS` fault. A CPU has no sticky device
        errors, so on this backend both are simulated (a test double at the device boundary): "sticky"
        raises :class:`DeviceLost`, "launch" a plain RuntimeError."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r}: one of {FAULT_KINDS}")
        self._fault = kind

    def execute(self, ctx: HostCtx, forward: Callable[[HostCtx], np.ndarray]) -> StepResult:
        fault, self._fault = self._fault, None
        if fault == "sticky":
            raise DeviceLost("injected device fault (simulated on the host backend)")
        if fault == "launch":
            raise RuntimeError("injected launch failure (simulated on the host backend)")
        try:
            logits = forward(ctx)
        except Exception as e:
            if self.device.startswith("cuda"):  # the CUDA operators' device: is it still usable?
                from .cuda.driver import is_sticky

                if is_sticky(e) or (health := self.ops.device_health()) is not None:  # type: ignore[attr-defined]
                    raise DeviceLost(f"{self.device} is lost: {e}", e if is_sticky(e) else health) from e
            raise
        if ctx.rows is None:
            return StepResult(np.zeros(0, np.int64), [], logits)
        rows = ctx.rows
        if len(rows) != logits.shape[0]:
            raise ValueError(f"{len(rows)} sampling rows for {logits.shape[0]} logit rows")
        t0 = time.perf_counter()
        tokens = sample(logits, [r.params for r in rows], [r.rng for r in rows])
        lps: list[TokenLogprobs | None] = [None] * len(rows)
        if any(r.logprobs is not None for r in rows):
            lps = token_logprobs(logits, tokens, [-1 if r.logprobs is None else r.logprobs for r in rows])
        self.timings["sampler"] += time.perf_counter() - t0
        return StepResult(tokens, lps, logits if ctx.want_logits else None)


def is_linear(cfg: Any, layer: int) -> bool:
    return cfg.layer_types[layer] == LINEAR
