"""Model runner: executes one batch (PREFILL or DECODE) through the segment pipeline.

It owns the engine contexts and, through its :class:`~hybrid_runtime.ops.base.StatefulOps` (``ops``: numpy
on ``device="cpu"``, CUDA kernels on ``"cuda"`` / ``"cuda:N"``), the state and KV caches; it makes no policy
decisions: the scheduler decides which sequences, slots and pages; the runner computes logits. Only the
engine thread calls it (invariant 1). MoE FFNs run in numpy on the host for every device.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

import numpy as np

from .config import LINEAR, BundleError, Manifest
from .engine import Engine, Phase, load_engine
from .kv_cache import KVCache, KVLayout
from .ops.base import SeqStep, StatefulOps, make_ops
from .ops.cpu import CpuOps
from .ops.dispatcher import DecodeAttentionDispatcher
from .ops.moe import MoE
from .pipeline import plan_segments
from .state_cache import StateCache
from .weights_io import SafetensorsFile

__all__ = ["ModelRunner", "SeqStep"]  # SeqStep lives in ops.base (the operators take it too)

log = logging.getLogger("hybrid_runtime.runner")


class ModelRunner:
    """Runs batches of :class:`SeqStep` on one bundle; see :meth:`run`. ``device`` picks the stateful
    operators: ``"cpu"`` (numpy) or ``"cuda"`` / ``"cuda:N"`` (CUDA kernels on that GPU)."""

    def __init__(self, bundle_dir: str | Path, manifest: Manifest, *, pinning: str = "per_context",
                 multi_block_mode: str = "auto", num_kv_pages: int | None = None,
                 intra_op_threads: int = 0, engine: Engine | None = None, device: str = "cpu") -> None:
        self.manifest = manifest
        cfg = self.cfg = manifest.model
        lim = manifest.limits
        self.engine = engine or load_engine(bundle_dir, manifest, pinning, intra_op_threads)
        self.plans = plan_segments(cfg)
        if [p.name for p in self.plans] != [s.name for s in manifest.segments]:
            raise BundleError("bundle segments do not match this runtime's pipeline for the model config; "
                              "rebuild the bundle with this version of the builder")
        if cfg.attention_layers and not (16 <= cfg.head_dim <= 256 and cfg.head_dim % 16 == 0):
            raise BundleError(f"head_dim={cfg.head_dim}: the decode-attention kernels support multiples of 16 "
                              f"in 16..256")
        sw = SafetensorsFile(Path(bundle_dir) / manifest.state_weights)
        self.conv_w = {i: np.ascontiguousarray(sw.get(f"layers.{i}.linear_attn.conv1d")) for i in cfg.linear_layers}
        self.moe = {i: MoE(cfg, sw, i) for i in range(cfg.num_layers) if cfg.ffn_types[i] == "moe"}
        pages = num_kv_pages or lim.num_kv_pages
        self.kv_layout = KVLayout(pages, lim.page_size, cfg.num_kv_heads, cfg.head_dim, np.float32,
                                  len(cfg.attention_layers))
        self.ops: StatefulOps = make_ops(device, cfg, self.conv_w, lim.num_state_slots, self.kv_layout,
                                         multi_block_mode)
        # Seconds spent inside engine segments and inside each stateful operator (for the benchmarks'
        # "time outside numpy/onnxruntime" figure); a few perf_counter calls per segment.
        self.timings: Counter[str] = Counter()

    # ---- the operators' state ---------------------------------------------------------------------
    @property
    def device(self) -> str:
        return self.ops.device

    @property
    def dispatcher(self) -> DecodeAttentionDispatcher:
        """The decode-attention dispatcher of the operators' device (plans, fallbacks, errors)."""
        return self.ops.dispatcher

    def _cpu_ops(self, what: str) -> CpuOps:
        if not isinstance(self.ops, CpuOps):
            raise AttributeError(f"runner.{what} holds host buffers of the cpu operators; on {self.ops.device} use "
                                 f"runner.ops (reset_slot, state_arrays, kv_arrays)")
        return self.ops

    @property
    def state(self) -> StateCache:
        """The host :class:`StateCache` (cpu only)."""
        return self._cpu_ops("state").state

    @property
    def kv(self) -> KVCache:
        """The host :class:`KVCache` (cpu only)."""
        return self._cpu_ops("kv").kv

    # ------------------------------------------------------------------------------------------
    def run(self, phase: Phase, steps: list[SeqStep]) -> np.ndarray:
        """Logits ``[n, vocab]`` float32 for the steps with ``need_logits`` (in order; n may be 0).

        PREFILL: each step is a chunk of one prompt. DECODE: each step is exactly one token.
        """
        lens = [len(s.token_ids) for s in steps]
        if phase == Phase.DECODE and any(n != 1 for n in lens):
            raise ValueError("a DECODE batch carries exactly one token per sequence")
        bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        ids = np.fromiter((t for s in steps for t in s.token_ids), np.int64, count=int(bounds[-1]))
        positions = np.concatenate([np.arange(s.start_pos, s.start_pos + n) for s, n in zip(steps, lens)])
        pages, offsets = self._slot_mapping(steps, positions, bounds)
        env: dict[str, np.ndarray] = {"input_ids": ids, "positions": positions}
        clock, tm = time.perf_counter, self.timings
        for si, plan in enumerate(self.plans[:-1]):
            t0 = clock()
            out = self.engine.run(si, phase, {n: env[n] for n, _, _ in plan.inputs})
            t1 = clock()
            tm["segments"] += t1 - t0
            env["x"] = out["x_next"]
            kind, layer = plan.exit
            if kind == "mixer" and self.cfg.layer_types[layer] == LINEAR:
                env["mix_core"] = self.ops.gdn(layer, phase, steps, bounds, out["u"], out["g"], out["beta"])
                env["mix_z"] = out["z"]
                tm["gdn"] += clock() - t1
            elif kind == "mixer":
                env["mix_attn"] = self.ops.attention(layer, phase, steps, bounds, positions, pages, offsets,
                                                     out["q"], out["k"], out["v"])
                env["mix_gate"] = out["gate"]
                tm["attention"] += clock() - t1
            elif kind == "moe":
                env["ffn_out"] = self.moe[layer](out["h"])
                tm["moe"] += clock() - t1
        rows = [int(bounds[i + 1]) - 1 for i, s in enumerate(steps) if s.need_logits]
        if not rows:
            return np.zeros((0, self.cfg.vocab_size), np.float32)
        t0 = clock()
        logits = self.engine.run(len(self.plans) - 1, phase, {"x": np.ascontiguousarray(env["x"][rows])})["logits"]
        tm["segments"] += clock() - t0
        return logits.copy()

    def _slot_mapping(self, steps: list[SeqStep], positions: np.ndarray, bounds: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
        """(page, offset) of every token of the batch, computed once per step for all attention layers."""
        ps = self.kv_layout.page_size
        pages = np.empty(len(positions), np.int64)
        for i, s in enumerate(steps):
            a, b = int(bounds[i]), int(bounds[i + 1])
            need = -(-(s.start_pos + b - a) // ps)
            if need > len(s.page_table):
                raise IndexError(f"page table of {len(s.page_table)} pages does not cover {s.start_pos + b - a} tokens")
            pages[a:b] = np.asarray(s.page_table, np.int64)[positions[a:b] // ps]
        if len(pages) and (pages.min() < 0 or pages.max() >= self.kv_layout.num_pages):
            raise IndexError(f"page index outside the pool of {self.kv_layout.num_pages} pages")
        return pages, positions % ps
