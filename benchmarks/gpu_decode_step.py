"""A whole decode step of the ``cuda`` backend on the released Qwen3.5-35B-A3B text shape, against the
weight-read floor measured in the same run, and against transformers + flash-linear-attention on a slice.

    python3 -m benchmarks.gpu_decode_step --out benchmarks/results/gpu_decode_step_h200.md

Model: all 40 layers (30 Gated DeltaNet + 10 gated attention, hidden 2048, 256 experts top-8 with expert FFN
512 and a shared expert of 512, 16 query / 2 KV heads x 256, GDN 16 key / 32 value heads x 128, vocab 248320),
random bf16 weights generated on the device straight into the runtime's layout (70 GB fits neither this
machine's disk nor its host memory comfortably); KV pages and GDN states filled with random values; greedy
sampling. Per (batch, context): the step as served (``ModelRunner.step``: pack + one upload + graph replay +
one download, wall clock) and the graph replayed back to back (GPU time, CUDA events, no host work).
``--moe-decode`` and ``--fused-gdn on,off`` (the fused GDN decode pair, 2 launches per GDN layer, against the
four launches) repeat the 40-layer rows under each combination, graphs recaptured.

Floor = the bytes a step must read over the copy bandwidth measured in this run (a device-to-device copy,
bytes read + written): every non-expert weight, the distinct routed experts of the step's tokens (counted per
layer in an eager run of the same step, :func:`routed_experts`; the table also gives E * (1 - (1 - k/E)^B), the
expectation under uniform routing, which a random model's routing need not follow) plus the shared expert, lm_head,
the K/V of every
sequence's context, GDN recurrent state read and written and conv state. Kernels per step = nodes of the
replayed graph. The slice row runs the same config cut to 4 layers (3 GDN + 1 attention) in our runtime and
in transformers (Qwen3_5MoeForCausalLM, bf16, with flash-linear-attention's GDN kernels when installed), one
decode step after a prefill, wall clock.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.gpu_common import log, measure_copy_bandwidth, time_on_stream, write_report

L_, A_ = "linear_attention", "full_attention"


def qwen35_moe_config(num_layers: int = 40) -> Any:
    from hybrid_runtime.config import ModelConfig

    types = tuple(A_ if (i + 1) % 4 == 0 else L_ for i in range(num_layers))
    return ModelConfig(model_type="qwen3_5_moe", vocab_size=248320, hidden_size=2048, num_layers=num_layers,
                       layer_types=types, ffn_types=("moe",) * num_layers, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, num_heads=16, num_kv_heads=2, head_dim=256, rotary_dim=64,
                       rope_theta=1e7, attention_bias=False, max_position_embeddings=262144,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, conv_kernel=4, intermediate_size=512, num_experts=256,
                       num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       norm_topk_prob=True, eos_token_ids=(248046,))


def manifest_for(cfg: Any, max_batch: int, max_seq_len: int, num_pages: int, page_size: int = 16) -> Any:
    from hybrid_runtime.config import Limits, Manifest, SegmentSpec
    from hybrid_runtime.pipeline import plan_segments
    from hybrid_runtime.program import PROGRAM_VERSION

    lim = Limits(max_batch_size=max_batch, max_input_len=max_seq_len - 1, max_seq_len=max_seq_len,
                 max_num_tokens=max_batch, page_size=page_size, num_kv_pages=num_pages, num_state_slots=max_batch)
    segs = tuple(SegmentSpec(p.name, "", p.inputs, p.outputs) for p in plan_segments(cfg))
    return Manifest(version=1, model=cfg, limits=lim, backend="cuda", dtype="bfloat16", segments=segs,
                    state_weights="(generated on the device)", toolkit={"program": str(PROGRAM_VERSION)},
                    target={"device": "cuda"}, workarounds=(), checksums={}, tokenizer={})


def build(cfg: Any, max_batch: int, max_seq_len: int, num_pages: int, buckets: list[int], seed: int = 0,
          backend_kwargs: dict[str, Any] | None = None, bits: int = 16,
          group: int = 128, packed: str = "all") -> tuple[Any, Any, dict[str, float]]:
    """Backend + runner on random device weights, KV and state filled; graphs captured for ``buckets``.
    ``backend_kwargs`` go to :class:`CudaBackend` (e.g. ``fused_gdn_decode``, ``moe_decode``). ``bits`` 16: bf16
    weights (``DeviceWeights.random``); 4 / 8: a GPTQ bundle's layout with projections and experts kept packed in
    groups of ``group`` (``DeviceWeights.random_packed``, benchmarks/gpu_decode_step_quant.py), or the experts only
    (``packed`` "experts": the layout of ``packed_weights=experts``; "dual": the experts packed and the projections
    in both forms, ``packed_weights=dual``)."""
    from hybrid_runtime.cuda.backend import CudaBackend, fill_random, fill_random_codes
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.cuda.kernels import load_module
    from hybrid_runtime.cuda.weights import DeviceWeights
    from hybrid_runtime.runner import ModelRunner

    t0 = time.perf_counter()
    dev = CudaDevice(0)
    mod = load_module("fused.cu", ("-DDT=2",), dev.arch)

    def fill(a: Any, s: int, scale: float, offset: float = 0.0) -> None:
        fill_random(dev, mod, a, s, scale, offset)

    m = manifest_for(cfg, max_batch, max_seq_len, num_pages)
    if bits == 16:
        w = DeviceWeights.random(dev, cfg, "bfloat16", max_seq_len, fill, seed=seed)
    else:
        w = DeviceWeights.random_packed(dev, cfg, "bfloat16", max_seq_len, fill, bits=bits, block_size=group,
                                        seed=seed, linears=packed in ("all", "dual"), dual=packed == "dual",
                                        fill_codes=lambda a, s, b: fill_random_codes(dev, mod, a, s, b))
    dev.synchronize()
    t1 = time.perf_counter()
    be = CudaBackend(None, m, device="cuda", cuda_device=dev, weights=w, **(backend_kwargs or {}))
    for layer in cfg.attention_layers:
        for pool in be.kv.buffers(layer):
            fill(pool, seed + layer, 1.0)
    for layer in cfg.linear_layers:
        fill(be.state.conv[layer], seed + 7 * layer, 0.5)
        fill(be.state.recurrent[layer], seed + 11 * layer, 0.05)
    dev.synchronize()
    t2 = time.perf_counter()
    runner = ModelRunner(None, m, backend=be)  # type: ignore[arg-type]
    be.capture_graphs(runner._forward, buckets=buckets)
    t3 = time.perf_counter()
    return be, runner, {"weights_s": t1 - t0, "backend_s": t2 - t1, "capture_s": t3 - t2, "graphs": len(be.graphs)}


def decode_case(be: Any, runner: Any, B: int, ctx: int, reps: int = 20, profile: bool = False) -> dict[str, Any]:
    from hybrid_runtime.engine import Phase
    from hybrid_runtime.runner import SampleRow, SeqStep
    from hybrid_runtime.sampling import SamplingParams

    ps = be.lim.page_size
    per = -(-(ctx + 1) // ps)
    rng = np.random.default_rng(B * 7 + ctx)
    perm = rng.permutation(be.num_pages)[:B * per]
    # page tables as the scheduler hands them over: int64 arrays (PageAllocator.table_view)
    steps = [SeqStep(b, np.asarray(perm[b * per:(b + 1) * per], np.int64), ctx - 1,
                     [int(rng.integers(0, be.cfg.vocab_size))])
             for b in range(B)]
    rows = [SampleRow(SamplingParams())] * B
    for _ in range(3):
        runner.step(Phase.DECODE, steps, rows)
    walls = []
    for _ in range(reps):
        t = time.perf_counter()
        runner.step(Phase.DECODE, steps, rows)
        walls.append(time.perf_counter() - t)
    ctx_obj = be.prepare(Phase.DECODE, steps, rows, False)
    g = ctx_obj.graph
    gpu = float("nan")
    nodes = 0
    if g is not None:
        be.dev.copy_htod(be.inp.ptr, be.host_in.array[:ctx_obj.upload_bytes])
        nodes = g.num_nodes
        gpu = time_on_stream(be.dev, lambda i: g.launch(), reps, runs=3, warmup=(), spin_cycles=0)
    routed = routed_experts(be, runner, steps, rows)
    prof = None
    if profile:
        import torch

        prof = be.profile_step(be.prepare(Phase.DECODE, steps, rows, False), runner._forward,
                               spin=lambda: torch.cuda._sleep(int(3e8)))
    return {"B": B, "ctx": ctx, "wall": statistics.median(walls), "gpu": gpu, "nodes": nodes, "profile": prof,
            "graph": None if g is None else f"b{ctx_obj.n}x{ctx_obj.plan.blocks_per_seq if ctx_obj.plan else 1}",
            "routed": routed}


def routed_experts(be: Any, runner: Any, steps: list[Any], rows: list[Any]) -> list[int]:
    """Distinct routed experts (the shared expert not counted) of every MoE layer, in layer order, in one eager
    decode step of ``steps``: the routing buffers (``active``: the experts with pairs, ascending, its count at
    index E_all) downloaded after each layer's MoE. The step advances the sequences' state as any step does."""
    from hybrid_runtime.cuda.backend import FOLD_MAX_TOKENS
    from hybrid_runtime.engine import Phase

    E = be.cfg.num_experts
    counts: list[int] = []
    orig = be.moe

    def moe(layer: int, ctx: Any, h: Any) -> Any:
        out = orig(layer, ctx, h)
        fold = be.w.moe(layer).fold and ctx.n <= FOLD_MAX_TOKENS
        act = be.dev.download(be.arena.bufs["active"]).reshape(-1)  # synchronises
        n_active = int(act[E + int(fold)])
        counts.append(int(np.count_nonzero(act[:n_active] < E)))
        return out

    ctx = be.prepare(Phase.DECODE, steps, rows, False)
    ctx.graph = None
    be.moe = moe
    try:
        be.execute(ctx, runner._forward)
    finally:
        del be.moe  # the class's method again
    return counts


def floor_bytes(cfg: Any, w: Any, B: int, ctx: int, routed: list[int] | None = None) -> dict[str, float]:
    """Bytes a decode step must read (see the module docstring). ``routed``: the distinct routed experts of each MoE
    layer as measured (:func:`routed_experts`); without it, the expectation under uniform routing."""
    E, k, H, inter = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    es = 2
    expert = 3 * H * inter * es
    nonexp = 0
    for name, a in w.arrays.items():
        if name in ("embed_tokens", "rope_cos", "rope_sin"):
            continue  # embeddings: B rows gathered; RoPE tables: B rows
        nonexp += a.nbytes
    nonexp += sum(w.moe(i).router.nbytes for i in range(cfg.num_layers) if cfg.ffn_types[i] == "moe")
    nmoe = sum(1 for t in cfg.ffn_types if t == "moe")
    expected = E * (1 - (1 - k / E) ** B)
    distinct = sum(routed) / len(routed) if routed else expected  # per MoE layer
    experts = nmoe * (distinct + 1) * expert  # + the shared expert
    kv = len(cfg.attention_layers) * B * ctx * cfg.num_kv_heads * cfg.head_dim * 2 * es
    gdn = len(cfg.linear_layers) * B * (2 * cfg.linear_num_value_heads * cfg.linear_key_head_dim
                                        * cfg.linear_value_head_dim * 4 + 2 * (cfg.conv_kernel - 1) * cfg.conv_dim * 4)
    lm = 0  # lm_head is among the non-expert weights
    return {"weights": nonexp + lm, "experts": experts, "kv": kv, "state": gdn,
            "total": nonexp + experts + kv + gdn, "distinct_experts": distinct, "expected_experts": expected}


def transformers_slice(torch: Any, cfg: Any, batches: list[int], ctx: int) -> dict[int, float]:
    """Wall seconds of one decode step of transformers' Qwen3_5MoeForCausalLM (bf16, GPU) after a prefill."""
    import transformers as tf

    tc = tf.Qwen3_5MoeTextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        layer_types=list(cfg.layer_types), num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.conv_kernel,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    with torch.device("cuda"):
        model = tf.Qwen3_5MoeForCausalLM(tc).to(torch.bfloat16).eval()
    out = {}
    for B in batches:
        ids = torch.randint(0, cfg.vocab_size, (B, ctx), device="cuda")
        with torch.no_grad():
            res = model(input_ids=ids, use_cache=True)
            cache = res.past_key_values
            nxt = res.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for _ in range(8):
                torch.cuda.synchronize()
                t = time.perf_counter()
                res = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = res.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
        out[B] = statistics.median(times[2:])
        log(f"transformers slice B={B}: {out[B] * 1e3:.2f} ms")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu_decode_step_h200.md")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="*", default=[1024, 32768])
    ap.add_argument("--slice-context", type=int, default=1024)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-full", action="store_true", help="only the 4-layer slice")
    ap.add_argument("--moe-decode", default="auto",
                    help="comma-separated CudaBackend moe_decode modes to run the 40-layer rows under (auto, "
                         "tensor_cores, cuda_cores): graphs are recaptured for each")
    ap.add_argument("--fused-router", default="on", choices=("on", "off"),
                    help="CudaBackend fused_router: the decode router GEMM + routing as one launch (<= 16 rows)")
    ap.add_argument("--fused-gdn", default="on",
                    help="comma-separated on/off: the 40-layer rows with the fused GDN decode pair (CudaBackend "
                         "fused_gdn_decode: 2 launches per GDN layer) and/or the four launches per layer; graphs are "
                         "recaptured for each")
    ap.add_argument("--dense-decode", default="on",
                    help="comma-separated: on (decode GEMMs of <= 16 rows on dense_decode.cu's kernel), on:MB (only "
                         "products of at most MB MiB of weights: the larger, e.g. lm_head, stay on cuBLASLt), off "
                         "(cuBLASLt for every GEMM); graphs are recaptured for each")
    args = ap.parse_args()
    dense_modes = [d for d in args.dense_decode.split(",") if d]
    for d in dense_modes:
        if d != "off" and d != "on" and not (d.startswith("on:") and d[3:].replace(".", "", 1).isdigit()):
            ap.error(f"--dense-decode {d!r}: on, on:MB or off")
    fused_modes = [{"on": True, "off": False}[f] for f in args.fused_gdn.split(",") if f]
    import torch

    from hybrid_runtime.cuda.backend import moe_path
    from hybrid_runtime.cuda.driver import CudaDevice

    torch.cuda.init()
    dev0 = CudaDevice(0, stream=0)
    bw = measure_copy_bandwidth(torch, dev0)
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    lines = [f"# Decode step on the GPU (`cuda` backend), {datetime.date.today()}", "",
             f"`python3 -m benchmarks.gpu_decode_step` on {torch.cuda.get_device_name(0)}; copy bandwidth measured in "
             f"this run: {bw / 1e12:.2f} TB/s (2 GiB device-to-device copy, read + write).", ""]
    # ---- the 4-layer slice: ours vs transformers
    sb = [b for b in args.batches if b <= 8] or [1]
    scfg = qwen35_moe_config(4)
    be, runner, load = build(scfg, max(sb), args.slice_context + 64, max(sb) * (-(-(args.slice_context + 64) // 16)),
                             sb)
    ours = {B: decode_case(be, runner, B, args.slice_context) for B in sb}
    del be, runner
    gc.collect()
    theirs: dict[int, float] = {}
    if not args.no_transformers:
        try:
            theirs = transformers_slice(torch, scfg, sb, args.slice_context)
        except Exception as e:  # report what ran; the table says it is missing
            log(f"transformers slice failed: {type(e).__name__}: {e}")
    lines += ["## 4-layer slice (3 GDN + 1 attention, same shapes), one decode step, wall clock", "",
              f"context {args.slice_context}", "",
              "| batch | ours: step (ms) | ours: graph replay, GPU (ms) | transformers 5 + fla (ms) | speed-up |",
              "|---|---|---|---|---|"]
    for B in sb:
        t = theirs.get(B)
        mine = ours[B]["wall"]
        tx = "-" if t is None else f"{t * 1e3:.2f}"
        up = "-" if t is None else f"{t / mine:.0f}x"
        lines.append(f"| {B} | {mine * 1e3:.3f} | {ours[B]['gpu'] * 1e3:.3f} | {tx} | {up} |")
    lines.append("")
    if not args.no_full:
        cfg = qwen35_moe_config(args.layers)
        max_ctx = max(args.contexts)
        maxB = max(args.batches)
        pages = maxB * (-(-(max_ctx + 16) // 16))
        free0 = torch.cuda.mem_get_info()[0]
        moe_modes = [m for m in args.moe_decode.split(",") if m]
        # captured under the first combination's settings; later ones recapture
        be, runner, load = build(cfg, maxB, max_ctx + 64, pages, args.batches,
                                 backend_kwargs={"moe_decode": moe_modes[0], "fused_gdn_decode": fused_modes[0],
                                                 "fused_router": args.fused_router == "on"})
        free1 = torch.cuda.mem_get_info()[0]
        log(f"loaded: {load}")
        tuned = ""
        if be.dense is not None and be.dense.choice:
            from hybrid_runtime.cuda.dense_decode import KNOB_SETS

            names = {kn: name for name, kn in KNOB_SETS.items()}
            tuned = (f" Dense decode GEMM builds picked at load ({be.dense_tune_seconds:.1f} s): " +
                     ", ".join(f"{N}x{K} {names.get(kn, kn)}" for (N, K), kn in sorted(be.dense.choice.items())) + ".")
            log(tuned)
        rows = []
        combos = [(mode, fused, dense) for dense in dense_modes for fused in fused_modes for mode in moe_modes]
        dense_k = be.dense
        if True in fused_modes and not (be.gdn_k is not None and be.gdn_k.fused_decode_ok):
            log("this GDN shape has no fused decode kernels: the fused rows run the four launches")
        for ci, (mode, fused, dense) in enumerate(combos):
            fused = fused and be.gdn_k is not None and be.gdn_k.fused_decode_ok

            def configure(mode: str = mode, fused: bool = fused, dense: str = dense) -> None:
                be.moe_decode, be.fused_gdn_decode = mode, fused
                be.dense = None if dense == "off" else dense_k
                be.dense_max_bytes = int(float(dense[3:]) * 2**20) if dense.startswith("on:") else None

            if ci:  # the graphs hold the MoE / GDN kernels they were captured with: capture again under these
                for g in be.graphs.values():
                    g.destroy()
                be.graphs.clear()
                configure()
                be.capture_graphs(runner._forward, buckets=args.batches)
            configure()
            gdn_label = "fused (2 launches/layer)" if fused else "4 launches/layer"
            dense_label = "cuBLASLt" if dense == "off" or dense_k is None else \
                ("dense_decode" if dense == "on" else f"dense_decode <= {dense[3:]} MiB")
            for B in args.batches:
                for ctx in args.contexts:
                    r = decode_case(be, runner, B, ctx, profile=ctx == min(args.contexts) and mode == moe_modes[0]
                                    and fused == fused_modes[0])
                    fl = floor_bytes(cfg, be.w, B, ctx, r["routed"])
                    r.update(fl)
                    r["floor"] = fl["total"] / bw
                    r["moe"] = f"{mode}: " + moe_path(False, B, be.moe_prefill is not None, mode)
                    r["gdn"] = gdn_label
                    r["dense"] = dense_label
                    rows.append(r)
                    log(f"B={B} ctx={ctx} moe {r['moe']}, GDN {gdn_label}, GEMMs {dense_label}: wall "
                        f"{r['wall'] * 1e3:.3f} ms, GPU "
                        f"{r['gpu'] * 1e3:.3f} ms, floor {r['floor'] * 1e3:.3f} ms ({r['gpu'] / r['floor']:.2f}x), "
                        f"{r['nodes']} kernels, graph {r['graph']}")
        lines += [f"## {args.layers} layers (Qwen3.5-35B-A3B text), bf16 weights and KV", "",
                  f"GPU memory in use after load: {(free0 - free1) / 2**30:.1f} GiB (weights "
                  f"{be.w.nbytes / 2**30:.1f} GiB, KV pool {pages} pages of 16 tokens, {maxB} state slots); load "
                  f"{load['weights_s']:.1f} s weights (generated on the device) + {load['backend_s']:.1f} s backend + "
                  f"{load['capture_s']:.1f} s warm-up and capture of {load['graphs']} graphs; fused decode router "
                  f"{args.fused_router}.{tuned}", "",
                  "| batch | context | decode MoE (mode: path) | GDN decode | decode GEMMs | floor (ms) | "
                  "GPU replay (ms) | x floor | step as served (ms) | x floor | kernels | graph | "
                  "routed experts / layer (uniform routing) | floor bytes: weights / experts / KV / state (GB) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['B']} | {r['ctx']} | {r['moe']} | {r['gdn']} | {r['dense']} | {r['floor'] * 1e3:.3f} | "
                         f"{r['gpu'] * 1e3:.3f} | "
                         f"{r['gpu'] / r['floor']:.2f} | {r['wall'] * 1e3:.3f} | {r['wall'] / r['floor']:.2f} | "
                         f"{r['nodes']} | {r['graph']} | {r['distinct_experts']:.1f} ({r['expected_experts']:.1f}) | "
                         f"{r['weights'] / 1e9:.2f} / {r['experts'] / 1e9:.2f} / "
                         f"{r['kv'] / 1e9:.2f} / {r['state'] / 1e9:.3f} |")
        lines += ["", "Goals (issue): <= 1.2x the floor at batch 1, <= 1.3x at batch 8, <= 1.5x at batch 64; >= 50x "
                  "transformers per decode step on the slice.", "",
                  "### Where an eager step's GPU time goes (CUDA events around every launch, queue filled first)", "",
                  "Eager launches with events between them (no graph, no PDL overlap): the kernels' own durations.", ""]
        for r in rows:
            if not r.get("profile"):
                continue
            tot = sum(t for _, t in r["profile"].values())
            nl = sum(c for c, _ in r["profile"].values())
            lines += [f"batch {r['B']}, context {r['ctx']}, GDN decode {r['gdn']}, decode GEMMs {r['dense']}: "
                      f"{tot * 1e3:.3f} ms in {nl} launches",
                      "",
                      "| kernel | launches | ms | share |", "|---|---|---|---|"]
            for name, (c, t) in sorted(r["profile"].items(), key=lambda kv: -kv[1][1]):
                lines.append(f"| {name} | {c} | {t * 1e3:.3f} | {t / tot:.0%} |")
            lines.append("")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
