"""CPU benchmark of GPTQ weight-only int4 / int8 against fp32, the same model shape, in one run.

The model is ``make bench``'s ``qwen3-next-334m`` shape (seeded random weights). Its GPTQ checkpoints are
written by the tests' round-to-nearest packer (``tests/gptq_pack.py``; group size 128, symmetric, v1
format, every linear of the layers quantized, lm_head, router and shared-expert gate float, as a GPTQ
quantiser leaves them). Variants, each a bundle of its own:

* ``fp32``: the float checkpoint (what ``make bench`` measures);
* ``int4 a-fp32``: MatMulNBits with float32 activations (``--quant-activations fp32``: parity with the
  float model of the dequantised weights);
* ``int4 a-int8`` / ``int8 a-int8``: MatMulNBits with int8 activations (``--quant-activations int8``, MLAS's
  integer kernels); ``+ lm_head``: the GPTQ checkpoint also quantizes lm_head (``lm_head: true``; the
  32000 x 1024 head is 131 MB in float32, the largest single weight read per decode step);
* transformers fp32 on the float checkpoint: the same-run reference figure.

Workload and measurement are ``benchmarks/offline.py``'s (its workers, each number from its own process,
variants alternated ``--repeats`` times, best of the repeats with the spread). Beside them, per variant, the
median and the fastest single decode step at batch 1 (the runner driven directly: a 128-token prefill, then
64 greedy steps, each timed): on a shared machine the median step says what a burst of other load does
not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import offline

VARIANTS = {  # name -> (bits, activations, lm_head quantized); bits 0 = the float checkpoint
    "fp32": (0, "fp32", False),
    "int4 a-fp32": (4, "fp32", False),
    "int4 a-int8": (4, "int8", False),
    "int4 a-int8 + lm_head": (4, "int8", True),
    "int8 a-int8": (8, "int8", False),
}
MODEL = "qwen3-next-334m"


def _prepare(root: Path, variant: str) -> Path:
    from builder.bundle import BuildOptions, build_bundle
    from tests.gptq_pack import write_gptq_checkpoint

    ckpt, _ = offline._prepare(root, MODEL)
    bits, act, head = VARIANTS[variant]
    if not bits:
        return root / f"{MODEL}_bundle"
    tag = f"gptq{bits}{'_head' if head else ''}"
    qckpt = root / f"{MODEL}_{tag}_ckpt"
    if not (qckpt / "config.json").exists():
        write_gptq_checkpoint(ckpt, qckpt, None, bits=bits, group_size=128, sym=True, fmt="gptq", lm_head=head)
    bundle = root / f"{MODEL}_{tag}_{act}_bundle"
    if not (bundle / "manifest.json").exists():
        build_bundle(qckpt, bundle, BuildOptions(max_batch_size=max(offline.BATCHES), max_input_len=offline.PREFILL_LEN,
                                                 max_seq_len=2 * offline.PREFILL_LEN, max_num_tokens=512,
                                                 quant_activations=act), progress=lambda _m: None)
    return bundle


def worker_steps(bundle: Path) -> dict:
    """Batch 1 through the runner: per-step decode times (after a 128-token prefill and 4 warm steps)."""
    import numpy as np

    from hybrid_runtime.config import Manifest
    from hybrid_runtime.engine import Phase
    from hybrid_runtime.runner import ModelRunner, SeqStep

    runner = ModelRunner(bundle, Manifest.load(bundle))
    prompt = offline._prompts(1, offline.PROMPT, 1, runner.cfg.vocab_size)[0]
    pages = list(range(0, 2 * offline.PREFILL_LEN // 16))
    runner.state.reset(0)
    t0 = time.perf_counter()
    tok = int(np.argmax(runner.run(Phase.PREFILL, [SeqStep(0, pages, 0, prompt)])[0]))
    prefill = time.perf_counter() - t0
    times = []
    for t in range(offline.NEW):
        t0 = time.perf_counter()
        tok = int(np.argmax(runner.run(Phase.DECODE, [SeqStep(0, pages, offline.PROMPT + t, [tok])])[0]))
        times.append(time.perf_counter() - t0)
    steps = sorted(times[4:])
    return {"median_ms": 1e3 * steps[len(steps) // 2], "best_ms": 1e3 * steps[0], "prefill_s": prefill}


def _spawn_steps(bundle: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.quantized", "--worker-steps", str(bundle)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("build/bench"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps-only", action="store_true",
                    help="only the per-step batch-1 decode times (no offline workers, no transformers)")
    ap.add_argument("--ops", action="store_true",
                    help="only the per-call times of layer 0's MoE operator, a post_mixer segment and the head, "
                         "at 1 and 4 tokens (median of 30 calls in this process)")
    ap.add_argument("--worker-steps", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_steps:
        print(json.dumps(worker_steps(args.worker_steps)))
        return 0
    if args.steps_only:
        return _steps_table(args)
    if args.ops:
        return _ops_table(args)
    batches = tuple(int(b) for b in args.batches.split(","))
    bundles = {v: _prepare(args.root, v) for v in VARIANTS}
    ckpt = args.root / f"{MODEL}_ckpt"
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.repeats):  # alternate variants so slow phases of a shared machine hit all of them
        for b in batches:
            for v, bundle in bundles.items():
                runs.setdefault((v, b), []).append(offline._spawn("ours", bundle, b))
                if b == 1:
                    runs[(v, b)][-1].update(_spawn_steps(bundle))
                print(v, b, runs[(v, b)][-1], flush=True)
            runs.setdefault(("transformers fp32", b), []).append(offline._spawn("transformers", ckpt, b))
    header = ("| variant | batch | decode tok/s | vs our fp32 | prefill tok/s | vs our fp32 | prefill 4 x 256 tok/s | "
              "peak RSS GB | bundle MB | b1 decode step median / best ms | median vs our fp32 |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for b in batches:
        base = runs[("fp32", b)]
        for v in [*VARIANTS, "transformers fp32"]:
            rs = runs[(v, b)]
            size = "" if v.startswith("transformers") else \
                f"{sum(p.stat().st_size for p in bundles[v].rglob('*') if p.is_file()) / 1e6:.0f}"
            longp = offline._cell([r["prefill_long_tps"] for r in rs]) if "prefill_long_tps" in rs[0] else ""
            med = lambda rs: min(r["median_ms"] for r in rs)  # noqa: E731
            step = (f"{med(rs):.1f} / {min(r['best_ms'] for r in rs):.1f}", f"**{med(base) / med(rs):.2f}x**") \
                if "median_ms" in rs[0] else ("", "")
            cells = [v, str(b), offline._cell([r["decode_tps"] for r in rs], "{:.1f}"),
                     f"**{max(r['decode_tps'] for r in rs) / max(r['decode_tps'] for r in base):.2f}x**",
                     offline._cell([r["prefill_tps"] for r in rs]),
                     f"{max(r['prefill_tps'] for r in rs) / max(r['prefill_tps'] for r in base):.2f}x",
                     longp, f"{min(r['peak_rss'] for r in rs) / 1e9:.2f}", size, *step]
            rows.append("| " + " | ".join(cells) + " |")
    table = header + "\n" + "\n".join(rows)
    print("\n" + table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        cmd = f"python -m benchmarks.quantized --repeats {args.repeats} --batches {args.batches} --out {args.out}"
        args.out.write_text(f"Command: {cmd}\n\n{table}\n")
    return 0


def _steps_table(args: argparse.Namespace) -> int:
    bundles = {v: _prepare(args.root, v) for v in VARIANTS}
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for v, bundle in bundles.items():
            runs.setdefault(v, []).append(_spawn_steps(bundle))
            print(v, runs[v][-1], flush=True)
    med = {v: min(r["median_ms"] for r in rs) for v, rs in runs.items()}
    rows = [f"| {v} | {med[v]:.1f} | {min(r['best_ms'] for r in rs):.1f} | **{med['fp32'] / med[v]:.2f}x** | "
            f"{offline.PROMPT / min(r['prefill_s'] for r in rs):.0f} |" for v, rs in runs.items()]
    table = ("| variant | b1 decode step median ms | best step ms | median vs our fp32 | prefill 128 tok/s |\n"
             "|---|---|---|---|---|\n" + "\n".join(rows))
    print("\n" + table)
    if args.out:
        cmd = f"python -m benchmarks.quantized --steps-only --repeats {args.repeats} --out {args.out}"
        with open(args.out, "a") as f:
            f.write(f"\nCommand: {cmd}\n\n{table}\n")
    return 0


def _ops_table(args: argparse.Namespace) -> int:
    import numpy as np

    from hybrid_runtime.config import Manifest
    from hybrid_runtime.engine.ort_session import cpu_session, session_options
    from hybrid_runtime.ops.moe import MoE
    from hybrid_runtime.weights_io import SafetensorsFile

    session_options(0)

    def median_ms(fn) -> float:
        for _ in range(5):
            fn()
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts))

    rows = []
    for v in VARIANTS:
        bundle = _prepare(args.root, v)
        m = Manifest.load(bundle)
        moe = MoE(m.model, SafetensorsFile(bundle / m.state_weights), 0)
        specs = {s.name: s for s in m.segments if s.name in ("post_mixer0", "head")}
        sessions = {n: cpu_session(bundle / s.onnx, session_options(None)) for n, s in specs.items()}
        cells = []
        for T in (1, 4):
            h = np.random.default_rng(0).standard_normal((T, m.model.hidden_size)).astype(np.float32)
            cells.append(median_ms(lambda h=h, moe=moe: moe(h)))
            for n, sess in sessions.items():
                feeds = {i: np.random.default_rng(0).standard_normal((T, w)).astype(np.float32)
                         for i, _, w in specs[n].inputs}
                cells.append(median_ms(lambda sess=sess, feeds=feeds: sess.run(None, feeds)))
        rows.append(f"| {v} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
        print(rows[-1], flush=True)
    table = ("| variant | MoE layer, 1 token ms | post_mixer0, 1 | head, 1 | MoE, 4 tokens | post_mixer0, 4 | "
             "head, 4 |\n"
             "|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    print("\n" + table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\nCommand: python -m benchmarks.quantized --ops --out {args.out}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
