"""Shared by the CUDA runner tests, the sanitizer workload and the decode benchmark: bundles of the
default model, page tables, and driving a :class:`ModelRunner` through prefill chunks and decode steps.

No PyTorch here, so the sanitizer workload reports only our own kernels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybrid_runtime.config import Manifest
from hybrid_runtime.engine import Phase
from hybrid_runtime.runner import ModelRunner, SeqStep


def build_default_bundle(root: Path, max_seq_len: int = 512, max_input_len: int = 384,
                         checkpoint: Path | None = None) -> Path:
    """The default model built with max batch 16, 256-token prefills under ``root``, from ``checkpoint``
    (default: the default checkpoint, written under ``root`` if missing)."""
    from builder.bundle import BuildOptions, build_bundle
    from builder.default_model import write_default_checkpoint

    ckpt, out = checkpoint or root / "ckpt", root / f"bundle_{max_seq_len}"
    if not (ckpt / "config.json").exists():
        write_default_checkpoint(ckpt, progress=lambda _m: None)
    build_bundle(ckpt, out, BuildOptions(max_batch_size=16, max_input_len=max_input_len, max_seq_len=max_seq_len,
                                         max_num_tokens=256), progress=lambda _m: None)
    return out


def scattered_tables(manifest: Manifest, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Disjoint, shuffled (non-contiguous) page tables covering ``lengths[i]`` tokens each."""
    ps = manifest.limits.page_size
    need = [-(-n // ps) for n in lengths]
    perm = np.random.default_rng(seed).permutation(manifest.limits.num_kv_pages)
    if sum(need) > len(perm):
        raise ValueError(f"{sum(need)} pages needed, the pool has {len(perm)}")
    starts = np.cumsum([0, *need])
    return [perm[starts[i]:starts[i + 1]].tolist() for i in range(len(lengths))]


class Driver:
    """Runs the same sequences through several runners in lockstep (greedy tokens from the first one).

    ``slots[i]`` / ``tables[i]`` / ``prompts[i]``: sequence i's state slot, page table and prompt ids.
    Prefill goes in rounds of ``chunk`` tokens per sequence (all unfinished prompts in one PREFILL batch);
    decode steps then feed every sequence its last greedy token.
    """

    def __init__(self, runners: list[ModelRunner], slots: list[int], tables: list[list[int]],
                 prompts: list[list[int]]) -> None:
        self.runners, self.slots, self.tables, self.prompts = runners, slots, tables, prompts
        self.pos = [0] * len(slots)
        self.next_tok = [-1] * len(slots)
        for r in runners:
            for s in slots:
                r.ops.reset_slot(s)

    def _run(self, phase: Phase, steps: list[SeqStep]) -> list[np.ndarray]:
        return [r.run(phase, steps) for r in self.runners]

    def prefill(self, chunk: int) -> list[list[np.ndarray]]:
        """Every prompt in ``chunk``-token pieces; returns per round the logits ``[n, vocab]`` of each runner."""
        rounds = []
        while any(p < len(pr) for p, pr in zip(self.pos, self.prompts)):
            idx = [i for i, pr in enumerate(self.prompts) if self.pos[i] < len(pr)]
            steps = [SeqStep(self.slots[i], self.tables[i], self.pos[i],
                             self.prompts[i][self.pos[i]:self.pos[i] + chunk]) for i in idx]
            outs = self._run(Phase.PREFILL, steps)
            for row, (i, st) in enumerate(zip(idx, steps)):
                self.pos[i] += len(st.token_ids)
                self.next_tok[i] = int(np.argmax(outs[0][row]))
            rounds.append(outs)
        return rounds

    def decode(self) -> list[np.ndarray]:
        """One DECODE step of every sequence; returns each runner's logits ``[B, vocab]``."""
        steps = [SeqStep(s, t, p, [tok]) for s, t, p, tok in zip(self.slots, self.tables, self.pos, self.next_tok)]
        outs = self._run(Phase.DECODE, steps)
        self.pos = [p + 1 for p in self.pos]
        self.next_tok = [int(t) for t in np.argmax(outs[0], axis=-1)]
        return outs


def cpu_logits(runner: ModelRunner, ids: list[int], chunk: int = 256, slot: int = 0) -> np.ndarray:
    """Logits ``[vocab]`` after ``ids`` on a fresh slot (prefill in ``chunk``-token pieces)."""
    runner.ops.reset_slot(slot)
    table = list(range(-(-len(ids) // runner.kv_layout.page_size)))
    out = None
    for start in range(0, len(ids), chunk):
        out = runner.run(Phase.PREFILL, [SeqStep(slot, table, start, ids[start:start + chunk])])[0]
    assert out is not None
    return out
