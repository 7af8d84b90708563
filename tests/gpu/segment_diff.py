"""Where two runners part: every pipeline piece of one step, host backend vs ``cuda`` backend, compared.

``piece_diffs(cpu, gpu, phase, steps)`` runs the step on both runners with their backends' pieces wrapped, and
returns ``(piece, output, max |cpu - gpu|, max |cpu|)`` in pipeline order (segments by name, then gdn /
attention / moe / head). A debugging aid for the GPU tests: the first large difference names the culprit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybrid_runtime.engine import Phase
from hybrid_runtime.runner import ModelRunner, SeqStep


def _wrap(runner: ModelRunner, log: list[tuple[str, str, np.ndarray | None]], to_host: Any) -> None:
    be = runner.backend
    names = [p.name for p in runner.plans]
    rows = {}

    def seg(index: int, ctx: Any, env: dict) -> dict:
        out = type(be).segment(be, index, ctx, env)
        rows["n"] = getattr(ctx, "n_real", None)
        for k, v in out.items():
            if k not in ("k", "v") or v is not None:
                log.append((names[index], k, to_host(v)))
        return out

    def piece(kind: str):
        def f(layer: int, ctx: Any, arg: Any) -> Any:
            res = getattr(type(be), kind)(be, layer, ctx, arg)
            log.append((f"{kind}{layer}", "out", to_host(res)))
            return res
        return f

    be.segment = seg  # type: ignore[method-assign]
    for kind in ("gdn", "attention", "moe"):
        setattr(be, kind, piece(kind))


def piece_diffs(cpu: ModelRunner, gpu: ModelRunner, phase: Phase, steps: list[SeqStep]
                ) -> list[tuple[str, str, float, float]]:
    a: list[tuple[str, str, np.ndarray | None]] = []
    b: list[tuple[str, str, np.ndarray | None]] = []
    n = sum(len(s.token_ids) for s in steps)
    _wrap(cpu, a, lambda v: None if v is None else np.asarray(v, np.float32))
    _wrap(gpu, b, lambda v: gpu.backend.to_host(v, rows=n))  # type: ignore[attr-defined]
    cpu.run(phase, steps)
    gpu.run(phase, steps)
    got = {(pb, nb): xb for pb, nb, xb in b}
    out = []
    for pa, na, xa in a:
        xb = got.get((pa, na))
        if xa is None or xb is None:
            continue
        xb = xb[:xa.shape[0]].reshape(xa.shape) if xb.size >= xa.size else xb
        err = float(np.abs(xa - xb).max()) if xa.shape == xb.shape else float("inf")
        out.append((pa, na, err, float(np.abs(xa).max()) if xa.size else 0.0))
    return out
