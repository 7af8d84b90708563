"""Causal prefill attention on the GPU: our paged kernel vs PyTorch SDPA (FlashAttention backend).

    python3 -m benchmarks.gpu_prefill_attention --out benchmarks/results/prefill_attention_h200.md
    python3 -m benchmarks.gpu_prefill_attention --builds 4 8   # the 4-warp vs the 8-warp build, one run
    python3 -m benchmarks.gpu_prefill_attention --builds 8 wgmma wgmma-n64   # mma.sync vs wgmma

Shape: the target model's attention layers (16 query heads, 2 kv heads, head_dim 256, bfloat16); batch 1 at
1k / 8k / 32k tokens and 8 x 4k (fresh prompts, start position 0). Ours reads K/V from the paged pool (page
size 64, shuffled pages) through the page tables, q packed ``[tokens, Hq, hd]``, output float32; SDPA gets
contiguous ``[B, H, L, hd]`` tensors and ``is_causal=True`` under ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``,
with ``enable_gqa=True`` (K/V with Hkv heads) when that backend accepts it, else K/V expanded to Hq heads
(the table says which). Time = median of 3 queue-filled runs of back-to-back calls (CUDA events, see
``gpu_common.time_calls``); ours is launched on inputs already on the device (work list and tables uploaded
once), as the backend does. TFLOP/s counts causal FLOPs: 2 matmuls x 2 x Hq x hd x (keys attended, summed
over queries). Max abs error: ours vs SDPA's bfloat16 output. ``--builds`` times several builds of ours
on the same inputs, SDPA once per case: ``default`` (what serving runs: ``"auto"``), the mma.sync builds
``WARPS`` or ``WARPSxMTILES`` (4 = 64-row tiles, single-buffered K/V; 8 = 128-row tiles, double-buffered),
``wgmma`` (Hopper warpgroup MMA), ``wgmma-ws`` (its warp-specialised form) and ``-n64`` of either (P V as n64
products); ``same bits`` says whether a build's output equals the first's.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.gpu_common import log, time_calls, write_report


def _sdpa_call(torch: Any, q: Any, k: Any, v: Any, group: int) -> tuple[Any, str]:
    """A zero-argument SDPA call on [B, H, L, hd] tensors under the flash backend, and how GQA is done."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def gqa() -> Any:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k, v, is_causal=True, enable_gqa=True)

    if group == 1:
        def plain() -> Any:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return sdpa(q, k, v, is_causal=True)
        return plain, "MHA"
    try:
        gqa()
        torch.cuda.synchronize()
        return gqa, "enable_gqa=True"
    except (RuntimeError, TypeError) as e:
        log(f"SDPA flash with enable_gqa failed ({str(e).splitlines()[0][:120]}); expanding K/V to Hq heads")
    ke = k.repeat_interleave(group, dim=1).contiguous()
    ve = v.repeat_interleave(group, dim=1).contiguous()

    def expanded() -> Any:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, ke, ve, is_causal=True)
    return expanded, "K/V expanded to Hq"


def build_label(v: Any) -> str:
    """A build's name in the table: ``wgmma`` / ``wgmma-ws`` (`` n64``: split P V), or the mma.sync schedule
    ``wWARPS mtM sSTAGES``."""
    if v.impl != "mma":
        return v.impl.replace("_", "-") + (" n64" if v.pv_split else "")
    return f"w{v.warps} mt{v.m_tiles} s{v.stages}"


def make_kernel(dev: Any, spec: str, dtype: str, head_dim: int, group: int, m_tiles: int | None = None) -> Any:
    """A kernel for one ``--builds`` spec: ``default`` (impl ``"auto"``, what serving runs), ``WARPS`` or
    ``WARPSxMTILES`` (mma.sync), ``wgmma``, ``wgmma-n64``, ``wgmma-ws``, ``wgmma-ws-n64``."""
    from hybrid_runtime.cuda.prefill_attention import CudaPrefillAttention

    if spec == "default":
        return CudaPrefillAttention(dev, dtype, head_dim, group, m_tiles)
    if spec in ("wgmma", "wgmma-n64", "wgmma-ws", "wgmma-ws-n64"):
        return CudaPrefillAttention(dev, dtype, head_dim, group, impl="wgmma_ws" if "-ws" in spec else "wgmma",
                                    pv_split=spec.endswith("-n64"))
    w, _, mt = spec.partition("x")
    if not w.isdigit() or (mt and not mt.isdigit()):
        raise SystemExit(f"--builds: unknown build {spec!r} (default, 4, 8, 4x2, wgmma, wgmma-n64, wgmma-ws, "
                         "wgmma-ws-n64)")
    return CudaPrefillAttention(dev, dtype, head_dim, group, int(mt) if mt else m_tiles, int(w), impl="mma")


