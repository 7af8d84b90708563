#!/usr/bin/env python3
"""TensorRT smoke test for a machine with an NVIDIA GPU: TensorRT tokens == CPU tokens.

Needs full TensorRT (``pip install tensorrt-cu12 cuda-python``; any GPU TensorRT supports) or TensorRT-RTX
(``pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings cuda-python``; an RTX GPU, sm_75..sm_121).
No machine of this project's CI has either, so this script is run by hand::

    .venv/bin/python scripts/trt_smoke.py                 # float32 plans, both pinning modes
    .venv/bin/python scripts/trt_smoke.py --dtype float16 --min-agreement 0.9

It writes the embedded default model, builds it twice with the same limits -- ``--backend onnxruntime``
and ``--backend tensorrt`` (for the current GPU) -- runs the same greedy requests through both with the
serving loop (continuous batching, so PREFILL and DECODE steps interleave), and compares the generated
token ids request by request. It also checks invariant 2 on the real backend: no profile switch with
``per_context``, switches counted with ``single_context``. Exit status: 0 all good, 1 tokens differ or an
invariant failed, 2 TensorRT / GPU / cuda-python missing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from builder.bundle import BuildOptions, build_bundle
from builder.default_model import write_default_checkpoint
from hybrid_runtime import trt_compat
from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine, generate

PROMPTS = (
    "The quick brown fox",
    "Serving hybrid models needs state slots.",
    "Once upon a time",
    "In the beginning there was",
    "Linear attention keeps a fixed-size state while",
    "A",
)


def preflight() -> str | None:
    """None when TensorRT, cuda-python and a GPU are all there; else what is missing and how to fix it."""
    try:
        tk = trt_compat.load()
    except trt_compat.TensorRTUnavailable as e:
        return str(e)
    try:
        trt_compat.cuda_driver_module()
    except ImportError as e:
        return str(e)
    cc = trt_compat.current_compute_capability()
    if cc is None:
        return (f"{tk.display} is installed but no CUDA GPU is visible (driver missing, or CUDA_VISIBLE_DEVICES "
                "hides it); this smoke test executes TensorRT plans and needs one")
    if tk.flavor == trt_compat.RTX and trt_compat.arch_name(*cc) not in trt_compat.supported_arches(tk):
        return (f"{tk.display} does not support this GPU ({trt_compat.arch_name(*cc)}); install full TensorRT "
                "(`pip install tensorrt-cu12`) for data-center GPUs")
    return None


def run(bundle: Path, pinning: str, requests: list[GenerationRequest]) -> tuple[dict[str, tuple[int, ...]], int]:
    """Generate through the serving loop; returns each request's output ids and the engine's profile switches."""
    engine = ServingEngine(bundle, RuntimeOptions(profile_pinning=pinning)).start()
    try:
        events = generate(engine, requests)
        switches = engine.runner.engine.profile_switches
    finally:
        engine.shutdown()
    errors = [e for e in events if e.finish_reason == "error"]
    if errors:
        raise SystemExit(f"error: {bundle} ({pinning}): {errors[0].request_id}: {errors[0].error}")
    return {e.request_id: e.output_ids for e in events}, switches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("build/trt_smoke"), help="checkpoint and bundles go here")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--max-batch-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=12, help="tokens generated per request")
    ap.add_argument("--min-agreement", type=float, default=1.0,
                    help="fraction of requests whose tokens must match exactly (lower it for half precision)")
    args = ap.parse_args(argv)

    missing = preflight()
    if missing:
        print(f"trt_smoke: cannot run here: {missing}", file=sys.stderr)
        return 2
    tk = trt_compat.load()
    arch = trt_compat.arch_name(*trt_compat.current_compute_capability())  # type: ignore[misc]
    print(f"trt_smoke: {tk.display} on {arch}, plans in {args.dtype}")

    work = args.workdir
    ckpt = work / "checkpoint"
    if not (ckpt / "config.json").is_file():
        write_default_checkpoint(ckpt, progress=lambda _m: None)
    limits = {"max_batch_size": args.max_batch_size, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 32}
    t0 = time.perf_counter()
    build_bundle(ckpt, work / "cpu", BuildOptions(**limits), progress=lambda _m: None)
    build_bundle(ckpt, work / "trt", BuildOptions(backend="tensorrt", dtype=args.dtype, **limits),
                 progress=lambda m: print(f"  [builder] {m}"))
    print(f"trt_smoke: bundles built in {time.perf_counter() - t0:.1f} s")

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    requests = [GenerationRequest(f"r{i}", prompt=p, params=params) for i, p in enumerate(PROMPTS)]
    want, _ = run(work / "cpu", "per_context", requests)
    ok = True
    for pinning in ("per_context", "single_context"):
        got, switches = run(work / "trt", pinning, requests)
        same = [rid for rid in want if got.get(rid) == want[rid]]
        agreement = len(same) / len(want)
        for rid in want:
            mark = "ok  " if rid in same else "DIFF"
            print(f"  {pinning:15s} {mark} {rid}: cpu {list(want[rid])}\n  {'':15s}      {rid}: trt {list(got[rid])}")
        print(f"trt_smoke: {pinning}: {len(same)}/{len(want)} requests match the CPU backend; "
              f"profile switches {switches}")
        if agreement < args.min_agreement:
            ok = False
        if pinning == "per_context" and switches != 0:
            print("trt_smoke: FAIL: per_context switched optimization profiles while serving")
            ok = False
        if pinning == "single_context" and switches == 0:
            print("trt_smoke: FAIL: single_context counted no profile switch on a mixed workload")
            ok = False
    print("trt_smoke: PASS" if ok else "trt_smoke: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
