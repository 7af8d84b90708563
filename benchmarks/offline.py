"""Offline CPU benchmark (``make bench``): our runtime vs transformers on the same checkpoint, same run.

Models (seeded random weights written by the project's own ``builder.default_model``, no download):
``default`` (the embedded 3.7M smoke model), ``large`` (~100M, 12 layers, MoE 8 experts) and
``qwen3-next-334m`` (the shape of issue 18: hidden 1024, 12 layers 3 GDN : 1 gated attention, 16 experts
top-2 + shared expert, vocab 32000). Workload: prompts of 128 random ids, 64 new tokens, greedy, at batch
1, 4 and 16, plus a prefill of 4 prompts x 256 tokens; every number comes from its own process (so each
side's peak RSS is its own), both sides with the same thread count, and the two sides alternate
``--repeats`` times: a table cell is the best of its repeats and the spread (worst vs best) is printed
beside it, which is how noisy the machine was.

* decode tok/s: generated tokens over decode time (ours: wall time of the serving loop's decode steps;
  transformers: ``generate`` minus one forward of the prompt, over the 63 tokens after the first);
* prefill tok/s: prompt tokens over prefill time (ours: the serving loop's prefill steps, in chunks of the
  bundle's ``max_num_tokens``; transformers: one forward of the whole batch);
* peak RSS: the process's high-water mark (VmHWM) after loading, prefill and decode (the lowest of the
  repeats); where a model has a goal (:data:`RSS_GOALS`: qwen3-next-334m at batch 16 within 1.5 GB, issue
  18) a line after the table gives ours over the goal as a ratio (<= 1.00x meets it);
* our step split: share of decode-step time in the engine segments, the GDN, attention and MoE operators,
  and outside them (Python: scheduling, sampling, bookkeeping).

``--out FILE`` writes the markdown table with the command that produced it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from builder.bundle import BuildOptions

PROMPT, NEW = 128, 64
PREFILL_BATCH, PREFILL_LEN = 4, 256
BATCHES = (1, 4, 16)

LARGE = {  # ~100M parameters: 12 layers (9 GDN, 3 gated attention), MoE 8 experts top-2 + shared expert
    "hidden_size": 640, "num_hidden_layers": 12,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 3,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 384, "shared_expert_intermediate_size": 384,
}
QWEN3_NEXT_334M = {  # issue 18: 333.6M parameters, ~170M active per token
    "hidden_size": 1024, "num_hidden_layers": 12,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 3,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
    "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 32000, "tie_word_embeddings": False,
}
MODELS: dict[str, dict | None] = {"default": None, "large": LARGE, "qwen3-next-334m": QWEN3_NEXT_334M}
# Peak-RSS goals (model -> (batch, bytes)): issue 18, the 334M shape at batch 16 within 1.5 GB (1.5e9 bytes).
RSS_GOALS: dict[str, tuple[int, float]] = {"qwen3-next-334m": (16, 1.5e9)}
# The bench bundles' KV pool, in tokens: the most any workload holds at once (batch 16 x (128 + 64)).
KV_POOL_TOKENS = max(max(BATCHES) * (PROMPT + NEW), PREFILL_BATCH * (PREFILL_LEN + 1))


def _prepare(root: Path, name: str) -> tuple[Path, Path]:
    from builder.bundle import build_bundle
    from builder.default_model import write_default_checkpoint

    ckpt, bundle = root / f"{name}_ckpt", root / f"{name}_bundle"
    if not (ckpt / "config.json").exists():
        write_default_checkpoint(ckpt, progress=lambda _m: None, overrides=MODELS[name])
    options = _build_options()
    if not _current(bundle, options):
        build_bundle(ckpt, bundle, options, progress=lambda _m: None)
    return ckpt, bundle


def _build_options() -> BuildOptions:
    """The bundle's limits are the workload's: batch up to 16, prompts up to PREFILL_LEN, sequences up to the
    longest any workload makes (PREFILL_LEN + 1 for the prefill workload; PROMPT + NEW = 192 for decode),
    prefill in chunks of 128 tokens, and a KV pool of :data:`KV_POOL_TOKENS` tokens.

    The KV pool is a token budget, as llama.cpp's context size (``-c``: one pool of tokens shared by the
    sequences) or vLLM's KV budget, not the builder's default of every slot at max_seq_len at once (16 x 257
    tokens, 51 MiB for the 334M model, of which no workload here uses more than 36): the largest number of
    tokens a workload holds at once, 16 x (PROMPT + NEW) = 3072 (192 pages, 36 MiB). The prefill workload's 4 x
    257 tokens take 68 of them. The scheduler reserves a sequence's whole length at admission, so a request that
    did not fit would wait, never fail; none waits here. The pool stays resident from load (issue 21).
    The chunk bounds a prefill step's intermediates and the segments' output banks: 128-token chunks put 12 MiB
    less on the b16 peak RSS of the 334M model than 256 (512: +39 more), prefill tok/s the same within noise
    (measured on the 2-core machine)."""
    from builder.bundle import BuildOptions

    page = BuildOptions().page_size
    return BuildOptions(max_batch_size=max(BATCHES), max_input_len=PREFILL_LEN,
                        max_seq_len=max(PROMPT + NEW, PREFILL_LEN + 1), max_num_tokens=128, page_size=page,
                        num_kv_pages=-(-KV_POOL_TOKENS // page))


def _current(bundle: Path, options: BuildOptions) -> bool:
    """Whether ``bundle`` exists, has the limits of ``options`` and holds every state weight this runtime
    reads (else it is rebuilt)."""
    from hybrid_runtime.config import Manifest
    from hybrid_runtime.pipeline import state_weight_names
    from hybrid_runtime.weights_io import SafetensorsFile

    if not (bundle / "manifest.json").exists():
        return False
    m = Manifest.load(bundle)
    if m.limits != options.limits():
        return False
    return set(state_weight_names(m.model)) <= set(SafetensorsFile(bundle / m.state_weights).keys())


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, min(vocab, 2000), length)] for _ in range(n)]


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


# ---- workers (each runs in its own process) -------------------------------------------------------------
def worker_ours(bundle: Path, batch: int) -> dict:
    """Our serving loop: decode/prefill of ``batch`` x PROMPT (batch 4 also: PREFILL_BATCH x PREFILL_LEN)."""
    from hybrid_runtime.engine import Phase
    from hybrid_runtime.sampling import SamplingParams
    from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine, generate

    eng = ServingEngine(bundle, RuntimeOptions(warmup=False)).start()  # the workload warms up below
    vocab = eng.manifest.model.vocab_size
    split: dict[Phase, Counter] = {Phase.PREFILL: Counter(), Phase.DECODE: Counter()}
    runner = eng.runner
    backend, execute = runner.backend, runner.backend.execute

    # Every step of the host backend runs in its execute(), whichever of the runner's entries the serving loop
    # uses (step, or launch / collect since async scheduling): attribute the operators' time to the step's phase.
    def timed_execute(ctx, forward):
        before, t0 = Counter(runner.timings), time.perf_counter()
        out = execute(ctx, forward)
        split[ctx.phase].update(runner.timings - before)
        split[ctx.phase]["step"] += time.perf_counter() - t0
        return out

    backend.execute = timed_execute  # type: ignore[method-assign]
    try:
        def workload(prompts: list[list[int]], new: int, tag: str) -> tuple[float, float]:
            before = eng.stats()
            for c in split.values():
                c.clear()
            generate(eng, [GenerationRequest(f"{tag}{i}", prompt_ids=tuple(p), params=SamplingParams(
                max_tokens=new, ignore_eos=True)) for i, p in enumerate(prompts)])
            after = eng.stats()
            tps = [(after["step_tokens"].get(ph, 0) - before["step_tokens"].get(ph, 0))
                   / max(1e-9, after["step_seconds"].get(ph, 0) - before["step_seconds"].get(ph, 0))
                   for ph in ("prefill", "decode")]
            return tps[0], tps[1]

        workload(_prompts(batch, 16, 99, vocab), 4, "warm")  # first runs of every session
        res: dict = {}
        res["prefill_tps"], res["decode_tps"] = workload(_prompts(batch, PROMPT, batch, vocab), NEW, "d")
        d = split[Phase.DECODE]
        if not d["step"]:
            raise RuntimeError("no decode step was timed: the serving loop no longer runs steps through the "
                               "backend's execute()")
        res["split"] = {k: d[k] / d["step"] for k in ("segments", "gdn", "attention", "moe")}
        if batch == PREFILL_BATCH:
            res["prefill_long_tps"], _ = workload(_prompts(PREFILL_BATCH, PREFILL_LEN, 77, vocab), 1, "p")
    finally:
        eng.shutdown()
    res["peak_rss"] = _peak_rss()
    return res


def worker_transformers(ckpt: Path, batch: int) -> dict:
    """transformers ``generate`` (greedy, fp32, torch CPU) on the same checkpoint and prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size
    res: dict = {}
    with torch.no_grad():
        warm = torch.tensor(_prompts(batch, 16, 99, vocab))
        model.generate(warm, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        ids = torch.tensor(_prompts(batch, PROMPT, batch, vocab))
        t0 = time.perf_counter()
        model(ids)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        t2 = time.perf_counter()
        res["prefill_tps"] = batch * PROMPT / (t1 - t0)
        res["decode_tps"] = batch * (NEW - 1) / ((t2 - t1) - (t1 - t0))  # generate = prefill + decode steps
        if batch == PREFILL_BATCH:
            ids = torch.tensor(_prompts(PREFILL_BATCH, PREFILL_LEN, 77, vocab))
            t0 = time.perf_counter()
            model(ids)
            res["prefill_long_tps"] = PREFILL_BATCH * PREFILL_LEN / (time.perf_counter() - t0)
    res["peak_rss"] = _peak_rss()
    return res


def _spawn(side: str, path: Path, batch: int) -> dict:
    import subprocess  # here, not at the top: a worker's peak RSS is the runtime's, not the launcher's (1.2 MiB)

    cmd = [sys.executable, "-m", "benchmarks.offline", "--worker", side, "--path", str(path), "--batch", str(batch)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- the table --------------------------------------------------------------------------------------------
def _cell(vals: list[float], fmt: str = "{:.0f}") -> str:
    """Best of the repeats, with the spread (worst vs best) when there were several."""
    best = max(vals)
    spread = f" ±{(best - min(vals)) / best:.0%}" if len(vals) > 1 else ""
    return fmt.format(best) + spread


def rss_goal_line(name: str, batch: int, peak: int) -> str | None:
    """Our peak RSS (bytes, the best of the repeats) next to the model's goal at that batch, as a ratio
    (<= 1.00x meets it); None when the model has no goal at this batch."""
    if RSS_GOALS.get(name, (None,))[0] != batch:
        return None
    goal = RSS_GOALS[name][1]
    return (f"peak RSS goal, {name} batch {batch}: ours {peak / 2**20:.1f} MiB, goal <= {goal / 1e9:.1f} GB "
            f"({goal / 2**20:.1f} MiB): **{peak / goal:.3f}x** ({'met' if peak <= goal else 'not met'})")


def measure(name: str, root: Path, repeats: int, batches: tuple[int, ...],
            notes: list[str] | None = None) -> list[str]:
    """The table rows of model ``name``; lines about goals (peak RSS) are appended to ``notes``."""
    ckpt, bundle = _prepare(root, name)
    from hybrid_runtime.config import Manifest

    params = Manifest.load(bundle).model.num_parameters()
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(repeats):  # alternate the sides so slow phases of a shared machine hit both
        for b in batches:
            runs.setdefault(("ours", b), []).append(_spawn("ours", bundle, b))
            runs.setdefault(("hf", b), []).append(_spawn("transformers", ckpt, b))
    rows = []
    for b in batches:
        o, h = runs[("ours", b)], runs[("hf", b)]
        best = lambda rs, k: max(r[k] for r in rs)  # noqa: E731
        split = max(o, key=lambda r: r["decode_tps"])["split"]
        other = max(0.0, 1 - sum(split.values()))
        cells = [name, f"{params / 1e6:.1f}M", str(b),
                 _cell([r["decode_tps"] for r in o], "{:.1f}"), _cell([r["decode_tps"] for r in h], "{:.1f}"),
                 f"**{best(o, 'decode_tps') / best(h, 'decode_tps'):.2f}x**",
                 _cell([r["prefill_tps"] for r in o]), _cell([r["prefill_tps"] for r in h]),
                 f"**{best(o, 'prefill_tps') / best(h, 'prefill_tps'):.2f}x**",
                 f"{min(r['peak_rss'] for r in o) / 1e9:.2f}", f"{min(r['peak_rss'] for r in h) / 1e9:.2f}",
                 " / ".join(f"{split[k]:.0%}" for k in ("segments", "gdn", "attention", "moe")) + f" / {other:.0%}"]
        rows.append("| " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
        if (line := rss_goal_line(name, b, min(r["peak_rss"] for r in o))) is not None and notes is not None:
            notes.append(line)
        if b == PREFILL_BATCH:
            ol, hl = [r["prefill_long_tps"] for r in o], [r["prefill_long_tps"] for r in h]
            rows.append(f"| {name} | | prefill {PREFILL_BATCH} x {PREFILL_LEN} | | | | {_cell(ol)} | {_cell(hl)} | "
                        f"**{max(ol) / max(hl):.2f}x** | | | |")
            print(rows[-1], flush=True)
    return rows


HEADER = ("| model | params | batch | ours decode tok/s | transformers decode tok/s | ratio | ours prefill tok/s | "
          "transformers prefill tok/s | ratio | ours peak RSS GB | transformers peak RSS GB | "
          "our decode step: segments / GDN / attention / MoE / other |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("build/bench"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", choices=("ours", "transformers"), help=argparse.SUPPRESS)
    ap.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        fn = worker_ours if args.worker == "ours" else worker_transformers
        print(json.dumps(fn(args.path, args.batch)))
        return 0
    names = args.models.split(",")
    if unknown := [n for n in names if n not in MODELS]:
        ap.error(f"unknown model(s) {unknown}: choose from {', '.join(MODELS)}")
    batches = tuple(int(b) for b in args.batches.split(","))
    print(HEADER, flush=True)
    notes: list[str] = []
    rows = [r for n in names for r in measure(n, args.root, args.repeats, batches, notes)]
    table = HEADER + "\n" + "\n".join(rows) + "".join("\n\n" + line for line in notes)
    print("\n" + table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        cmd = (f"python -m benchmarks.offline --repeats {args.repeats} --models {args.models} "
               f"--batches {args.batches} --out {args.out}")
        args.out.write_text(f"Command: {cmd}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