def bench_case(torch: Any, dev: Any, kerns: Sequence[Any], batch: int, seq_len: int, hq: int, hkv: int, hd: int,
               page_size: int, sdpa_too: bool = True) -> list[dict]:
    """One row per kernel of ``kerns`` (builds of one dtype / head_dim / group) on the same inputs; SDPA's
    figures (timed once) repeated in each row."""
    from hybrid_runtime.cuda.prefill_attention import pack_prefill_inputs

    dtype = kerns[0].variant.dtype
    rows: list[dict] = []
    outs: list[Any] = []
    keep: list[Any] = []
    flops = 0
    tdt = getattr(torch, dtype)
    pps = -(-seq_len // page_size)
    pages = batch * pps
    rng = np.random.default_rng(batch * seq_len + hd)
    perm = rng.permutation(pages).astype(np.int64)
    tables = [perm[b * pps:(b + 1) * pps] for b in range(batch)]
    g = torch.Generator(device="cuda").manual_seed(batch * seq_len)
    # contiguous per-sequence K/V [B, Hkv, L, hd] (SDPA's input), scattered into the shuffled pool (ours)
    kc = torch.randn(batch, hkv, seq_len, hd, device="cuda", generator=g).to(tdt)
    vc = torch.randn(batch, hkv, seq_len, hd, device="cuda", generator=g).to(tdt)
    qc = torch.randn(batch, hq, seq_len, hd, device="cuda", generator=g).to(tdt)
    kpool = torch.zeros(pages, page_size, hkv, hd, device="cuda", dtype=tdt)
    vpool = torch.zeros_like(kpool)
    for b in range(batch):
        idx = torch.as_tensor(tables[b], device="cuda")
        kt = torch.zeros(pps * page_size, hkv, hd, device="cuda", dtype=tdt)
        vt = torch.zeros_like(kt)
        kt[:seq_len] = kc[b].transpose(0, 1)
        vt[:seq_len] = vc[b].transpose(0, 1)
        kpool[idx] = kt.reshape(pps, page_size, hkv, hd)
        vpool[idx] = vt.reshape(pps, page_size, hkv, hd)
    qp = qc.transpose(1, 2).reshape(batch * seq_len, hq, hd).contiguous()  # packed [tokens, Hq, hd]
    q_lens, start = [seq_len] * batch, [0] * batch
    for kern in kerns:
        plan = kern.plan(q_lens, start, num_q_heads=hq, num_kv_heads=hkv, page_size=page_size)
        packed = pack_prefill_inputs(plan, tables)
        meta = dev.upload(packed.host)
        out = torch.empty(batch * seq_len, hq, hd, device="cuda", dtype=torch.float32)
        ptrs = (qp.data_ptr(), kpool.data_ptr(), vpool.data_ptr(), meta.ptr + 4 * packed.tables_offset,
                packed.table_stride, meta.ptr + 4 * packed.work_offset, out.data_ptr())

        def ours(_i: int, kern: Any = kern, plan: Any = plan, ptrs: tuple = ptrs) -> None:
            kern.launch(plan, *ptrs, pool_pages=pages)

        flops = plan.causal_flops()
        t_ours = time_calls(torch, ours, host_us_per_call=60.0)
        ours(0)
        torch.cuda.synchronize()
        v = kern.variant
        rows.append({"batch": batch, "seq_len": seq_len, "shape": f"{hq}q/{hkv}kv/d{hd}", "dtype": dtype,
                     "page_size": page_size, "m_tiles": v.m_tiles, "warps": v.warps, "stages": v.stages,
                     "build": build_label(v),
                     "work_items": plan.n_work, "ours_s": t_ours, "ours_tflops": flops / t_ours / 1e12,
                     "same_bits": None if not outs else bool(torch.equal(out, outs[0])), "sdpa_s": None,
                     "sdpa_tflops": None, "ratio": None, "max_abs_err": None, "sdpa_gqa": None})
        outs.append(out)
        keep.append(meta)
    if sdpa_too:
        try:
            call, how = _sdpa_call(torch, qc, kc, vc, hq // hkv)
            t_sdpa = time_calls(torch, lambda _i: call(), host_us_per_call=60.0)
            ref = call().transpose(1, 2).reshape(batch * seq_len, hq, hd).float()
            for r, out in zip(rows, outs):
                r.update(sdpa_s=t_sdpa, sdpa_tflops=flops / t_sdpa / 1e12, ratio=r["ours_s"] / t_sdpa,
                         max_abs_err=float((out - ref).abs().max()), sdpa_gqa=how)
            del ref
        except torch.OutOfMemoryError:
            log("SDPA: out of memory")
        except RuntimeError as e:
            log(f"SDPA flash unavailable: {str(e).splitlines()[0][:160]}")
    del kc, vc, qc, kpool, vpool, qp, outs, keep
    torch.cuda.empty_cache()
    return rows


def compare_sdpa(seq_lens: Sequence[int] = (1024, 8192, 32768), batch_cases: Sequence[tuple[int, int]] = ((8, 4096),),
                 *, num_q_heads: int = 16, num_kv_heads: int = 2, head_dim: int = 256, dtype: str = "bfloat16",
                 page_size: int = 64, m_tiles: int | None = None, sdpa_too: bool = True,
                 builds: Sequence[str] = ("default",)) -> list[dict]:
    """One row per case and build: batch 1 at each of ``seq_lens``, then each ``(batch, seq_len)`` of
    ``batch_cases``; ``builds``: :func:`make_kernel` specs (``m_tiles`` overrides an mma.sync spec's
    default). Keys: batch, seq_len, shape, dtype, page_size, m_tiles, warps, stages, build, work_items, ours_s,
    ours_tflops, same_bits (vs the case's first build; None for it), sdpa_s, sdpa_tflops, ratio (ours / SDPA
    time: < 1 is faster), max_abs_err, sdpa_gqa (how SDPA did GQA)."""
    import torch

    from hybrid_runtime.cuda.driver import CudaDevice

    torch.cuda.init()
    dev = CudaDevice(0, stream=0)  # the legacy default stream: ordered with PyTorch's work and events
    group = num_q_heads // num_kv_heads
    kerns = [make_kernel(dev, b, dtype, head_dim, group, m_tiles) for b in builds]
    rows = []
    for batch, n in [(1, int(s)) for s in seq_lens] + [(int(b), int(s)) for b, s in batch_cases]:
        for r in bench_case(torch, dev, kerns, batch, n, num_q_heads, num_kv_heads, head_dim, page_size, sdpa_too):
            log(f"B={batch} L={n} {r['build']}: ours {r['ours_s'] * 1e3:.3f} ms "
                f"{r['ours_tflops']:.0f} TFLOP/s | SDPA "
                + (f"{r['sdpa_s'] * 1e3:.3f} ms {r['sdpa_tflops']:.0f} TFLOP/s | ratio {r['ratio']:.2f} | "
                   f"max abs err {r['max_abs_err']:.2e}" if r["sdpa_s"] else "—")
                + ("" if r["same_bits"] is None else f" | same bits as the first build: {r['same_bits']}"))
            rows.append(r)
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| shape | build | B | L | work items | ours ms | ours TFLOP/s | SDPA ms | SDPA TFLOP/s | ours / SDPA | "
             "max abs err | same bits | SDPA GQA |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sd = r["sdpa_s"] is not None
        same = "—" if r["same_bits"] is None else ("yes" if r["same_bits"] else "NO")
        lines.append(
            f"| {r['shape']} {r['dtype']} ps{r['page_size']} | {r['build']} | "
            f"{r['batch']} | {r['seq_len']} | {r['work_items']} | {r['ours_s'] * 1e3:.3f} | {r['ours_tflops']:.0f} | "
            + (f"{r['sdpa_s'] * 1e3:.3f} | {r['sdpa_tflops']:.0f} | {r['ratio']:.2f} | {r['max_abs_err']:.1e} | "
               f"{same} | {r['sdpa_gqa']} |" if sd else f"— | — | — | — | {same} | — |"))
    return lines


table_lines = table  # the name benchmarks/gpu_prefill.py --sdpa calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/prefill_attention_h200.md")
    ap.add_argument("--seq-lens", type=int, nargs="*", default=[1024, 8192, 32768])
    ap.add_argument("--batch-cases", nargs="*", default=["8x4096"], help="BATCHxLEN cases")
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--m-tiles", type=int, choices=[1, 2], help="override the build's 16-row tiles per warp")
    ap.add_argument("--builds", nargs="*", default=[],
                    help="builds to time on the same inputs: default, WARPS (4 or 8), WARPSxMTILES, wgmma, "
                         "wgmma-n64, wgmma-ws, wgmma-ws-n64, e.g. '8 wgmma' (default: the default build only)")
    ap.add_argument("--no-sdpa", action="store_true")
    args = ap.parse_args()
    cases = [tuple(int(x) for x in c.lower().split("x")) for c in args.batch_cases]
    builds = [b.lower() for b in args.builds] or ["default"]
    rows = compare_sdpa(args.seq_lens, cases, num_q_heads=args.hq, num_kv_heads=args.hkv, head_dim=args.head_dim,
                        dtype=args.dtype, page_size=args.page_size, m_tiles=args.m_tiles, sdpa_too=not args.no_sdpa,
                        builds=builds)
    import torch

    lines = [
        "# Causal prefill attention on the H200: paged kernel vs SDPA flash",
        "",
        f"Command: `{' '.join(['python3 -m benchmarks.gpu_prefill_attention', *sys.argv[1:]])}`  ",
        f"Device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC.  ",
        "Fresh prompts (start position 0). Ours: paged pool (shuffled pages), packed q, float32 output, launched "
        "on device-resident work list and tables. SDPA: contiguous [B, H, L, hd], `is_causal=True`, "
        "`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`, bfloat16 output. Median of 3 queue-filled runs (CUDA events). "
        "TFLOP/s = 4 Hq hd sum(keys attended) / time. ours / SDPA < 1: ours is faster.",
        "",
        *table(rows),
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
