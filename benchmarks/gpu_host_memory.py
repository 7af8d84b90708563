"""Host memory of the GPU engine under a soak-like load, without Triton (device script;
``python3 -m benchmarks.gpu_host_memory``).

The GPU soak's stub grew its anonymous memory in one glibc thread arena while its Python heap stayed flat
(benchmarks/results/gpu_serve_h200.md). This runs the serving engine alone (``ServingEngine`` in a process of
its own, the 35B-A3B shape cut to ``--layers`` with dummy weights, the tokenizer's vocabulary) under the soak's
kind of traffic — prompts of 1..``--max-prompt`` ids, 1..48 new tokens, greedy and seeded sampling, logprobs,
cancels mid-stream, 16 in flight — and samples, every ``--sample-s`` seconds:

* ``RssAnon`` of the process;
* glibc's ``mallinfo2()`` over all arenas: bytes in use (``uordblks``) and free in the arenas (``fordblks``);
* the anonymous mappings of ``/proc/self/smaps`` (the ones that grew most are printed at the end).

``HOSTMEM_PER_M_PLANS=1`` in a variant's environment gives its engine the per-M cuBLASLt plans of before
(``Blas(plans_by_class=False)``). Each ``--variants`` entry (``name`` or ``name:ENV=V,ENV=V``) runs in its
own subprocess with that environment, all of them at the same time on the one GPU (their growth per request
served is comparable; their speed is not). The growth is fitted after ``--warmup-s``; the results go to
``$GPU_REPORT_DIR`` (default /tmp) as ``gpu_host_memory.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("GPU_REPORT_DIR", "/tmp"))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def mallinfo() -> dict[str, float]:
    """glibc's allocator totals over all arenas, MiB: in use, free inside the arenas, mmapped blocks."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return {"in_use": m.uordblks / 2**20, "free": m.fordblks / 2**20, "mmapped": m.hblkhd / 2**20}


def anon_mappings() -> dict[str, float]:
    """Anonymous resident memory (MiB) per mapping start address of this process."""
    out: dict[str, float] = {}
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                cur = head[0].split("-")[0] + ("" if len(head) < 6 else ":" + head[5][-40:])
            elif head[0] == "Anonymous:" and cur is not None:
                kb = int(head[1])
                if kb:
                    out[cur] = out.get(cur, 0.0) + kb / 1024
    return out


