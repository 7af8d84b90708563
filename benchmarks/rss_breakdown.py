"""Where the peak RSS of our CPU worker goes (issue 18: the 334M shape at batch 16 within 1.5 GB).

``python -m benchmarks.rss_breakdown [--model qwen3-next-334m] [--batch 16] [--new 64] [--warmup]`` runs the offline
benchmark's workload (``benchmarks.offline``: a warm-up of ``batch`` x 16 tokens, then ``batch`` prompts of 128
random ids and ``--new`` tokens each, greedy) in a fresh process of its own and prints, in MiB (``--warmup``: the
engine starts with its load-time warm-up, ``RuntimeOptions.warmup``, as a served process does; "after loaded" then
includes it; by default it is off, as in the offline benchmark, so the workload is attributed alone):

* the process's RSS (anonymous / file-backed: library code) after the imports, after loading and after the
  workload, and the peak (VmHWM) next to the model's goal as a ratio (``benchmarks.offline.RSS_GOALS``);
* the load split into what the model must hold and the rest: the weights onnxruntime keeps (the fp32
  parameters without the embedding table, whose rows are read from the file, :mod:`hybrid_runtime.engine.table_rows`),
  the GDN state slots (resident rows only: the padding-sink row is never written on the CPU), the KV page pool,
  and the remainder (the sessions' own heap, library code first run at load);
* what is resident after the workload, by mapping (``/proc/self/smaps``): the anonymous mappings together (weights,
  state, KV, onnxruntime's arena, Python's heaps), ``[heap]`` (glibc's main arena) and each file-backed mapping by file
  name (library code: its resident pages depend on the page cache's state too, since a fault maps the cached folio
  around the page it needs);
* what serving adds, and which piece of the runner's pipeline raised the peak (engine segments, GDN, attention,
  MoE, head: the growth of the process's high-water mark VmHWM during each call, summed over the workload;
  growth between calls, such as the sampler's, is the rest of the step). What a piece leaves resident: its
  outputs, onnxruntime's shared arena (process-wide, so the first piece to need a larger region is charged),
  glibc's arenas, library code run for the first time.

It attributes; it changes nothing. The bundle is the one ``make bench`` builds (``--root``, default build/bench).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

MiB = 2**20
PIECES = ("segment", "gdn", "attention", "moe", "head", "execute")
MAPPINGS_SHOWN = 12  # the largest mappings the report names (the rest summed)


def status() -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(val.split()[0]) / 1024
    return out


def mappings(text: str | None = None) -> dict[str, float]:
    """Resident MiB by mapping of this process (or of ``text``, in ``/proc/<pid>/smaps`` format): "[anonymous]" for
    every mapping without a name, "[heap]", "[stack]" and the like as named, files by their base name."""
    if text is None:
        text = Path("/proc/self/smaps").read_text()
    out: Counter[str] = Counter()
    name: str | None = None
    for line in text.splitlines():
        head = line.split(None, 5)
        if not head:
            continue
        if "-" in head[0] and not head[0].endswith(":"):  # "lo-hi perms offset dev inode [path]"
            path = head[5].strip() if len(head) > 5 else ""
            name = "[anonymous]" if not path else (path if path.startswith("[") else Path(path).name)
        elif head[0] == "Rss:" and name is not None:
            out[name] += int(head[1]) / 1024
    return dict(out)


def worker(bundle: Path, batch: int, new: int, warmup: bool = False) -> dict:
    """Load ``bundle`` in this process (with the engine's load-time warm-up if ``warmup``), run the workload,
    return the stages and the per-piece growth."""
    from hybrid_runtime import backend as bk
    from hybrid_runtime.sampling import SamplingParams
    from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine, generate

    from .offline import PROMPT, _prompts

    stages = {"imports": status()}
    growth: Counter[str] = Counter()
    for name in PIECES:  # growth of the high-water mark during each call of the backend's pipeline pieces
        orig = getattr(bk.HostBackend, name)

        def timed(self, *args, _orig=orig, _name=name, **kwargs):
            before = status()["VmHWM"]
            out = _orig(self, *args, **kwargs)
            growth[_name] += status()["VmHWM"] - before
            return out

        setattr(bk.HostBackend, name, timed)
    eng = ServingEngine(bundle, RuntimeOptions(warmup=warmup)).start()  # off: attributes the workload alone
    try:
        stages["loaded"] = status()
        cfg = eng.manifest.model
        ops = eng.runner.backend.ops
        lay = ops.state.layout
        held = {
            "weights (fp32 parameters without the embedding table)":
                (cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size) * 4 / MiB,
            "GDN state slots (resident rows)":
                lay.num_slots * (lay.conv_row_bytes + lay.recurrent_row_bytes) * len(ops.state.conv) / MiB,
            "KV page pool (all attention layers)": ops.kv_layout.total_bytes / MiB,
        }
        vocab = cfg.vocab_size

        def run(prompts: list[list[int]], n: int, tag: str) -> None:
            generate(eng, [GenerationRequest(f"{tag}{i}", prompt_ids=tuple(p), params=SamplingParams(
                max_tokens=n, ignore_eos=True)) for i, p in enumerate(prompts)])

        run(_prompts(batch, 16, 99, vocab), 4, "warm")
        stages["warm"] = status()
        run(_prompts(batch, PROMPT, batch, vocab), new, "d")
        stages["workload"] = status()
        maps = mappings()
        tokens_per_step = eng.manifest.limits.max_num_tokens
    finally:
        eng.shutdown()
    return {"stages": stages, "held": held, "growth": dict(growth), "max_num_tokens": tokens_per_step,
            "warmup": warmup, "mappings": maps}


def report(name: str, batch: int, res: dict) -> str:
    from .offline import RSS_GOALS

    st, held = res["stages"], res["held"]
    imp, load, work = st["imports"], st["loaded"], st["workload"]
    warm = ("; engine started with its load-time warm-up, in the load and its rest below" if res.get("warmup")
            else "")
    lines = [f"peak RSS of our worker, {name}, batch {batch} (prefill steps of up to {res['max_num_tokens']} "
             f"tokens{warm}), MiB:", "", "| stage | RSS | anonymous | file-backed (library code) |",
             "|---|---|---|---|"]
    for key, s in st.items():
        lines.append(f"| after {key} | {s['VmRSS']:.1f} | {s['RssAnon']:.1f} | {s['RssFile']:.1f} |")
    lines.append(f"| peak (VmHWM) | {work['VmHWM']:.1f} | | |")
    lines += ["", "| where it goes | MiB |", "|---|---|",
              f"| imports (Python, numpy, onnxruntime, tokenizers, the runtime) | {imp['VmRSS']:.1f} |"]
    lines += [f"| {k} | {v:.1f} |" for k, v in held.items()]
    rest = load["VmRSS"] - imp["VmRSS"] - sum(held.values())
    lines.append(f"| rest of the load (the sessions' own heap, library code first run) | {rest:.1f} |")
    serving = work["VmRSS"] - load["VmRSS"]
    lines.append(f"| serving: RSS growth after load | {serving:.1f} |")
    lines.append(f"| peak growth after load (VmHWM), raised during: | {work['VmHWM'] - load['VmHWM']:.1f} |")
    labels = {"segment": "engine segments", "gdn": "GDN operator", "attention": "attention operator",
              "moe": "MoE operator", "head": "head", "execute": "whole steps (the pieces above and the rest)"}
    lines += [f"| &nbsp; {labels[k]} | {res['growth'].get(k, 0.0):.1f} |" for k in PIECES]
    lines.append(f"| transient above the final RSS | {work['VmHWM'] - work['VmRSS']:.1f} |")
    maps = res.get("mappings")
    if maps:
        top = sorted(maps.items(), key=lambda kv: -kv[1])
        shown = top[:MAPPINGS_SHOWN]
        lines += ["", "| resident after the workload, by mapping | MiB |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in shown]
        if len(top) > len(shown):
            lines.append(f"| {len(top) - len(shown)} other mappings | {sum(v for _, v in top[len(shown):]):.1f} |")
    goal = RSS_GOALS.get(name)
    if goal is not None and goal[0] == batch:
        peak = work["VmHWM"]
        lines += ["", f"peak {peak:.1f} MiB, goal {goal[1] / MiB:.1f} MiB: **{peak * MiB / goal[1]:.3f}x**"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("build/bench"))
    ap.add_argument("--model", default="qwen3-next-334m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt (the offline benchmark's 64)")
    ap.add_argument("--warmup", action="store_true", help="start the engine with its load-time warm-up (a served "
                    "process's default) before the workload")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.batch < 1 or args.new < 1:
        ap.error("--batch and --new must be >= 1")
    if args.worker:
        print(json.dumps(worker(args.worker, args.batch, args.new, args.warmup)))
        return 0
    from .offline import MODELS, _prepare

    if args.model not in MODELS:
        ap.error(f"unknown model {args.model!r}: choose from {', '.join(MODELS)}")
    import subprocess  # not imported by the worker (1.2 MiB of its RSS, counted in "imports")

    _, bundle = _prepare(args.root, args.model)
    cmd = [sys.executable, "-m", "benchmarks.rss_breakdown", "--worker", str(bundle), "--batch", str(args.batch),
           "--new", str(args.new)] + (["--warmup"] if args.warmup else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    print(report(args.model, args.batch, json.loads(out.stdout.strip().splitlines()[-1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
