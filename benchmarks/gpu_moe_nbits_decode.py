"""The decode MoE over int4 / int8 packed experts (``cuda/moe_nbits_decode.py``) against the bf16 decode MoE
(``cuda/moe_decode.py``) on the Qwen3.5-35B-A3B expert shape (H 2048, 256 experts of I 512, top-8, the shared expert
folded in as expert 256 for n <= 16), and against each one's floor: the bytes of the distinct experts a step touches
(packed codes + float32 scales (+ zero-points) for int4 / int8; 3 * I * H * 2 for bf16) over the device-to-device
copy bandwidth measured in the same run.

    python3 -m benchmarks.gpu_moe_nbits_decode --out benchmarks/results/gpu_moe_nbits_decode_h200.md

Per token count n (1, 8, 64 by default): :data:`ROUTINGS` routings of random float32 router logits (moe_topk +
moe_group), :data:`STACKS` copies of every weight set (random codes / values; group size ``--group``, symmetric
unless ``--asym``), call i on routing i % ROUTINGS and copy i % STACKS, so no call finds its weights in the 50 MB
L2. Times: CUDA events around back-to-back calls queued behind a spin kernel (PDL launches, as in the backend),
median of 3 means of ``--calls`` calls; routing not timed. bf16 runs the backend's build per step size ("dnpre" for
1 token, "default" up to 16, "many" past that, as ``CudaBackend``), the packed kernels every build of their
``ALL_SETS`` (``--knobs``): the T tile in shared memory ("default", "fine", "many") and the A fragments dequantised
in registers ("reg", "reg_fine", "reg_many", "reg_g1", ...; all of ``KNOB_SETS`` give the same bits), and the int4
builds with the scale on the accumulator (``SACC_SETS``: "sacc_g1", ...; other bits, int8 as reg). ``--scales``: f16
(float16-valued float32 scales, as GPTQ checkpoints store them: the int4 reg builds then take the FFMA
dequantisation, ``moe_nbits_decode.short_scales``) and / or f32 (random float32 scales: the FADD + FMUL path).
Every module is compiled first, in parallel worker processes (``kernels.warm_cache``).
"""

# ruff: noqa: B023 - every closure below is timed (called) inside the loop iteration that defines it
from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from benchmarks.gpu_common import log, measure_copy_bandwidth, time_on_stream, write_report

H, INTER, E, K = 2048, 512, 256, 8
TOKENS = (1, 8, 64)
FOLD_MAX_TOKENS = 16
ROUTINGS = 16
STACKS = 4
BF16_EXPERT_BYTES = 3 * INTER * H * 2


