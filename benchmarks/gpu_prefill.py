"""Prefill on the ``cuda`` backend: time to first token and prompt throughput of the released Qwen3.5-35B-A3B
text shape (all 40 layers, random bf16 weights generated on the device), as a share of the bf16 matmul rate
measured in the same run (MFU), with the step split by kernel kind.

    python3 -m benchmarks.gpu_prefill --out benchmarks/results/gpu_prefill_h200.md

Cases: TTFT of one prompt of 1k, 8k and 32k tokens (prefilled in chunks of ``max_num_tokens`` = 8192, the
last chunk sampling the first token; wall clock of ``ModelRunner.step`` per chunk, summed: the host's
packing, the upload, the eager launches, the sync and the download included), and 8 prompts of 4k tokens
(two per step). Model FLOPs = 2 x the matmul parameters a token passes through (projections, router, its
top-8 experts, the shared expert; lm_head for the rows that need logits; embeddings excluded) + causal
attention (2 x 2 x Hq x head_dim per query-key pair). GDN's own arithmetic is not counted (as in the usual
MFU). MFU = model FLOPs / time / the bf16 rate of one 8192^3 ``torch.matmul`` measured in this run.

Split: one eager run of the step with CUDA events around every launch (``CudaBackend.profile_step``, the host
enqueueing ahead of the GPU), grouped into attention, GDN, MoE (routing + routed experts), dense GEMMs (every
cuBLASLt call: projections, shared expert, router, lm_head) and the rest (norms, gates, RoPE, embedding,
sampling). The attention kernel against PyTorch SDPA comes from ``benchmarks.gpu_prefill_attention``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.gpu_common import log, time_calls, write_report
from benchmarks.gpu_decode_step import qwen35_moe_config

CHUNK = 8192
PAGE = 64


def manifest(cfg: Any, max_num_tokens: int, max_seq_len: int, num_pages: int, slots: int) -> Any:
    from hybrid_runtime.config import Limits, Manifest, SegmentSpec
    from hybrid_runtime.pipeline import plan_segments
    from hybrid_runtime.program import PROGRAM_VERSION

    lim = Limits(max_batch_size=slots, max_input_len=max_seq_len - 1, max_seq_len=max_seq_len,
                 max_num_tokens=max_num_tokens, page_size=PAGE, num_kv_pages=num_pages, num_state_slots=slots)
    segs = tuple(SegmentSpec(p.name, "", p.inputs, p.outputs) for p in plan_segments(cfg))
    return Manifest(version=1, model=cfg, limits=lim, backend="cuda", dtype="bfloat16", segments=segs,
                    state_weights="(generated on the device)", toolkit={"program": str(PROGRAM_VERSION)},
                    target={"device": "cuda"}, workarounds=(), checksums={}, tokenizer={})


def build(num_layers: int, max_num_tokens: int, max_seq_len: int, slots: int, bits: int = 16,
          group: int = 128, packed: str = "all", packed_moe_prefill: bool = True) -> tuple[Any, Any, float]:
    """Backend + runner on random device weights: bf16 (``bits`` 16) or the layout a GPTQ int4 / int8 bundle
    loads into with ``packed_weights=packed`` (``all``: every projection and expert kept packed; ``experts``: the
    experts only; ``DeviceWeights.random_packed``: prefill steps dequantise packed projections into a scratch
    buffer first); ``packed_moe_prefill`` False: the packed experts are dequantised before each prefill step (the
    backend then keeps the dequantised scratch stack)."""
    from hybrid_runtime.cuda.backend import CudaBackend, fill_random, fill_random_codes
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.cuda.kernels import load_module
    from hybrid_runtime.cuda.weights import DeviceWeights
    from hybrid_runtime.runner import ModelRunner

    t0 = time.perf_counter()
    cfg = qwen35_moe_config(num_layers)
    dev = CudaDevice(0)
    mod = load_module("fused.cu", ("-DDT=2",), dev.arch)

    def fill(a: Any, s: int, scale: float, offset: float = 0.0) -> None:
        fill_random(dev, mod, a, s, scale, offset)

    pages = -(-max_seq_len // PAGE) * 2 + 8 * -(-4096 // PAGE)
    m = manifest(cfg, max_num_tokens, max_seq_len, pages, slots)
    if bits == 16:
        w = DeviceWeights.random(dev, cfg, "bfloat16", max_seq_len, fill, seed=0)
    else:
        w = DeviceWeights.random_packed(dev, cfg, "bfloat16", max_seq_len, fill, bits=bits, block_size=group, seed=0,
                                        linears=packed == "all",
                                        fill_codes=lambda a, s, b: fill_random_codes(dev, mod, a, s, b))
    be = CudaBackend(None, m, device="cuda", cuda_device=dev, weights=w, packed_moe_prefill=packed_moe_prefill)
    runner = ModelRunner(None, m, backend=be)  # type: ignore[arg-type]
    dev.synchronize()
    return be, runner, time.perf_counter() - t0


def matmul_params_per_token(cfg: Any) -> float:
    """Parameters of the matrices one prompt token is multiplied with (no embedding, no lm_head)."""
    H = cfg.hidden_size
    total = 0
    for i in range(cfg.num_layers):
        if cfg.layer_types[i] == "linear_attention":
            proj = cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads
            total += proj * H + cfg.value_dim * H
        else:
            total += (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * H + cfg.num_heads * cfg.head_dim * H
        if cfg.ffn_types[i] == "moe":
            total += cfg.num_experts * H + cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size
            if cfg.shared_expert_intermediate_size:
                total += 3 * H * cfg.shared_expert_intermediate_size + H
        else:
            total += 3 * H * cfg.intermediate_size
    return float(total)


def prompt_flops(cfg: Any, lens: list[int]) -> float:
    """Model FLOPs of prefilling prompts of ``lens`` tokens (one logit row each)."""
    per_tok = 2 * matmul_params_per_token(cfg)
    attn_pairs = sum(L * (L + 1) / 2 for L in lens)
    attn = len(cfg.attention_layers) * 4 * cfg.num_heads * cfg.head_dim * attn_pairs
    head = 2 * cfg.hidden_size * cfg.vocab_size * len(lens)
    return per_tok * sum(lens) + attn + head


def matmul_rate(torch: Any, n: int = 8192) -> float:
    """FLOP/s of one bf16 ``n^3`` torch.matmul on this GPU (queue-filled event timing)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    sec = time_calls(torch, lambda i: torch.matmul(a, b))
    return 2 * n**3 / sec


