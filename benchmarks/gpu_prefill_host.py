"""Host against GPU in one prefill step of the ``cuda`` backend: is a short prompt's TTFT the host's or the GPU's?

    python3 -m benchmarks.gpu_prefill_host --bits 4 --packed experts --tokens 1024 [--torch]

gpu_prefill's 40-layer Qwen3.5-35B-A3B model (``--bits 16``: bf16; 4 / 8: GPTQ layouts, ``--packed``), one prompt of
``--tokens`` per step, ``--steps`` steps after two warm-up steps. Per step: the wall clock of ``runner.step``, the
host's enqueue time (until the step's first device-to-host copy is issued: every launch is in the stream by then),
and the GPU span from an event recorded before the step to one recorded at that copy (no events in between, so
programmatic dependent launches keep their overlap). Enqueue close to the wall: the host is the limit; well below:
the GPU. ``--torch`` initialises torch's CUDA and runs its matmul first, as gpu_prefill does."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=4, choices=(16, 4, 8))
    ap.add_argument("--packed", choices=("all", "experts"), default="experts")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--max-seq", type=int, default=8192 + 128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--torch", action="store_true")
    a = ap.parse_args()
    import numpy as np

    from benchmarks import gpu_prefill as gp
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.engine import Phase
    from hybrid_runtime.runner import SampleRow
    from hybrid_runtime.sampling import SamplingParams

    if a.torch:
        import torch

        torch.cuda.init()
        gp.log(f"bf16 matmul {gp.matmul_rate(torch) / 1e12:.0f} TFLOP/s")
    be, runner, _ = gp.build(40, 8192, a.max_seq, 8, a.bits, 128, a.packed)
    dev = be.dev
    rng = np.random.default_rng(0)
    perm = rng.permutation(be.num_pages).tolist()
    ids = rng.integers(0, be.cfg.vocab_size, a.tokens).tolist()
    (step,) = gp.prompt_steps([(0, perm[:-(-(a.tokens + 1) // gp.PAGE)], ids)], 8192)
    e0, e1 = dev.event(), dev.event()
    mark: dict[str, float] = {}
    real = CudaDevice.copy_dtoh

    def copy_dtoh(self: Any, host_ptr: int, src: int, nbytes: int) -> None:
        if "enq" not in mark:
            mark["enq"] = time.perf_counter()
            self.record(e1)
        real(self, host_ptr, src, nbytes)

    CudaDevice.copy_dtoh = copy_dtoh  # type: ignore[method-assign]
    rows = []
    for i in range(2 + a.steps):
        for st in step:
            be.reset_slot(st.slot)
        dev.synchronize()
        mark.clear()
        dev.record(e0)
        t = time.perf_counter()
        runner.step(Phase.PREFILL, step, [SampleRow(SamplingParams())])
        wall = time.perf_counter() - t
        if i >= 2:
            rows.append((wall * 1e3, (mark["enq"] - t) * 1e3, dev.elapsed_ms(e0, e1)))
    name = "bf16" if a.bits == 16 else f"int{a.bits} packed {a.packed}"
    for what, col in (("wall", 0), ("host enqueue", 1), ("GPU span", 2)):
        v = sorted(r[col] for r in rows)
        print(f"{name}, {a.tokens} tokens: {what} min {v[0]:.1f} / median {statistics.median(v):.1f} / "
              f"max {v[-1]:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
