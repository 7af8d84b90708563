"""A short run of the whole runtime on the CUDA operators, for compute-sanitizer (no PyTorch imported):

    compute-sanitizer --tool memcheck --error-exitcode 99 python3 tests/gpu/sanitize_runner.py

Builds the default model with max_seq_len 1024 in a temporary folder, then prefills three sequences in
scattered slots and pages (one of 600 tokens, so multi_block_mode=on splits both the prefill queries and
the decode steps) and runs 5 decode steps, on ``cuda`` and on ``cpu``. Exits 1 if the logits differ by
more than 1e-3 or multi-block was never used.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
from runner_cases import Driver, build_default_bundle, scattered_tables

from hybrid_runtime.config import Manifest
from hybrid_runtime.runner import ModelRunner


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        bundle = build_default_bundle(Path(tmp), max_seq_len=1024)
        m = Manifest.load(bundle)
        gpu = ModelRunner(bundle, m, device="cuda", multi_block_mode="on")
        cpu = ModelRunner(bundle, m, multi_block_mode="off")
        rng = np.random.default_rng(0)
        lens, slots, steps = [600, 40, 130], [9, 2, 14], 5
        prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in lens]
        drv = Driver([cpu, gpu], slots, scattered_tables(m, [n + steps for n in lens], seed=2), prompts)
        outs = [*(o for o in drv.prefill(chunk=80)), *(drv.decode() for _ in range(steps))]
        worst = max(float(np.abs(a - b).max()) for a, b in outs)
        plans = dict(gpu.dispatcher.plans)
        print(f"{len(outs)} steps, max |cpu - cuda| logit difference {worst:.2e}, cuda plans {plans}, "
              f"fallbacks {dict(gpu.dispatcher.fallbacks)}")
        return 0 if worst < 1e-3 and plans.get("multi_block", 0) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
