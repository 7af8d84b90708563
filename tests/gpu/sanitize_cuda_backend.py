"""A short serving workload on the ``cuda`` bundle backend with CUDA graphs on, for compute-sanitizer (no
PyTorch imported):

    compute-sanitizer --tool memcheck --error-exitcode 99 python3 tests/gpu/sanitize_cuda_backend.py
    compute-sanitizer --tool racecheck --error-exitcode 99 python3 tests/gpu/sanitize_cuda_backend.py --small
    compute-sanitizer --tool memcheck --error-exitcode 99 python3 tests/gpu/sanitize_cuda_backend.py --gptq

Builds the default model as a bfloat16 ``cuda`` bundle in a temporary folder (``--gptq``: its weights quantized to a
GPTQ int4 checkpoint first, asymmetric, groups of 32, by the tests' packer, so the decode steps run the packed
projections and experts of ``packed_weights=auto``), captures its decode graphs, and
serves a staggered mix of greedy, sampled and logprob requests (prompts crossing pages, one long enough that
multi_block_mode=on splits its decode attention). Exits 1 unless every request finished with its full length
and some decode steps replayed graphs (``--gptq``: and the packed decode GEMMs and experts were launched, no GEMM
dequantised first).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hybrid_runtime.config import Manifest
from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.serving import Event, GenerationRequest, RuntimeOptions, ServingEngine


def main() -> int:
    small, gptq = "--small" in sys.argv, "--gptq" in sys.argv
    from builder.bundle import BuildOptions, build_bundle
    from builder.default_model import write_default_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt, bundle = Path(tmp) / "ckpt", Path(tmp) / "cuda"
        write_default_checkpoint(ckpt, progress=lambda _m: None)
        if gptq:
            sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
            from tests.gptq_pack import write_gptq_checkpoint

            write_gptq_checkpoint(ckpt, Path(tmp) / "gptq", None, bits=4, group_size=32, sym=False, fmt="gptq_v2")
            ckpt = Path(tmp) / "gptq"
        build_bundle(ckpt, bundle, BuildOptions(backend="cuda", dtype="bfloat16", max_batch_size=8, max_input_len=300,
                                                max_seq_len=384, max_num_tokens=128), progress=lambda _m: None)
        vocab = Manifest.load(bundle).model.vocab_size
        eng = ServingEngine(bundle, RuntimeOptions(device="cuda", multi_block_mode="on")).start()
        rng = np.random.default_rng(0)
        n = 4 if small else 10
        lens = [int(x) for x in rng.integers(5, 90, n)]
        lens[0] = 250  # split decode attention
        params = [SamplingParams(max_tokens=6 if small else 12, ignore_eos=True),
                  SamplingParams(max_tokens=6 if small else 12, ignore_eos=True, temperature=0.8, top_k=20, seed=3),
                  SamplingParams(max_tokens=6 if small else 12, ignore_eos=True, temperature=1.1, top_p=0.7)]
        finals: dict[str, Event] = {}
        for i, k in enumerate(lens):
            eng.submit(GenerationRequest(f"r{i}", prompt_ids=tuple(int(t) for t in rng.integers(3, vocab, k)),
                                         params=params[i % 3]), lambda ev: finals.__setitem__(ev.request_id, ev)
                       if ev.final else None)
            time.sleep(0.01)
        deadline = time.monotonic() + 600
        while len(finals) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        be = eng.runner.backend
        stats = be.graph_stats.snapshot()  # type: ignore[attr-defined]
        packed = {"nbits_calls": be.nbits_calls, "nbits_fallbacks": be.nbits_fallbacks,  # type: ignore[attr-defined]
                  "moe_nbits_calls": be.moe_nbits_calls}  # type: ignore[attr-defined]
        eng.shutdown()
        ok = len(finals) == n and all(f.finish_reason == "length" for f in finals.values())
        if gptq:
            ok = ok and packed["nbits_calls"] > 0 and packed["moe_nbits_calls"] > 0 and not packed["nbits_fallbacks"]
        print(f"{len(finals)}/{n} requests finished ({sorted({f.finish_reason for f in finals.values()})}); graphs "
              f"{stats}; plans {dict(eng.runner.dispatcher.plans)}; packed {packed}")
        return 0 if ok and stats["replays"] else 1


if __name__ == "__main__":
    sys.exit(main())
