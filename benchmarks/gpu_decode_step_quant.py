"""A whole decode step of the ``cuda`` backend on the released Qwen3.5-35B-A3B text shape with GPTQ-quantized
weights, against the same step in bf16 and each against its weight-read floor measured in the same run.

    python3 -m benchmarks.gpu_decode_step_quant --out benchmarks/results/gpu_decode_step_quant_h200.md

Model: gpu_decode_step's (40 layers: 30 Gated DeltaNet + 10 gated attention, 256 experts top-8 + a folded shared
expert). Quantized: :meth:`DeviceWeights.random_packed` - the layout a symmetric GPTQ bundle loads into with
``packed_linears`` and ``packed_experts`` (every dense projection and every MoE layer's experts kept ONLY packed
- ``--packed experts``: the experts only, the layout of ``packed_weights=experts``; ``--packed dual``: the experts
packed and the projections in both forms, ``packed_weights=dual`` -,
int4 / int8 codes in blocks of ``--group``, float16-valued scales as GPTQ stores them; embeddings, lm_head, norms,
routers, conv weights in bf16), seeded random on the device (an int4 35B-A3B checkpoint is ~18 GB; no checkpoint
is read). bf16: :meth:`DeviceWeights.random`. Per batch (context ``--context``): the step as served
(``ModelRunner.step``: pack + one upload + graph replay + one download, wall clock) and the captured graph
replayed back to back (GPU time, CUDA events). ``--profile`` batches also get one eager step with CUDA events around
every launch (queue filled first): where the GPU time goes, per kernel kind.

Floor = the bytes a step must read over the copy bandwidth measured in this run (gpu_decode_step.floor_bytes):
every float weight but the embedding and RoPE tables, the routers, the packed projections (codes + scales), the
distinct routed experts of the step's tokens (counted per layer in an eager run of the same step; the table gives
E (1 - (1 - k/E)^B), uniform routing's expectation, beside it) plus the shared expert at their packed bytes (codes +
scales) or bf16 bytes, the KV of every sequence's context, GDN state read and written.
"""

from __future__ import annotations

import argparse
import datetime
import gc
from typing import Any

from benchmarks.gpu_common import log, measure_copy_bandwidth, write_report
from benchmarks.gpu_decode_step import build, decode_case, floor_bytes, qwen35_moe_config
from hybrid_runtime.cuda.nbits_decode import MAX_ROWS as NBITS_MAX_ROWS