def prompt_steps(prompts: list[tuple[int, list[int], list[int]]], chunk: int) -> list[list[Any]]:
    """Steps that prefill ``prompts`` = (slot, page table, ids), at most ``chunk`` tokens per step, prompts
    packed into steps in order (the scheduler's policy without decode)."""
    from hybrid_runtime.runner import SeqStep

    out: list[list[Any]] = []
    cur: list[Any] = []
    room = chunk
    for slot, table, ids in prompts:
        pos = 0
        while pos < len(ids):
            k = min(room, len(ids) - pos)
            cur.append(SeqStep(slot, table, pos, ids[pos:pos + k], need_logits=pos + k == len(ids)))
            pos += k
            room -= k
            if room == 0:
                out.append(cur)
                cur, room = [], chunk
    if cur:
        out.append(cur)
    return out


def run_prompts(be: Any, runner: Any, steps: list[list[Any]]) -> float:
    from hybrid_runtime.engine import Phase
    from hybrid_runtime.runner import SampleRow
    from hybrid_runtime.sampling import SamplingParams

    for step in steps:
        for st in step:
            if st.start_pos == 0:
                be.reset_slot(st.slot)
    be.synchronize()
    t = time.perf_counter()
    for step in steps:
        rows = [SampleRow(SamplingParams())] * sum(1 for s in step if s.need_logits)
        runner.step(Phase.PREFILL, step, rows)
    return time.perf_counter() - t


