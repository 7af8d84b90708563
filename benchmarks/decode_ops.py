"""Decode step time of the whole runtime with the numpy vs the CUDA stateful operators.

    python3 -m benchmarks.decode_ops [--batch 16] [--steps 50] [--devices cpu,cuda] [--out FILE]

Default model (built into a temporary folder, max batch 16), ``batch`` sequences with 64-token prompts,
then ``steps`` timed DECODE steps of ``ModelRunner.run`` after 5 warm-up steps. BLAS is limited to one
thread, as in the serving process. Reports the mean wall time per step and its split (``runner.timings``):
engine segments (onnxruntime), GDN, attention, MoE (numpy on host for every device), rest = Python.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from builder.bundle import BuildOptions, build_bundle
from builder.default_model import write_default_checkpoint
from hybrid_runtime.config import Manifest
from hybrid_runtime.engine import Phase
from hybrid_runtime.runner import ModelRunner, SeqStep

PROMPT = 64


def bench(bundle: Path, device: str, batch: int, steps: int) -> dict[str, float]:
    """Mean seconds per decode step, total and per part."""
    m = Manifest.load(bundle)
    runner = ModelRunner(bundle, m, device=device)
    ps = m.limits.page_size
    per_seq = -(-(PROMPT + steps + 8) // ps)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    rng = np.random.default_rng(0)
    toks = [rng.integers(3, m.model.vocab_size, PROMPT).tolist() for _ in range(batch)]
    per_prefill = max(1, m.limits.max_num_tokens // PROMPT)
    last = np.zeros(batch, np.int64)
    for s in range(batch):
        runner.ops.reset_slot(s)
    for a in range(0, batch, per_prefill):
        idx = range(a, min(batch, a + per_prefill))
        out = runner.run(Phase.PREFILL, [SeqStep(i, tables[i], 0, toks[i]) for i in idx])
        last[list(idx)] = out.argmax(-1)
    pos = PROMPT

    def step() -> None:
        nonlocal pos, last
        out = runner.run(Phase.DECODE, [SeqStep(i, tables[i], pos, [int(last[i])]) for i in range(batch)])
        last, pos = out.argmax(-1), pos + 1

    for _ in range(5):
        step()
    runner.timings.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    total = (time.perf_counter() - t0) / steps
    parts = {k: v / steps for k, v in runner.timings.items()}
    return {"total": total, **parts, "rest": total - sum(parts.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--devices", default="cpu,cuda")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cols = ["total", "segments", "gdn", "attention", "moe", "rest"]
    lines = [f"Decode step, default model, batch {args.batch}, mean of {args.steps} steps (ms)", "",
             "| ops | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    with tempfile.TemporaryDirectory() as tmp, threadpool_limits(limits=1, user_api="blas"):
        ckpt, bundle = Path(tmp) / "ckpt", Path(tmp) / "bundle"
        write_default_checkpoint(ckpt, progress=lambda _m: None)
        build_bundle(ckpt, bundle, BuildOptions(max_batch_size=16, max_input_len=384, max_seq_len=512,
                                                max_num_tokens=256), progress=lambda _m: None)
        for dev in args.devices.split(","):
            r = bench(bundle, dev, args.batch, args.steps)
            lines.append(f"| {dev} | " + " | ".join(f"{1e3 * r.get(c, 0.0):.3f}" for c in cols) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
