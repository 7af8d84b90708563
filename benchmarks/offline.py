"""Offline CPU benchmark (``make bench``): our runtime vs transformers ``generate`` on the same checkpoint.

For the embedded default model and a ~100M-parameter random config of the same family, measured in one
run: decode tokens/s at batch 1, 4 and 16, prefill tokens/s, the ratio to transformers (torch CPU,
same thread count), and the share of our step time spent outside onnxruntime and the numpy operators
(Python overhead). Prints a markdown table; ``--out FILE`` also writes it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from builder.bundle import BuildOptions, build_bundle
from builder.default_model import write_default_checkpoint
from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine, generate

LARGE = {  # ~100M parameters: 12 layers (9 GDN, 3 gated attention), MoE 8 experts top-2 + shared expert
    "hidden_size": 640, "num_hidden_layers": 12,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    + ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 384, "shared_expert_intermediate_size": 384,
}
PROMPT, NEW, PREFILL_PROMPT = 32, 32, 256


def _prepare(root: Path, name: str, overrides: dict | None) -> tuple[Path, Path]:
    ckpt, bundle = root / f"{name}_ckpt", root / f"{name}_bundle"
    if not (ckpt / "config.json").exists():
        write_default_checkpoint(ckpt, progress=lambda _m: None, overrides=overrides)
    if not (bundle / "manifest.json").exists():
        build_bundle(ckpt, bundle, BuildOptions(max_batch_size=16, max_input_len=512, max_seq_len=1024),
                     progress=lambda _m: None)
    return ckpt, bundle


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 2000, length)] for _ in range(n)]


def ours(bundle: Path, batch: int, repeats: int) -> dict[str, float]:
    eng = ServingEngine(bundle, RuntimeOptions()).start()
    try:
        generate(eng, [GenerationRequest("warm", prompt_ids=tuple(range(3, 40)), params=SamplingParams(max_tokens=4))])
        eng.runner.timings.clear()
        before = eng.stats()
        for r in range(repeats):
            reqs = [GenerationRequest(f"d{r}-{i}", prompt_ids=tuple(p), params=SamplingParams(
                max_tokens=NEW, ignore_eos=True)) for i, p in enumerate(_prompts(batch, PROMPT, r))]
            generate(eng, reqs)
        after = eng.stats()
        dsec = after["step_seconds"]["decode"] - before["step_seconds"].get("decode", 0)
        dtok = after["step_tokens"]["decode"] - before["step_tokens"].get("decode", 0)
        inside = sum(eng.runner.timings.values())
        total = dsec + after["step_seconds"]["prefill"] - before["step_seconds"]["prefill"]
        # prefill throughput: 4 long prompts in one workload
        t_pre = after["step_seconds"]["prefill"]
        n_pre = after["step_tokens"]["prefill"]
        generate(eng, [GenerationRequest(f"p{i}", prompt_ids=tuple(p), params=SamplingParams(max_tokens=1))
                       for i, p in enumerate(_prompts(4, PREFILL_PROMPT, 77))])
        end = eng.stats()
        pre_tps = (end["step_tokens"]["prefill"] - n_pre) / (end["step_seconds"]["prefill"] - t_pre)
    finally:
        eng.shutdown()
    return {"decode_tps": dtok / dsec, "prefill_tps": pre_tps, "overhead": max(0.0, 1 - inside / total)}


def transformers_baseline(ckpt: Path, batch: int, repeats: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    dec_t = dec_n = 0.0
    with torch.no_grad():
        for r in range(repeats + 1):  # the first round warms up
            ids = torch.tensor(_prompts(batch, PROMPT, r))
            t0 = time.perf_counter()
            model(ids)
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            t2 = time.perf_counter()
            if r:
                dec_t += (t2 - t1) - (t1 - t0)  # generate = prefill + decode steps
                dec_n += batch * (NEW - 1)
        ids = torch.tensor(_prompts(4, PREFILL_PROMPT, 77))
        t0 = time.perf_counter()
        model(ids)
        pre = 4 * PREFILL_PROMPT / (time.perf_counter() - t0)
    return {"decode_tps": dec_n / dec_t, "prefill_tps": pre}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", type=Path, default=Path("build/bench"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default="default,large")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = ["| model | params | batch | ours decode tok/s | transformers decode tok/s | ratio | "
            "ours prefill tok/s | transformers prefill tok/s | ratio | python overhead |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        ckpt, bundle = _prepare(args.root, name, LARGE if name == "large" else None)
        from hybrid_runtime.config import Manifest

        params = Manifest.load(bundle).model.num_parameters()
        for batch in (1, 4, 16):
            a = ours(bundle, batch, args.repeats)
            b = transformers_baseline(ckpt, batch, args.repeats)
            rows.append(f"| {name} | {params / 1e6:.1f}M | {batch} | {a['decode_tps']:.0f} | {b['decode_tps']:.0f} | "
                        f"{a['decode_tps'] / b['decode_tps']:.1f}x | {a['prefill_tps']:.0f} | {b['prefill_tps']:.0f} | "
                        f"{a['prefill_tps'] / b['prefill_tps']:.1f}x | {a['overhead']:.0%} |")
            print(rows[-1], flush=True)
    table = "\n".join(rows)
    print("\n" + table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"Command: python -m benchmarks.offline --repeats {args.repeats}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