def interleave_case(be: Any, runner: Any, long_len: int, n_running: int = 7, seed: int = 5) -> dict[str, float]:
    """The scheduler's policy on the GPU: ``n_running`` requests decode while a ``long_len``-token prompt arrives;
    their largest gap between two tokens while it prefills, against one prefill chunk and one decode step."""
    from hybrid_runtime.engine import Phase
    from hybrid_runtime.runner import SampleRow
    from hybrid_runtime.sampling import SamplingParams
    from hybrid_runtime.scheduler import Scheduler, Sequence

    rng = np.random.default_rng(seed)
    lim = be.lim
    sched = Scheduler(lim, lim.max_batch_size, be.num_pages, be.reset_slot)
    greedy = SamplingParams(max_tokens=lim.max_seq_len)
    for i in range(n_running):
        sched.add(Sequence(f"r{i}", rng.integers(0, be.cfg.vocab_size, 64).tolist(), greedy, max_len=256))
    long = Sequence("long", rng.integers(0, be.cfg.vocab_size, long_len).tolist(),
                    SamplingParams(max_tokens=1), max_len=long_len + 1)
    stamps: dict[str, list[float]] = {}
    chunk_t: list[float] = []
    decode_t: list[float] = []
    win: list[float] = []  # [start of the long prompt's first chunk, end of its last]
    for i in range(10000):
        if i == 4:
            sched.add(long)
        batch = sched.schedule()
        if batch is None:
            break
        rows = [SampleRow(greedy)] * sum(1 for st in batch.steps if batch.phase == Phase.DECODE or st.need_logits)
        t = time.perf_counter()
        res = runner.step(batch.phase, batch.steps, rows)
        t1 = time.perf_counter()
        is_long = batch.phase == Phase.PREFILL and any(q.request_id == "long" for q in batch.seqs)
        (chunk_t if is_long else decode_t).append(t1 - t)
        if is_long:
            win = [win[0] if win else t, t1]
        sched.advance(batch)
        r = 0
        for seq, st in zip(batch.seqs, batch.steps):
            if batch.phase == Phase.DECODE or st.need_logits:
                seq.output_ids.append(int(res.tokens[r]))
                r += 1
                stamps.setdefault(seq.request_id, []).append(t1)
        if long.output_ids:
            break
    gaps = [b - a for rid, ts in stamps.items() if rid != "long" for a, b in itertools.pairwise(ts)
            if win and b > win[0] and a < win[1]]
    return {"long": long_len, "chunks": len(chunk_t), "max_gap": max(gaps, default=float("nan")),
            "chunk_max": max(chunk_t, default=float("nan")), "chunks_total": sum(chunk_t),
            "decode_median": statistics.median(decode_t)}


GROUPS = (("attention", ("prefill_attention", "decode_attention")), ("GDN", ("gdn",)),
          ("MoE", ("moe_",)), ("dense GEMMs", ("cublaslt",)))


def split(prof: dict[str, tuple[int, float]]) -> dict[str, float]:
    out = {g: 0.0 for g, _ in GROUPS}
    out["rest"] = 0.0
    for name, (_, sec) in prof.items():
        for g, keys in GROUPS:
            if any(name.startswith(k) for k in keys):
                out[g] += sec
                break
        else:
            out["rest"] += sec
    return out