def floor_quant(cfg: Any, w: Any, B: int, ctx: int, routed: list[int] | None = None) -> dict[str, float]:
    """gpu_decode_step.floor_bytes with the packed projections (codes + scales) added and the experts at their
    packed bytes (layers kept packed) instead of bf16; projections kept in both forms (``--packed dual``) at their
    packed bytes in steps of <= 16 rows (what those read), at their bf16 bytes in larger ones. ``routed``: the
    distinct routed experts of each MoE layer as measured (floor_bytes)."""
    f = floor_bytes(cfg, w, B, ctx, routed)
    packed_lin = sum(p.nbytes for p in w.packed_only.values())
    if B <= NBITS_MAX_ROWS:  # dual projections: steps of few rows read the packed form, not the dequantised copy
        packed_lin += sum(p.nbytes - w[n].nbytes for n, p in w.packed_decode.items())
    experts = f["experts"]
    if w.packed_moe:
        pk = next(iter(w.packed_moe.values()))
        nmoe = sum(1 for t in cfg.ffn_types if t == "moe")
        experts = nmoe * (f["distinct_experts"] + 1) * (pk.gate_up.expert_bytes() + pk.down.expert_bytes())
    total = f["total"] - f["experts"] + experts + packed_lin
    return {**f, "weights": f["weights"] + packed_lin, "experts": experts, "total": total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu_decode_step_quant_h200.md")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--bits", default="16,4,8", help="comma-separated: 16 (bf16), 4, 8 (GPTQ int4 / int8)")
    ap.add_argument("--group", type=int, default=128, help="GPTQ group (block) size of the packed weights")
    ap.add_argument("--packed", default="all",
                    help="comma-separated packed_weights modes of the quantized variants: all (projections and "
                         "experts packed), experts (the experts only; projections bf16), dual (experts packed, "
                         "projections packed for steps of <= 16 rows and bf16 for the rest)")
    ap.add_argument("--profile", type=int, nargs="*", default=[1, 8],
                    help="batches whose eager step is also timed per kernel kind")
    ap.add_argument("--moe-builds", default="",
                    help="comma-separated LABEL=ONE:MANY: run each int4 variant once per entry with the packed-expert "
                         "decode MoE builds ONE (1-row steps) and MANY (the others; moe_nbits_decode.ALL_SETS names) "
                         "instead of BACKEND_BUILDS / FAST_BUILDS, e.g. "
                         "exact=reg_g1_deep:reg_g1,sacc=sacc_g1_deep:sacc_g1")
    ap.add_argument("--dense-builds", default="",
                    help="comma-separated nbits_decode.KNOB_SETS names: run each int4 / int8 variant once per name "
                         "with that build as the packed projections' primary (its tuning candidates carry its "
                         "dequantisation) instead of nbits_decode.BACKEND_KNOBS, e.g. default,sacc")
    args = ap.parse_args()
    from hybrid_runtime.cuda import backend as backend_mod
    from hybrid_runtime.cuda import moe_nbits_decode as mnd
    from hybrid_runtime.cuda import nbits_decode as nbd

    dense_builds = [b for b in args.dense_builds.split(",") if b] or [""]
    if bad := [b for b in dense_builds if b and b not in nbd.KNOB_SETS]:
        ap.error(f"--dense-builds {bad}: names of {list(nbd.KNOB_SETS)}")

    tables: list[tuple[str, dict | None]] = [("", None)]
    if args.moe_builds:
        tables = []
        for entry in args.moe_builds.split(","):
            label, _, spec = entry.partition("=")
            one, _, many = spec.partition(":")
            if not label or one not in mnd.ALL_SETS or many not in mnd.ALL_SETS:
                ap.error(f"--moe-builds entry {entry!r}: LABEL=ONE:MANY with names of {list(mnd.ALL_SETS)}")
            tables.append((label, {**mnd.BACKEND_BUILDS, 4: ((1, one), (1 << 30, many))}))  # both tables
    variants = [int(b) for b in args.bits.split(",") if b]
    if not variants or set(variants) - {16, 4, 8}:
        ap.error(f"--bits {args.bits!r}: 16, 4 and / or 8")
    modes = [m for m in args.packed.split(",") if m]
    if not modes or set(modes) - {"all", "experts", "dual"}:
        ap.error(f"--packed {args.packed!r}: all, experts and / or dual")
    runs = [(b, "all", "", None, "") for b in variants if b == 16] + [
        (b, m, label, table, dense) for b in variants if b != 16 for m in modes for label, table in tables
        for dense in dense_builds]
    import torch

    from hybrid_runtime.cuda.driver import CudaDevice

    torch.cuda.init()
    bw = measure_copy_bandwidth(torch, CudaDevice(0, stream=0))
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    cfg = qwen35_moe_config(args.layers)
    rows: list[dict[str, Any]] = []
    defaults = (mnd.BACKEND_BUILDS, mnd.FAST_BUILDS)
    dense_default = backend_mod.NBITS_BACKEND_KNOBS
    for bits, mode, label, table, dense in runs:
        name = "bf16" if bits == 16 else (f"int{bits} (GPTQ, group {args.group}, packed {mode}"
                                          f"{f', experts {label}' if label else ''}"
                                          f"{f', projections {dense}' if dense else ''})")
        mnd.BACKEND_BUILDS = backend_mod.MOE_NBITS_BUILDS = table or defaults[0]
        mnd.FAST_BUILDS = backend_mod.MOE_NBITS_FAST_BUILDS = table or defaults[1]
        backend_mod.NBITS_BACKEND_KNOBS = nbd.KNOB_SETS[dense] if dense else dense_default
        max_seq = args.context + 64
        be, runner, load = build(cfg, max(args.batches), max_seq, max(args.batches) * -(-max_seq // 16),
                                 args.batches, bits=bits, group=args.group, packed=mode)
        secs = sum(v for k, v in load.items() if k.endswith("_s"))
        gb = be.w.nbytes / 1e9
        log(f"{name}: weights {gb:.1f} GB, built and captured in {secs:.0f} s; packed MoE launches captured "
            f"{be.moe_nbits_calls}, packed GEMMs {be.nbits_calls} (dequantise-first fallbacks {be.nbits_fallbacks})")
        for B in args.batches:
            r = decode_case(be, runner, B, args.context, profile=B in args.profile)
            fl = floor_quant(cfg, be.w, B, args.context, r["routed"])
            r.update(name=name, gb=gb, floor=fl["total"] / bw, mb=fl["total"] / 1e6,
                     distinct=fl["distinct_experts"], expected=fl["expected_experts"])
            rows.append(r)
            log(f"{name} B={B}: wall {r['wall'] * 1e3:.3f} ms, GPU {r['gpu'] * 1e3:.3f} ms, floor "
                f"{r['floor'] * 1e3:.3f} ms ({r['gpu'] / r['floor']:.2f}x), {r['nodes']} kernels")
        del be, runner
        gc.collect()
        torch.cuda.empty_cache()
    base = {r["B"]: r["gpu"] for r in rows if r["name"] == "bf16"}
    lines = [f"# Decode step with GPTQ-quantized weights on the GPU (`cuda` backend), {datetime.date.today()}", "",
             f"`python3 -m benchmarks.gpu_decode_step_quant --bits {args.bits} --group {args.group} "
             f"--packed {args.packed} --batches {' '.join(map(str, args.batches))}"
             f"{f' --moe-builds {args.moe_builds}' if args.moe_builds else ''}"
             f"{f' --dense-builds {args.dense_builds}' if args.dense_builds else ''}` on "
             f"{torch.cuda.get_device_name(0)}: Qwen3.5-35B-A3B text shape, {args.layers} layers, context "
             f"{args.context}; copy bandwidth measured in this run {bw / 1e12:.2f} TB/s. Floor = bytes a step must "
             "read (float weights, packed projections and experts at their packed bytes, KV, GDN state) / copy "
             "bandwidth. GPU = the captured decode graph replayed back to back; step = ModelRunner.step as served "
             "(wall).", "",
             "| weights | GB on device | batch | routed experts / layer (uniform) | MB read | floor (ms) | GPU (ms) "
             "| x floor | x bf16 GPU | step (ms) | kernels |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs = f"{r['gpu'] / base[r['B']]:.2f}" if r["B"] in base else "-"
        lines.append(f"| {r['name']} | {r['gb']:.1f} | {r['B']} | {r['distinct']:.1f} ({r['expected']:.1f}) | "
                     f"{r['mb']:.0f} | {r['floor'] * 1e3:.3f} | "
                     f"{r['gpu'] * 1e3:.3f} | {r['gpu'] / r['floor']:.2f} | {vs} | {r['wall'] * 1e3:.3f} | "
                     f"{r['nodes']} |")
    if any(r.get("profile") for r in rows):
        lines += ["", "## Where an eager step's GPU time goes (CUDA events around every launch, queue filled first)",
                  "", "Eager launches with events between them (no graph, no PDL overlap): the kernels' own durations.",
                  ""]
    for r in rows:
        if not r.get("profile"):
            continue
        tot = sum(t for _, t in r["profile"].values())
        lines += [f"{r['name']}, batch {r['B']}: {tot * 1e3:.3f} ms in "
                  f"{sum(c for c, _ in r['profile'].values())} launches", "", "| kernel | launches | ms | share |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {name} | {c} | {t * 1e3:.3f} | {t / tot:.0%} |"
                  for name, (c, t) in sorted(r["profile"].items(), key=lambda kv: -kv[1][1])]
        lines.append("")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