def rss_anon() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def slope_per_1k(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (MiB per 1000 requests)."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs) or 1.0
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def worker(bundle: Path, seconds: float, warmup_s: float, sample_s: float, max_prompt: int, seed: int) -> dict:
    """The load and the series, in this process."""
    from hybrid_runtime.sampling import SamplingParams
    from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine

    if os.environ.get("HOSTMEM_PER_M_PLANS") == "1":  # the cuBLASLt plan cache before class plans (diagnostic)
        import functools

        import hybrid_runtime.cuda.backend as backend_mod
        backend_mod.Blas = functools.partial(backend_mod.Blas, plans_by_class=False)  # type: ignore[misc]
    # the bundle's KV pages exactly (no share of the free memory): the variants share one GPU
    eng = ServingEngine(bundle, RuntimeOptions(gpu_memory_fraction=0.0)).start()
    rng = random.Random(seed)
    lock = threading.Lock()
    done = [0]
    stop = threading.Event()
    inflight = threading.Semaphore(16)
    vocab = 1000

    def one(i: int) -> None:
        n = rng.randint(1, max_prompt)
        kind = rng.random()
        params = SamplingParams(max_tokens=rng.randint(1, 48), ignore_eos=True,
                                temperature=0.0 if kind < 0.5 else 0.8, top_p=1.0 if kind < 0.75 else 0.9,
                                top_k=0 if kind < 0.6 else 20, seed=i if kind > 0.7 else None,
                                logprobs=None if kind < 0.8 else rng.choice([0, 5]))
        cancel_at = rng.randint(1, 8) if rng.random() < 0.1 else 0
        rid = f"r{i}"
        seen = [0]

        def sink(ev) -> None:
            if ev.token_ids:
                seen[0] += 1
                if cancel_at and seen[0] == cancel_at:
                    eng.cancel(rid)
            if ev.final:
                with lock:
                    done[0] += 1
                inflight.release()

        eng.submit(GenerationRequest(rid, prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(n)),
                                     params=params), sink)

    def feed() -> None:
        i = 0
        while not stop.is_set():
            if inflight.acquire(timeout=1.0):
                if stop.is_set():
                    inflight.release()
                    break
                one(i)
                i += 1
                time.sleep(rng.random() * 0.01)

    t = threading.Thread(target=feed, daemon=True)
    t0 = time.monotonic()
    t.start()
    series: list[dict] = []
    maps0: dict[str, float] = {}
    try:
        while (now := time.monotonic() - t0) < seconds:
            time.sleep(sample_s)
            now = time.monotonic() - t0
            s = {"t": round(now, 1), "requests": done[0], "rss_anon": rss_anon(), **mallinfo()}
            series.append(s)
            if not maps0 and now >= warmup_s:
                maps0 = anon_mappings()
            print(f"[host-mem {os.environ.get('VARIANT', '')}] " + json.dumps(s), flush=True)
    finally:
        stop.set()
        t.join(timeout=30)
        maps1 = anon_mappings()
        eng.shutdown()
    grew = sorted(((maps1.get(k, 0.0) - maps0.get(k, 0.0), k) for k in set(maps0) | set(maps1)), reverse=True)
    after = [s for s in series if s["t"] >= warmup_s]
    xs = [s["requests"] for s in after]
    res = {"requests": done[0], "seconds": seconds, "warmup_s": warmup_s,
           "first": after[0] if after else None, "last": after[-1] if after else None,
           "slope_mib_per_1k_requests": {k: round(slope_per_1k(xs, [s[k] for s in after]), 3)
                                         for k in ("rss_anon", "in_use", "free", "mmapped")},
           "grown_mappings_mib": [(round(d, 2), k) for d, k in grew[:6] if d > 0.05],
           "series": series}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--root", type=Path, default=Path("/tmp/gpu_host_memory"))
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--warmup-s", type=float, default=40.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--variants", default="base", help="semicolon-separated name[:ENV=V,ENV=V]")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        res = worker(Path(args.worker), args.seconds, args.warmup_s, args.sample_s, args.max_prompt, 0)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    from benchmarks.gpu_serve import build

    bundle = build(args.root, args.layers, 16, 2048, tokenizer_vocab=True)
    procs = []
    for v in filter(None, args.variants.split(";")):
        name, _, envs = v.partition(":")
        env = dict(os.environ, VARIANT=name, PYTHONUNBUFFERED="1")
        env.update(dict(e.split("=", 1) for e in envs.split(",") if e))
        cmd = [sys.executable, "-m", "benchmarks.gpu_host_memory", "--worker", str(bundle), "--seconds",
               str(args.seconds), "--warmup-s", str(args.warmup_s), "--sample-s", str(args.sample_s),
               "--max-prompt", str(args.max_prompt)]
        procs.append((name, envs, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)))
    report = {}
    for name, envs, p in procs:
        out, _ = p.communicate(timeout=args.seconds + 600)
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        report[name] = {"env": envs, **(json.loads(line[-1][7:]) if line else {"error": out[-3000:]})}
    (OUT / "gpu_host_memory.json").write_text(json.dumps(report, indent=1))
    print("| variant | env | requests | RssAnon after warm-up -> end (MiB) | slope MiB / 1k requests: RssAnon, "
          "malloc in use, malloc free | mappings that grew most (MiB) |")
    print("|---|---|---|---|---|---|")
    for name, r in report.items():
        if "error" in r:
            print(f"| {name} | {r['env']} | error | | | |")
            continue
        s = r["slope_mib_per_1k_requests"]
        f, la = r["first"] or {}, r["last"] or {}
        print(f"| {name} | `{r['env']}` | {r['requests']} | {f.get('rss_anon', 0):.1f} -> {la.get('rss_anon', 0):.1f} "
              f"| {s['rss_anon']}, {s['in_use']}, {s['free']} | {r['grown_mappings_mib'][:3]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