def bf16_build(n: int) -> str:
    """The moe_decode build the backend runs a step of n rows on (see test_moe_decode_gpu's backend test)."""
    return "dnpre" if n == 1 else "default" if n <= 16 else "many"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/gpu_moe_nbits_decode_h200.md")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--group", type=int, default=128, help="block size of the packed experts")
    ap.add_argument("--asym", action="store_true", help="with zero-points (default: symmetric, none stored)")
    ap.add_argument("--knobs", default="", help="comma-separated moe_nbits_decode ALL_SETS names (default: all)")
    ap.add_argument("--scales", default="f16", help="comma-separated: f16 (float16-valued scales, GPTQ's; int4 reg "
                    "builds take the FFMA dequantisation) and / or f32 (random float32 scales)")
    ap.add_argument("--calls", type=int, default=48, help="calls per timed run (a multiple of ROUTINGS is fair)")
    args = ap.parse_args()
    import numpy as np
    import torch

    from hybrid_runtime.cuda.backend import fill_random, fill_random_codes
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.cuda.kernels import load_module, warm_cache
    from hybrid_runtime.cuda.moe_decode import DT_CODES, MoEDecode
    from hybrid_runtime.cuda.moe_decode import KNOB_SETS as BF16_KNOBS
    from hybrid_runtime.cuda.moe_decode import SOURCE as BF16_SOURCE
    from hybrid_runtime.cuda.moe_nbits_decode import ALL_SETS as KNOB_SETS
    from hybrid_runtime.cuda.moe_nbits_decode import SOURCE as NB_SOURCE
    from hybrid_runtime.cuda.moe_nbits_decode import MoENBitsDecode, NBitsExperts, smem_bytes, uses_fma
    from hybrid_runtime.cuda.moe_prefill import ROUTE_MAX_CTAS, MoEBuffers, MoEPrefill, tile_list_words

    torch.cuda.init()
    dev = CudaDevice(0)
    log(f"device {dev.limits.name}, {dev.limits.sm_count} SMs")
    copy_bw = measure_copy_bandwidth(torch, dev)
    log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    fused = load_module("fused.cu", ("-DDT=2",), dev.arch)
    router = MoEPrefill(dev, "bfloat16", impl="mma")
    tokens = [int(t) for t in args.tokens.split(",")]
    bits_list = [int(b) for b in args.bits.split(",")]
    names = [x for x in args.knobs.split(",") if x] or list(KNOB_SETS)
    if bad := [x for x in names if x not in KNOB_SETS]:
        ap.error(f"--knobs {bad}: not in {list(KNOB_SETS)}")
    scale_kinds = [x for x in args.scales.split(",") if x]
    if not scale_kinds or set(scale_kinds) - {"f16", "f32"}:
        ap.error(f"--scales {args.scales!r}: f16 and / or f32")
    t0 = time.perf_counter()
    fma_opts = {(x, b, f) for x in names for b in bits_list if KNOB_SETS[x].runs_bits(b)
                for f in (False, b == 4 and bool(KNOB_SETS[x].reg and not KNOB_SETS[x].sacc) and "f16" in scale_kinds)}
    warm_cache([(NB_SOURCE, KNOB_SETS[x].options("bfloat16", b, f), dev.arch) for x, b, f in sorted(fma_opts)]
               + [(BF16_SOURCE, (f"-DDT={DT_CODES['bfloat16']}", *BF16_KNOBS[bf16_build(n)].options), dev.arch)
                  for n in tokens])
    log(f"modules compiled in {time.perf_counter() - t0:.1f} s")
    nb_decs = {name: MoENBitsDecode(dev, "bfloat16", KNOB_SETS[name]) for name in names}
    bf_decs = {b: MoEDecode(dev, "bfloat16", **asdict(BF16_KNOBS[b])) for b in {bf16_build(n) for n in tokens}}

    keep: list[Any] = []  # device arrays the operands point into

    def rand(shape: tuple[int, ...], dtype: str, seed: int, scale: float, offset: float = 0.0) -> Any:
        a = dev.empty(shape, dtype)
        fill_random(dev, fused, a, seed, scale, offset)
        keep.append(a)
        return a

    bf16 = [(rand((E + 1, 2 * INTER, H), "bfloat16", 100 + s, 1 / 45), rand((E + 1, H, INTER), "bfloat16", 200 + s,
                                                                                1 / 22)) for s in range(STACKS)]
    packed: dict[tuple[int, str], list[tuple[NBitsExperts, NBitsExperts]]] = {}
    for bits in bits_list:
        for sk in scale_kinds:
            stacks = []
            for s in range(STACKS):
                ops = []
                for R, Kd, seed in ((2 * INTER, H, 300), (H, INTER, 400)):
                    rows, nb = (E + 1) * R, Kd // args.group
                    codes = dev.empty((rows * Kd * bits // 16,), "bfloat16")
                    fill_random_codes(dev, fused, codes, seed + 10 * s + bits, bits)  # uniform around the zero-point
                    keep.append(codes)
                    if sk == "f16":  # float16-valued (GPTQ's): short scales
                        g = torch.Generator(device="cuda").manual_seed(seed + 10 * s + bits + 1)
                        st = (torch.rand(rows * nb, device="cuda", generator=g) * 0.01 + 0.005).half().float()
                        keep.append(st)
                        sptr = st.data_ptr()
                    else:
                        sptr = rand((rows * nb,), "float32", seed + 10 * s + bits + 1, 0.005, 0.01).ptr
                    zw = (nb + 1) // 2 if bits == 4 else nb
                    zp = rand((-(-rows * zw // 2),), "bfloat16", seed + 10 * s + bits + 2, 1.0) if args.asym \
                        else None
                    ops.append(NBitsExperts(codes.ptr, sptr, zp.ptr if zp is not None else 0, E + 1, R, Kd, bits,
                                            args.group, short=sk == "f16"))
                stacks.append((ops[0], ops[1]))
            packed[(bits, sk)] = stacks
    n_max = max(tokens)
    P_max = n_max * (K + 1)
    act = dev.empty((P_max, INTER), "bfloat16")
    y = dev.empty((n_max, K + 1, H), "float32")
    h = rand((n_max, H), "bfloat16", 5, 1.0)
    ld = 264
    lg = dev.empty((n_max, ld), "float32")
    routes = []
    for _ in range(ROUTINGS):
        b = {name: dev.empty(shape, dt) for name, shape, dt in (
            ("pw", (P_max,), "float32"), ("pe", (P_max,), "int32"), ("pl", (P_max,), "int32"),
            ("off", (E + 2,), "int32"), ("active", (E + 2,), "int32"),
            ("tiles", (tile_list_words(P_max, E + 1),), "int32"), ("cta", (ROUTE_MAX_CTAS, E + 1), "int32"))}
        routes.append((b, MoEBuffers(b["pw"].ptr, b["pe"].ptr, b["pl"].ptr, b["off"].ptr, b["active"].ptr,
                                     b["tiles"].ptr, b["cta"].ptr, act.ptr, y.ptr, (b["tiles"].size - 4) // 4)))

    rows = []
    for n in tokens:
        fold = n <= FOLD_MAX_TOKENS
        kk, e_all, ny = K + int(fold), E + int(fold), K + 1
        distinct = []
        for r, (b, bufs) in enumerate(routes):
            fused.kernel("fill_random_f32").launch(dev, (256, 1, 1), (256, 1, 1), 0,
                                                   [("ptr", lg.ptr), ("i64", n * ld), ("u64", 1000 * n + r),
                                                    ("f32", 2.0), ("f32", 0.0)])
            router.route(n, lg.ptr, ld, E, K, True, bufs, fold_shared=fold)
            distinct.append(int(dev.download(b["active"])[e_all]))
        experts = float(np.mean(distinct))
        cases: list[tuple[str, float, str, Callable[[int], None]]] = []
        bname = bf16_build(n)

        def bf16_step(i: int, dec: MoEDecode = bf_decs[bname]) -> None:
            _, bufs = routes[i % ROUTINGS]
            gu, dn = bf16[i % STACKS]
            dec.launch(n, h.ptr, H, gu.ptr, dn.ptr, H, INTER, kk, ny, e_all, bufs)

        cases.append((f"bf16 moe_decode {bname}", BF16_EXPERT_BYTES, "", bf16_step))
        for bits, sk in packed:
            gu0, dn0 = packed[(bits, sk)][0]
            ebytes = gu0.expert_bytes() + dn0.expert_bytes()
            for name, dec in nb_decs.items():
                if not dec.knobs.runs_bits(bits):  # a 256-k sacc build: int4 only
                    continue
                gcap = max(1, min(dec.knobs.gmax, -(-n // 8)))
                fma = uses_fma(gu0, dec.knobs)
                note = (f"{sk} scales{', FFMA' if fma else ''}"
                        f"{', scale on acc' if dec.knobs.scales_acc(bits) else ''}; smem "
                        f"{smem_bytes('gate_up', gcap, bits, gu0.n_blocks, dec.knobs, fma) // 1024}/"
                        f"{smem_bytes('down', gcap, bits, dn0.n_blocks, dec.knobs, fma) // 1024} KB")

                def nb_step(i: int, dec: MoENBitsDecode = dec, key: tuple[int, str] = (bits, sk)) -> None:
                    _, bufs = routes[i % ROUTINGS]
                    gu, dn = packed[key][i % STACKS]
                    dec.launch(n, h.ptr, H, gu, dn, H, INTER, kk, ny, e_all, bufs)

                cases.append((f"int{bits} moe_nbits_decode {name}", ebytes, note, nb_step))
        for label, ebytes, note, fn in cases:
            t = time_on_stream(dev, fn, args.calls, runs=3, warmup=range(ROUTINGS), offset_by_run=True)
            mb = experts * ebytes
            floor = mb / copy_bw
            row = {"n": n, "fold": fold, "experts": experts, "kernels": label, "mb": mb / 1e6, "us": t * 1e6,
                   "floor": floor * 1e6, "x": t / floor, "tbs": mb / t / 1e12, "note": note}
            log(row)
            rows.append(row)

    zp = "asymmetric (zero-points stored)" if args.asym else "symmetric (no zero-points stored)"
    lines = [f"# Decode MoE over int4 / int8 packed experts vs bf16 ({dev.limits.name}, "
             f"{datetime.date.today().isoformat()})", "",
             f"Qwen3.5-35B-A3B routed experts: H {H}, {E} experts of I {INTER}, top-{K}; the shared expert folded in "
             f"as expert {E} for n <= {FOLD_MAX_TOKENS}; packed experts of group size {args.group}, {zp}, "
             f"float32 scales ({' and '.join(scale_kinds)}-valued: note); {STACKS} copies of every weight set, "
             f"{ROUTINGS} random routings per n (no L2 reuse); "
             f"`python3 -m benchmarks.gpu_moe_nbits_decode`. Copy bandwidth in this run: "
             f"**{copy_bw / 1e12:.2f} TB/s**. Floor = distinct experts x bytes per expert (packed codes + scales "
             f"(+ zero-points), or bf16) / copy bandwidth; routing not timed.", "",
             "| tokens | fold | distinct experts | kernels | MB read | us | floor us | x floor | TB/s | note |",
             "|---:|:---:|---:|:---|---:|---:|---:|---:|---:|:---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {'yes' if r['fold'] else 'no'} | {r['experts']:.1f} | {r['kernels']} | "
                     f"{r['mb']:.1f} | {r['us']:.1f} | {r['floor']:.1f} | {r['x']:.2f} | {r['tbs']:.2f} | "
                     f"{r['note']} |")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