def profile(be: Any, runner: Any, step: list[Any]) -> dict[str, tuple[int, float]]:
    import torch

    from hybrid_runtime.engine import Phase
    from hybrid_runtime.runner import SampleRow
    from hybrid_runtime.sampling import SamplingParams

    rows = [SampleRow(SamplingParams())] * sum(1 for s in step if s.need_logits)
    ctx = be.prepare(Phase.PREFILL, step, rows, False)
    return be.profile_step(ctx, runner._forward, spin=lambda: torch.cuda._sleep(int(2e9)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--lens", default="1024,8192,32768", help="prompt lengths for TTFT at batch 1")
    ap.add_argument("--batch", default="8x4096", help="prompts x tokens for the throughput case ('' = none)")
    ap.add_argument("--chunk", type=int, default=CHUNK, help="max_num_tokens: tokens per prefill step")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sdpa", action="store_true", help="also run benchmarks.gpu_prefill_attention's table")
    ap.add_argument("--interleave", type=int, default=32768,
                    help="tokens of the long prompt of the interleaving case (0 = skip)")
    ap.add_argument("--f32-slots", action="store_true",
                    help="float32 MoE slots in prefill (CudaBackend.moe_slots_lowp = False): the layout before")
    ap.add_argument("--bits", type=int, default=16, choices=(16, 4, 8),
                    help="16: bf16 weights; 4 / 8: GPTQ int4 / int8 with projections and experts kept packed "
                         "(packed_weights=all: a prefill step dequantises the projections into scratch first, the "
                         "experts run on the packed grouped GEMMs unless --packed-moe-prefill off)")
    ap.add_argument("--group", type=int, default=128, help="GPTQ group size (--bits 4 / 8)")
    ap.add_argument("--packed", choices=("all", "experts"), default="all",
                    help="--bits 4 / 8: the packed_weights mode whose layout the weights take (all: projections and "
                         "experts packed; experts: the projections bf16)")
    ap.add_argument("--packed-moe-prefill", choices=("on", "off"), default="on",
                    help="--bits 4 / 8: the experts on the packed grouped GEMMs (on, the backend's default) or "
                         "dequantised into scratch before each step (off)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import torch

    lens = [int(x) for x in a.lens.split(",") if x]
    nb, bl = (int(x) for x in a.batch.split("x")) if a.batch else (0, 0)
    max_seq = max([*lens, bl, a.interleave, 64]) + 64  # the interleaving case's long prompt fits too
    be, runner, build_s = build(a.layers, a.chunk, max_seq, max(8, nb), a.bits, a.group, a.packed,
                                a.packed_moe_prefill == "on")
    be.moe_slots_lowp = not a.f32_slots
    cfg = be.cfg
    log(f"built in {build_s:.0f} s: {be.w.nbytes / 1e9:.1f} GB weights, {be.num_pages} KV pages")
    peak = matmul_rate(torch)
    log(f"bf16 matmul 8192^3: {peak / 1e12:.0f} TFLOP/s")
    rng = np.random.default_rng(0)
    perm = rng.permutation(be.num_pages).tolist()
    rows: list[dict[str, Any]] = []
    splits: dict[str, dict[str, float]] = {}
    kinds: dict[str, list[tuple[str, int, float]]] = {}

    def case(name: str, prompts: list[tuple[int, list[int], list[int]]]) -> None:
        steps = prompt_steps(prompts, a.chunk)
        run_prompts(be, runner, steps)  # warm-up: kernels loaded, GEMMs planned
        times = [run_prompts(be, runner, steps) for _ in range(a.reps)]
        t = statistics.median(times)
        plens = [len(p[2]) for p in prompts]
        fl = prompt_flops(cfg, plens)
        prof = profile(be, runner, steps[-1])
        sp = split(prof)
        total = sum(sp.values())
        splits[name] = {k: v / total for k, v in sp.items()}
        splits[name]["_gpu_s"] = total
        kinds[name] = sorted(((k, n, sec) for k, (n, sec) in prof.items()), key=lambda r: -r[2])
        rows.append({"case": name, "tokens": sum(plens), "steps": len(steps), "time": t,
                     "tok_s": sum(plens) / t, "tflops": fl / t / 1e12, "mfu": fl / t / peak})
        log(f"{name}: {t * 1e3:.1f} ms (runs: {', '.join(f'{x * 1e3:.1f}' for x in times)}), "
            f"{sum(plens) / t:,.0f} tok/s, MFU {fl / t / peak:.1%}; last step "
            + ", ".join(f"{k} {v:.0%}" for k, v in splits[name].items() if not k.startswith("_")))

    def table_for(L: int, offset: int) -> list[int]:
        return perm[offset:offset + -(-L // PAGE)]

    for L in lens:
        ids = rng.integers(0, cfg.vocab_size, L).tolist()
        case(f"TTFT {L // 1024}k x1", [(0, table_for(L, 0), ids)])
    if nb:
        prompts = []
        for b in range(nb):
            ids = rng.integers(0, cfg.vocab_size, bl).tolist()
            prompts.append((b, table_for(bl, b * -(-bl // PAGE)), ids))
        case(f"{nb} x {bl // 1024}k", prompts)
    if a.bits != 16:
        log(f"MoE steps on the packed grouped GEMMs: {be.moe_packed_prefill_calls}")
    inter = None
    if a.interleave:
        be.capture_graphs(runner._forward, buckets=[b for b in be.buckets if b <= 8])
        interleave_case(be, runner, a.interleave)  # warm-up
        inter = interleave_case(be, runner, a.interleave)
        log(f"interleave: {inter}")
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# Prefill on {be.dev.limits.name}: Qwen3.5-35B-A3B shape, random " + (
            "bf16 weights" if a.bits == 16
            else f"GPTQ int{a.bits} weights (group {a.group}, packed_weights={a.packed})"), "",
        f"Command: `python3 -m benchmarks.gpu_prefill --layers {a.layers} --lens {a.lens} --batch {a.batch} "
        f"--chunk {a.chunk} --interleave {a.interleave}{f' --reps {a.reps}' if a.reps != 3 else ''}"
        f"{' --sdpa' if a.sdpa else ''}"
        f"{f' --bits {a.bits}' if a.bits != 16 else ''}"
        f"{f' --packed {a.packed}' if a.bits != 16 and a.packed != 'all' else ''}"
        f"{' --packed-moe-prefill off' if a.bits != 16 and a.packed_moe_prefill == 'off' else ''}"
        f"{' --f32-slots' if a.f32_slots else ''}`  ",
        f"Device: {be.dev.limits.name}; bf16 matmul rate measured in this run (8192^3 torch.matmul): "
        f"**{peak / 1e12:.0f} TFLOP/s**; {when}.  ",
        f"Model: {a.layers} layers ({len(cfg.linear_layers)} GDN + {len(cfg.attention_layers)} gated attention), "
        f"{matmul_params_per_token(cfg) / 1e9:.2f} G matmul parameters per token; page size {PAGE}; "
        f"max_num_tokens {a.chunk} (a longer prompt prefills in chunks). Time = median of {a.reps} runs, wall "
        "clock of the runner's steps (host work, upload, sync, download included).", "",
        "| case | tokens | steps | time ms | tokens/s | model TFLOP/s | MFU |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['tokens']:,} | {r['steps']} | {r['time'] * 1e3:,.1f} | {r['tok_s']:,.0f} | "
                     f"{r['tflops']:.0f} | {r['mfu']:.1%} |")
    lines += ["", "Split of the last step of each case (GPU time of its kernels, CUDA events):", "",
              "| case | GPU ms | attention | GDN | MoE | dense GEMMs | rest |", "|---|---|---|---|---|---|---|"]
    for name, sp in splits.items():
        lines.append(f"| {name} | {sp['_gpu_s'] * 1e3:,.1f} | " + " | ".join(
            f"{sp[g]:.0%}" for g in ("attention", "GDN", "MoE", "dense GEMMs", "rest")) + " |")
    for name, ks in kinds.items():
        if name.startswith("TTFT 8k"):
            lines += ["", f"Kernels of the last step of {name} (launches, GPU ms, share):", "",
                      "| kernel | launches | ms | share |", "|---|---|---|---|"]
            tot = sum(sec for _, _, sec in ks)
            lines += [f"| {k} | {n} | {sec * 1e3:.2f} | {sec / tot:.1%} |" for k, n, sec in ks]
    if inter is not None:
        lines += ["", f"While a {inter['long']:,}-token prompt prefills ({inter['chunks']} chunks), 7 running requests "
                  f"decode between its chunks (the scheduler's policy, decode graphs captured): their largest gap "
                  f"between two tokens is **{inter['max_gap'] * 1e3:.0f} ms**, within one chunk (the longest: "
                  f"{inter['chunk_max'] * 1e3:.0f} ms) + one decode step (median "
                  f"{inter['decode_median'] * 1e3:.1f} ms); without interleaving it would be the whole prefill "
                  f"({inter['chunks_total'] * 1e3:.0f} ms of chunks)."]
    if a.sdpa:
        try:
            from benchmarks import gpu_prefill_attention as gpa

            lines += ["", *gpa.table_lines(gpa.compare_sdpa())]
        except Exception as e:  # the attention comparison is optional here
            lines += ["", f"(attention vs SDPA not run: {type(e).__name__}: {e})"]
    if a.out:
        write_report(a.out, lines)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
