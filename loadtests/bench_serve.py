"""``make bench-serve``: genai-perf against the hybrid_llm server at concurrency 1, 4 and 16, through Triton's
own endpoint and through the OpenAI-compatible frontend, side by side.

* ``triton``: genai-perf in Triton mode with the vLLM-backend convention over the gRPC stream
  (``--endpoint-type kserve --backend vllm --streaming``): ``text_input``, ``stream``, and
  ``sampling_parameters`` carrying ``max_tokens`` = ``min_tokens`` (``--output-tokens-mean-deterministic``,
  so every request generates exactly OUTPUT_TOKENS tokens).
* ``chat``: genai-perf's OpenAI chat endpoint (``--endpoint-type chat --streaming``, perf_analyzer's
  ``openai`` service kind, server-sent events) against ``python -m frontend``, with ``max_tokens`` and, as
  extra inputs, ``min_tokens`` = OUTPUT_TOKENS and ``temperature`` 0 (greedy, as the Triton run is), so the
  requests ask the server for the same work; the chat template adds its few tokens to each prompt.

The difference of the two rows at a concurrency level is what the frontend adds (HTTP + SSE + its own
gRPC hop) to time to first token and inter-token latency. Prompts are synthetic, INPUT_TOKENS tokens each,
counted with the bundle's own tokenizer (``--tokenizer <bundle dir>``, offline).

genai-perf 0.0.16 lives in its own venv (``build/genai-perf-venv``, made by the Makefile) and drives
``perf_analyzer`` from the tritonclient 2.51.0 wheel, which needs Debian's libb64-0d and ``libcudart.so.12``
(from the venv's nvidia-cuda-runtime-cu12, put on LD_LIBRARY_PATH here). The server is started here on
free 127.0.0.1 ports (MULTI_BLOCK / PROFILE_PINNING as for ``make serve``) unless URL (a running server's
HTTP host:port; gRPC = port + 1 unless GRPC_URL) is given. The frontend is the one at FRONTEND_URL
(``host:port``), else one started here in front of the server (``frontend.process.FrontendProcess``).

Note on the numbers: genai-perf counts output tokens by re-tokenizing the streamed text, so with a
random-weight model its output sequence length (and the token throughput and ITL derived from it) can
differ from the tokens the server generated; the server's own count is printed beside it.

Artifacts: ``reports/bench-serve/c<N>/`` (genai-perf's CSV/JSON per level), ``reports/bench_serve.json``
and ``reports/bench_serve.md`` (the combined table).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from .common import MODEL, REPO, BundleInfo, Target, model_config, model_parameters
from .soak import metric, scrape

DEFAULT_GENAI_PERF = REPO / "build" / "genai-perf-venv" / "bin" / "genai-perf"


def log(msg: str) -> None:
    print(f"[bench-serve] {msg}", flush=True)


def genai_env(genai_perf: Path) -> dict[str, str]:
    """PATH with the venv's perf_analyzer first, libcudart.so.12 on LD_LIBRARY_PATH, Hugging Face offline."""
    venv = genai_perf.resolve().parent.parent
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    libs = sorted(str(p) for p in venv.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib"))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                "COLUMNS": "160"})  # genai-perf's table is drawn for the terminal width
    return env


def check_tools(genai_perf: Path, env: dict[str, str]) -> None:
    if not genai_perf.is_file():
        raise SystemExit(f"error: {genai_perf} is missing; `make bench-serve` creates build/genai-perf-venv")
    pa = subprocess.run(["perf_analyzer", "--version"], env=env, capture_output=True, text=True, timeout=60)
    if pa.returncode != 0:
        raise SystemExit("error: perf_analyzer does not run: " + (pa.stderr or pa.stdout).strip()[-500:] +
                         "\n(it needs Debian's libb64-0d: apt-get install -y libb64-0d)")


ENDPOINTS = ("triton", "chat")
ENDPOINT_NAMES = {"triton": "Triton (kserve gRPC)", "chat": "frontend (OpenAI chat, SSE)"}


def endpoint_args(endpoint: str, target: Target, frontend_url: str, args: argparse.Namespace) -> list[str]:
    """genai-perf's endpoint options for ``triton`` (kserve gRPC, vLLM convention) or ``chat`` (the frontend)."""
    if endpoint == "triton":
        return ["--endpoint-type", "kserve", "--backend", "vllm", "--streaming", "-u", target.grpc,
                "--output-tokens-mean-deterministic"]
    return ["--endpoint-type", "chat", "--streaming", "-u", frontend_url,
            "--extra-inputs", f"min_tokens:{args.output_tokens}", "--extra-inputs", "temperature:0"]


def run_level(genai_perf: Path, env: dict[str, str], target: Target, tokenizer: Path, concurrency: int,
              args: argparse.Namespace, out: Path, endpoint: str = "triton", frontend_url: str = "") -> dict[str, Any]:
    requests = max(args.min_requests, args.requests_per_user * concurrency)
    warmup = max(2, concurrency)
    cmd = [str(genai_perf), "profile", "-m", MODEL, *endpoint_args(endpoint, target, frontend_url, args),
           "--concurrency", str(concurrency), "--request-count", str(requests),
           "--warmup-request-count", str(warmup),
           "--synthetic-input-tokens-mean", str(args.input_tokens), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
           "--tokenizer", str(tokenizer), "--random-seed", "0", "--artifact-dir", str(out)]
    log(f"{endpoint}, concurrency {concurrency}: {requests} requests: {' '.join(cmd)}")
    before = scrape(target.metrics)
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=out.parent, timeout=args.timeout, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(proc.stdout)
    sys.stdout.flush()
    if proc.returncode != 0:
        raise SystemExit(f"error: genai-perf exited with {proc.returncode} at concurrency {concurrency}")
    after = scrape(target.metrics)
    exports = sorted(out.glob("**/profile_export_genai_perf.json"))
    if not exports:
        raise SystemExit(f"error: genai-perf wrote no profile_export_genai_perf.json under {out}")
    data = json.loads(exports[-1].read_text())
    tokens = (metric(after, "generated_tokens_total") or 0) - (metric(before, "generated_tokens_total") or 0)
    return {"endpoint": endpoint, "concurrency": concurrency, "requests": requests, "warmup_requests": warmup,
            "seconds": round(time.monotonic() - t0, 1),
            "ttft_ms": _pick(data, "time_to_first_token"), "itl_ms": _pick(data, "inter_token_latency"),
            "request_latency_ms": _pick(data, "request_latency"),
            "output_token_throughput": data.get("output_token_throughput", {}).get("avg"),
            "request_throughput": data.get("request_throughput", {}).get("avg"),
            "output_sequence_length": data.get("output_sequence_length", {}).get("avg"),
            "server_generated_tokens": tokens, "export": str(exports[-1]),
            "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def _pick(data: dict[str, Any], key: str) -> dict[str, float | None]:
    d = data.get(key) or {}
    return {k: d.get(k) for k in ("avg", "p50", "p99")}


def _f(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def server_len(r: dict[str, Any]) -> float | None:
    """Tokens the server generated per request (its own counter; warm-up requests included in both)."""
    sent = r["requests"] + r["warmup_requests"]
    return r["server_generated_tokens"] / sent if sent else None


def server_itl(r: dict[str, Any]) -> float | None:
    """Mean inter-token latency from the server's token count: (latency - TTFT) / (tokens - 1). genai-perf's
    own ITL divides by its re-tokenization of the streamed text, which differs between the two endpoints
    (their prompts, and so their random-model texts, differ), so the frontend's added ITL uses this one."""
    n, lat, ttft = server_len(r), r["request_latency_ms"].get("avg"), r["ttft_ms"].get("avg")
    return None if not n or n <= 1 or lat is None or ttft is None else (lat - ttft) / (n - 1)


def _median(values: list[Any]) -> Any:
    if values and all(isinstance(v, dict) for v in values):
        return {k: _median([v.get(k) for v in values]) for k in values[0]}
    nums = [v for v in values if isinstance(v, int | float)]
    return statistics.median(nums) if nums else values[0]


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (concurrency, endpoint): the median of every number over its repeats, in run order."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["concurrency"], r.get("endpoint", "triton")), []).append(r)
    out = []
    for group in groups.values():
        row = {k: _median([g[k] for g in group]) for k in group[0] if k not in ("export", "load_avg_1min")}
        row["endpoint"], row["repeats"] = group[0].get("endpoint", "triton"), len(group)
        loads = [x for g in group for x in g.get("load_avg_1min") or []]
        row["load_avg_1min"] = [min(loads), max(loads)] if loads else None
        out.append(row)
    return out


def table(rows: list[dict[str, Any]], header: str) -> str:
    """The results: one row per (concurrency, endpoint), then what the frontend adds over Triton's endpoint.

    ``rows`` may hold several repeats of a (concurrency, endpoint) pair: each number is their median."""
    rows = medians(rows)
    f = _f
    lines = [header, "",
             "| concurrency | endpoint | TTFT avg / p50 / p99 (ms) | ITL avg, server tokens (ms) | "
             "ITL avg / p50 / p99, genai-perf (ms) | output tokens/s | requests/s | output len (genai-perf / server) |"
             " 1-min load avg (min -> max) |",
             "|---:|---|---|---:|---|---:|---:|---|---|"]
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        name = ENDPOINT_NAMES[r.get("endpoint", "triton")]
        load = r.get("load_avg_1min") or [None, None]
        lines.append(f"| {r['concurrency']} | {name} | {f(t['avg'])} / {f(t['p50'])} / {f(t['p99'])} | "
                     f"{f(server_itl(r), 2)} | {f(i['avg'], 2)} / {f(i['p50'], 2)} / {f(i['p99'], 2)} | "
                     f"{f(r['output_token_throughput'])} | {r['request_throughput']:.2f} | "
                     f"{f(r['output_sequence_length'])} / {f(server_len(r))} | {f(load[0])} -> {f(load[1])} |")
    added = added_by_frontend(rows)
    if added:
        lines += ["", "What the frontend adds (chat row minus Triton row, same concurrency):", "",
                  "| concurrency | added TTFT avg / p50 (ms) | added ITL avg, server tokens (ms) |", "|---:|---|---:|"]
        for c, d in added.items():
            lines.append(f"| {c} | {_signed(d['ttft_avg'])} / {_signed(d['ttft_p50'])} | {_signed(d['itl_avg'], 2)} |")
    return "\n".join(lines)


def _signed(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:+.{digits}f}"


def added_by_frontend(rows: list[dict[str, Any]]) -> dict[int, dict[str, float | None]]:
    """Per concurrency with both endpoints measured: chat minus Triton, for TTFT and ITL (avg, p50)."""
    by = {(r["concurrency"], r.get("endpoint", "triton")): r for r in medians(rows)}
    out: dict[int, dict[str, float | None]] = {}
    for c in sorted({r["concurrency"] for r in rows}):
        tri, chat = by.get((c, "triton")), by.get((c, "chat"))
        if tri is None or chat is None:
            continue

        def diff(x: float | None, y: float | None) -> float | None:
            return None if x is None or y is None else x - y

        out[c] = {"ttft_avg": diff(chat["ttft_ms"].get("avg"), tri["ttft_ms"].get("avg")),
                  "ttft_p50": diff(chat["ttft_ms"].get("p50"), tri["ttft_ms"].get("p50")),
                  "itl_avg": diff(server_itl(chat), server_itl(tri))}
    return out


def main(argv: list[str] | None = None) -> int:
    env0 = os.environ
    ap = argparse.ArgumentParser(prog="python -m loadtests.bench_serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--genai-perf", type=Path, default=DEFAULT_GENAI_PERF)
    ap.add_argument("--concurrency", default=env0.get("CONCURRENCY") or "1,4,16")
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--requests-per-user", type=int, default=6, help="requests per concurrency level = this x N")
    ap.add_argument("--repeats", type=int, default=int(env0.get("REPEATS") or 1),
                    help="runs of each (level, endpoint), alternating endpoints; the table shows their medians")
    ap.add_argument("--min-requests", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per concurrency level")
    ap.add_argument("--url", default=env0.get("URL") or "", help="a running server's HTTP host:port")
    ap.add_argument("--frontend-url", default=env0.get("FRONTEND_URL") or "",
                    help="a running OpenAI frontend's host:port (default: one started here in front of the server)")
    ap.add_argument("--endpoints", default=env0.get("ENDPOINTS") or ",".join(ENDPOINTS),
                    help="comma-separated: triton (kserve gRPC), chat (the frontend's /v1/chat/completions)")
    ap.add_argument("--multi-block", default=env0.get("MULTI_BLOCK") or "auto", choices=("auto", "on", "off"))
    ap.add_argument("--profile-pinning", default=env0.get("PROFILE_PINNING") or "per_context",
                    choices=("per_context", "single_context"))
    ap.add_argument("--reports", type=Path, default=Path(env0.get("REPORTS") or REPO / "reports"))
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    unknown = sorted(set(endpoints) - set(ENDPOINTS))
    if unknown:
        raise SystemExit(f"error: unknown endpoint(s) {unknown}; choose from {', '.join(ENDPOINTS)}")
    genai_perf = args.genai_perf.resolve()
    env = genai_env(genai_perf)
    check_tools(genai_perf, env)
    reports = args.reports.resolve()
    root = reports / "bench-serve"
    server = None
    stack = ExitStack()
    try:
        if args.url:
            target = Target.from_url(args.url, env0.get("GRPC_URL") or None, env0.get("METRICS_URL") or None)
        else:
            from deploy.triton import TritonServer

            params = {"multi_block_mode": args.multi_block, "profile_pinning": args.profile_pinning}
            reports.mkdir(parents=True, exist_ok=True)
            server = TritonServer(parameters=params, log_path=reports / "bench_serve_tritonserver.log").start()
            log(f"tritonserver pid {server.pid} starting with {params}")
            server.wait("ready", timeout=300)
            target = Target(server.http_url, server.grpc_url, server.metrics_url)
        params = model_parameters(model_config(target.http))
        bundle = BundleInfo.from_server(target.http)
        log(f"server {target.grpc} (gRPC): multi_block_mode={params.get('multi_block_mode')}, profile_pinning="
            f"{params.get('profile_pinning')}, bundle {bundle.engine_dir} (max_batch_size {bundle.max_batch_size})")
        frontend_url = args.frontend_url.removeprefix("http://")
        if "chat" in endpoints and not frontend_url:
            from frontend.process import FrontendProcess

            reports.mkdir(parents=True, exist_ok=True)
            fe = stack.enter_context(FrontendProcess(target.grpc, log_path=reports / "bench_serve_frontend.log"))
            fe.wait(60)
            frontend_url = f"{fe.host}:{fe.port}"
            log(f"frontend pid {fe.pid} on {frontend_url} in front of {target.grpc}")
        rows = []
        for c in levels:
            for rep in range(args.repeats):
                for endpoint in endpoints:
                    out = root / f"c{c}" / endpoint / f"run{rep}"
                    if out.exists():
                        shutil.rmtree(out)
                    out.mkdir(parents=True)
                    rows.append(run_level(genai_perf, env, target, bundle.engine_dir, c, args, out, endpoint,
                                          frontend_url))
    finally:
        stack.close()
        if server is not None:
            code = server.stop()
            server.cleanup()
            if code:
                log(f"warning: tritonserver exited with code {code}")
    header = (f"genai-perf 0.0.16, streaming: Triton kserve gRPC (vLLM convention) and the OpenAI frontend's "
              f"/v1/chat/completions (SSE); {args.input_tokens} input tokens (+ the chat template's), "
              f"{args.output_tokens} output tokens (min_tokens = max_tokens, greedy); bundle {bundle.engine_dir.name}, "
              f"multi_block_mode={params.get('multi_block_mode')}, profile_pinning={params.get('profile_pinning')}; "
              f"median of {args.repeats} run(s) per row, endpoints alternating; {os.cpu_count()} CPU cores shared "
              f"with whatever else runs on the machine (see the load column)")
    text = table(rows, header)
    (reports / "bench_serve.json").write_text(json.dumps({"header": header, "rows": rows, "medians": medians(rows),
                                                          "added_by_frontend": added_by_frontend(rows)}, indent=1))
    (reports / "bench_serve.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    log(f"written: {reports / 'bench_serve.md'}, {reports / 'bench_serve.json'}, {root}/c<N>/<endpoint>/run<R>/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
