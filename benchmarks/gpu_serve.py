"""Serving on the GPU through tritonserver (device script; ``python3 -m benchmarks.gpu_serve``).

On the GPU machine, with the ``nvidia-pytriton`` and ``tritonclient`` wheels installed:

1. writes a Qwen3.5-35B-A3B-shaped checkpoint folder (the released text config, ``--layers`` of them; config
   and tokenizer only) and builds a ``cuda`` bundle with ``--dummy-weights`` (seeded random bf16 weights made
   on the GPU at load: 70 GB of weights do not fit the machine's disk);
2. the offline baseline: the same bundle in a ServingEngine of this process's own, the client workload at
   concurrency 1, 4 and 16 (token-id prompts, greedy, ignore_eos): decode step time = the ITL it can give;
3. tritonserver with the bundle in a KIND_GPU instance (falls back to KIND_CPU + ``device=cuda:0`` when the
   wheel's server cannot make GPU instances; which one ran is reported): streaming, a cancelled stream that
   frees its slot, an invalid input answered while a valid stream completes, and the client bench at the same
   concurrencies (TTFT, ITL percentiles) -> Triton's share of ITL over the offline step;
4. a sticky device fault through the server (``HYBRID_LLM_INJECT_FAULT``): every stream in flight answered,
   the model not ready within 5 s, reloaded through the repository API, serving again.

Writes ``gpu_serve_h200.md`` and ``gpu_serve.json`` to ``$GPU_REPORT_DIR`` (default /tmp).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("GPU_REPORT_DIR", "/tmp"))
L_, A_ = "linear_attention", "full_attention"


def log(msg: str) -> None:
    print(f"[gpu-serve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_checkpoint(d: Path, layers: int, tokenizer_vocab: bool = False) -> Path:
    """Config (the released Qwen3.5-35B-A3B text shape) + the default model's tokenizer; no weights.
    ``tokenizer_vocab``: the vocabulary cut to the tokenizer's (the soak judges texts: with the released
    248320 ids, random weights pick ids the small tokenizer decodes to nothing)."""
    from builder.default_model import write_default_checkpoint
    from tests.hf_models import tiny_raw_config

    tok = d.parent / "tokenizer_src"
    if not (tok / "config.json").exists():
        write_default_checkpoint(tok, progress=lambda _m: None)
    d.mkdir(parents=True, exist_ok=True)
    for p in tok.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            (d / p.name).write_bytes(p.read_bytes())
    tok_cfg = json.loads((tok / "config.json").read_text())
    eos = tok_cfg["eos_token_id"]
    vocab = int(tok_cfg["vocab_size"]) if tokenizer_vocab else 248320
    raw = tiny_raw_config(
        "qwen3_5_moe", vocab_size=vocab, hidden_size=2048, num_hidden_layers=layers,
        layer_types=[A_ if (i + 1) % 4 == 0 else L_ for i in range(layers)], num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        max_position_embeddings=262144, rms_norm_eps=1e-6, eos_token_id=eos,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    raw["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(raw, indent=1))
    return d


def build(root: Path, layers: int, max_batch: int, max_seq: int, tokenizer_vocab: bool = False) -> Path:
    from builder.bundle import BuildOptions, build_bundle

    ckpt = write_checkpoint(root / ("ckpt_tv" if tokenizer_vocab else "ckpt"), layers, tokenizer_vocab)
    out = root / ("bundle_tv" if tokenizer_vocab else "bundle")
    build_bundle(ckpt, out, BuildOptions(backend="cuda", dtype="bfloat16", max_batch_size=max_batch,
                                         max_input_len=max_seq // 2, max_seq_len=max_seq, dummy_weights=True),
                 progress=log)
    return out


def _ids(w: int, i: int, n: int) -> list[int]:
    return [50 + (w * 31 + i * 7 + j * 13) % 200 for j in range(n)]


def offline(bundle: Path, concurrencies: list[int], prompt: int, new: int, per_worker: int) -> dict:
    """The client workload in-process: decode step time (ms) and TTFT at each concurrency."""
    from hybrid_runtime.sampling import SamplingParams
    from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine, generate

    eng = ServingEngine(bundle, RuntimeOptions()).start()
    res: dict = {"load": {}}
    try:
        be = eng.runner.backend
        res["load"] = {"plan": be.memory_plan.describe() if be.memory_plan else None,
                       "capture_mib": round(be.capture_bytes / 2**20, 1), "graphs": len(be.graphs)}
        generate(eng, [GenerationRequest("warm", prompt_ids=tuple(_ids(0, 0, 4)),
                                         params=SamplingParams(max_tokens=2))])
        for c in concurrencies:
            before = eng.stats()
            # c workers, each submitting its next request when its previous one finished (what the client's
            # workers do), so prefills of new arrivals interleave with the others' decode steps as they do in
            # the server; token arrival times in this process give the engine loop's own ITL (the step plus
            # scheduling, sampling bookkeeping, events, and those interleaved prefills)
            arrivals: dict[str, list[float]] = {}
            done = threading.Event()
            left = [c * per_worker]

            def submit(w: int, i: int, c: int = c, arrivals: dict = arrivals, done: threading.Event = done,
                       left: list = left) -> None:
                def sink(ev) -> None:
                    if ev.token_ids:
                        arrivals.setdefault(ev.request_id, []).append(time.perf_counter())
                    if ev.final:
                        left[0] -= 1
                        if i + 1 < per_worker:
                            submit(w, i + 1)
                        if not left[0]:
                            done.set()

                eng.submit(GenerationRequest(f"o{c}-{w}-{i}", prompt_ids=tuple(_ids(w, i, prompt)),
                                             params=SamplingParams(max_tokens=new, ignore_eos=True, temperature=0)),
                           sink)

            for w in range(c):
                submit(w, 0)
            done.wait(300)
            after = eng.stats()
            steps = after["steps"]["decode"] - before["steps"].get("decode", 0)
            sec = after["step_seconds"]["decode"] - before["step_seconds"].get("decode", 0)
            gaps = [b - a for ts in arrivals.values() for a, b in itertools.pairwise(ts)]
            res[str(c)] = {"decode_step_ms": 1e3 * sec / max(1, steps), "decode_steps": steps,
                           "engine_itl_ms": 1e3 * statistics.mean(gaps) if gaps else None}
            log(f"offline c={c}: decode step {res[str(c)]['decode_step_ms']:.2f} ms over {steps} steps, "
                f"in-process ITL {res[str(c)]['engine_itl_ms']:.2f} ms")
    finally:
        eng.shutdown()
    return res


def client_bench(url: str, c: int, prompt: int, new: int, per_worker: int, server=None) -> dict:
    """Client-side TTFT / ITL percentiles; with ``server``, also the engine's own mean ITL inside the stub
    (``hybrid_llm_inter_token_latency_seconds`` sum / count over the run) to split the overhead between the
    stub process (the engine slowed down there) and the transport (gRPC, the server's response path)."""
    from client.lib import ClientError, generate_stream_grpc

    results, errors, lock = [], [], threading.Lock()

    def worker(w: int) -> None:
        for i in range(per_worker):
            try:
                r = generate_stream_grpc(url, input_ids=_ids(w, i, prompt), max_tokens=new,
                                         sampling={"temperature": 0, "ignore_eos": True}, timeout=120).wait()
                with lock:
                    results.append(r)
            except ClientError as e:
                with lock:
                    errors.append(str(e))

    generate_stream_grpc(url, input_ids=_ids(0, 0, 4), max_tokens=2, timeout=120).wait()
    names = (("hybrid_llm_inter_token_latency_seconds_sum", ""), ("hybrid_llm_inter_token_latency_seconds_count", ""),
             ("hybrid_llm_engine_step_seconds_total", 'phase="decode"'),
             ("hybrid_llm_engine_steps_total", 'phase="decode"'))

    def engine_counters() -> list[float]:
        """ITL sum and count, decode step seconds and count, from one read of the metrics page."""
        time.sleep(0.6)  # the metrics thread pushes every 0.5 s
        text = _metrics_text(server)
        return [_metric_in(text, name, where) for name, where in names]

    before = engine_counters() if server is not None else None
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stub_itl = stub_step = None
    if before is not None:
        itl_s, itl_n, step_s, step_n = (x - y for x, y in zip(engine_counters(), before))
        stub_itl = 1e3 * itl_s / itl_n if itl_n > 0 else None
        stub_step = 1e3 * step_s / step_n if step_n > 0 else None
    ttft = sorted(r.ttft for r in results if r.ttft is not None)
    itl = sorted(x for r in results for x in r.itls)

    def pct(xs: list[float], q: float) -> float:
        return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {"requests": len(results), "errors": errors[:3], "n_errors": len(errors),
            "tokens_per_s": sum(len(r.output_ids) for r in results) / wall,
            "stub_itl_ms": stub_itl, "stub_step_ms": stub_step,
            "ttft_ms": {"mean": 1e3 * statistics.mean(ttft) if ttft else None, "p50": pct(ttft, 0.5),
                        "p90": pct(ttft, 0.9)},
            "itl_ms": {"mean": 1e3 * statistics.mean(itl) if itl else None, "p50": pct(itl, 0.5),
                       "p90": pct(itl, 0.9), "p99": pct(itl, 0.99)}}


def functional(server, prompt_ids: list[int]) -> dict:
    """Streaming, cancellation that frees the slot, an invalid input beside a valid stream."""
    from client.lib import ClientError, generate_stream_grpc

    out: dict = {}
    gen = generate_stream_grpc(server.grpc_url, input_ids=prompt_ids, max_tokens=8,
                               sampling={"temperature": 0, "ignore_eos": True}, timeout=120)
    deltas = list(gen)
    out["stream"] = {"responses": len(deltas), "tokens": len(gen.result.output_ids),
                     "finish_reason": gen.result.finish_reason}
    gen = generate_stream_grpc(server.grpc_url, input_ids=prompt_ids, max_tokens=1000,
                               sampling={"temperature": 0, "ignore_eos": True}, timeout=120)
    for _ in range(3):
        next(gen)
    gen.cancel()
    t0 = time.monotonic()
    freed = False
    while time.monotonic() - t0 < 15:
        if _metric(server, "hybrid_llm_slots_in_use") == 0 and _metric(server, "hybrid_llm_kv_pages_in_use") == 0:
            freed = True
            break
        time.sleep(0.2)
    out["cancel"] = {"slot_and_pages_freed": freed, "seconds": round(time.monotonic() - t0, 2)}
    valid = generate_stream_grpc(server.grpc_url, input_ids=prompt_ids, max_tokens=32,
                                 sampling={"temperature": 0, "ignore_eos": True}, timeout=120)
    next(valid)
    try:
        generate_stream_grpc(server.grpc_url, input_ids=[300000], max_tokens=4, timeout=60).wait()
        out["invalid"] = {"error": None}
    except ClientError as e:
        out["invalid"] = {"error": str(e)[:200]}
    res = valid.wait()
    out["invalid"]["valid_stream_finished"] = res.finish_reason
    return out


def _metrics_text(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        return r.read().decode()


def _metric_in(text: str, name: str, where: str = "") -> float:
    """Sum of the series of ``name`` in a metrics page (those whose labels contain ``where``, e.g.
    ``phase="decode"``)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if (line.startswith(name + "{") or line.startswith(name + " ")) and where in line)


def _metric(server, name: str, where: str = "") -> float:
    return _metric_in(_metrics_text(server), name, where)


def variants_bench(bundle: Path, kind: str, args_: tuple[str, ...], variants: list[str], cs: list[int],
                   prompt: int, new: int, per_worker: int) -> dict:
    """The client bench again on a fresh server per variant ``name:ENV=V[,ENV=V]`` (diagnostics of the stub's
    threads: HYBRID_LLM_SWITCH_INTERVAL, HYBRID_LLM_WATCH_PERIOD, HYBRID_LLM_METRICS_PERIOD)."""
    out: dict = {}
    for v in variants:
        name, _, spec = v.partition(":")
        env = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
        server = start_server(bundle, kind, env=env or None, args=args_)
        try:
            out[name] = {"env": env, **{str(c): client_bench(server.grpc_url, c, prompt, new, per_worker, server=server)
                                        for c in cs}}
            log(f"variant {name}: " + ", ".join(
                f"c={c} client ITL {out[name][str(c)]['itl_ms']['mean']} stub ITL {out[name][str(c)]['stub_itl_ms']} "
                f"stub step {out[name][str(c)]['stub_step_ms']}" for c in cs))
        finally:
            server.stop(timeout=60)
            server.cleanup()
    return out


def start_server(bundle: Path, kind: str, env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
    from deploy.triton import TritonServer

    params = {"engine_dir": str(bundle)}
    if kind == "cpu":
        params["device"] = "cuda:0"
    tag = f"{kind}{'_nopool' if args else ''}{'_fault' if env else ''}"
    server = TritonServer(parameters=params, instance_kind=kind, exit_timeout_s=10, env=env, server_args=args,
                          log_path=OUT / f"tritonserver_{tag}.log")
    server.start()
    try:
        server.wait("ready", timeout=600)
    except Exception:
        server.stop()
        raise
    return server


def fault_check(bundle: Path, kind: str, args: tuple[str, ...] = ()) -> dict:
    from client.lib import ClientError, generate_stream_grpc

    server = start_server(bundle, kind, env={"HYBRID_LLM_INJECT_FAULT": "sticky@30"}, args=args)
    out: dict = {}
    try:
        answers: list[str] = []
        lock = threading.Lock()

        def run(i: int) -> None:
            try:
                r = generate_stream_grpc(server.grpc_url, input_ids=_ids(i, 0, 16), max_tokens=200,
                                         sampling={"temperature": 0, "ignore_eos": True}, timeout=120).wait()
                a = f"finished:{r.finish_reason}"
            except ClientError as e:
                a = f"error:{str(e)[:160]}"
            with lock:
                answers.append(a)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        t_answered = time.monotonic()
        while server.model_ready() and time.monotonic() - t_answered < 30:
            time.sleep(0.05)
        out["answers"] = answers
        out["all_answered"] = len(answers) == 4
        out["not_ready_after_answers_s"] = round(time.monotonic() - t_answered, 2)
        out["not_ready"] = not server.model_ready()
        out["server_live"] = server.is_live()
        out["answer_seconds"] = round(t_answered - t0, 2)
        req = urllib.request.Request(f"http://{server.http_url}/v2/repository/models/hybrid_llm/load", data=b"",
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out["reload_status"] = r.status
        except urllib.error.HTTPError as e:
            out["reload_status"] = e.code
        r = generate_stream_grpc(server.grpc_url, input_ids=_ids(0, 0, 8), max_tokens=4,
                                 sampling={"temperature": 0, "ignore_eos": True}, timeout=120).wait()
        out["after_reload"] = r.finish_reason
    finally:
        out["exit_code"] = server.stop(timeout=60)
        out["leaked_shm"] = sorted(server.leaked_shm)
        server.cleanup()
    return out


SANITIZE_PROBE_STEP = 400  # the engine step at which the instrumentation probe's injected fault fires


def memcheck_errors(text: str) -> list[dict[str, str]]:
    """The error records of a compute-sanitizer memcheck log: per record its first line (the kind of error) and
    the kernel it names (``at KERNEL+0x..``; "" when none, e.g. an API error)."""
    import re

    out = []
    for block in re.split(r"(?m)^=+ (?=\S)", text):
        head = block.splitlines()[0] if block.strip() else ""
        if not head or head.startswith(("COMPUTE-SANITIZER", "ERROR SUMMARY", "Target application", "Error:")):
            continue
        if not re.match(r"(Invalid|Out of bounds|Misaligned|Program hit|Malloc|Free|Cuda|Barrier|Leaked)", head):
            continue
        m = re.search(r"(?m)^=+\s+at (?:0x[0-9a-f]+ in )?([A-Za-z_][\w:<>]*)", block)
        out.append({"error": head.strip(), "kernel": m.group(1) if m else ""})
    return out


def sanitize_check(root: Path) -> dict:
    """compute-sanitizer memcheck over tritonserver and its stub (``--target-processes all``) while clients stream:
    the default model as a bf16 cuda bundle (small: memcheck slows every kernel down), 4 streams x 2 requests.

    Then the instrumentation probe, which makes a clean result conclusive: the stub was started with the test-only
    fault ``sticky@SANITIZE_PROBE_STEP`` (``fill_f32`` writing to address 0x100), and requests are sent one after
    another until the engine reaches that step. memcheck must report that write from the stub's process (so the
    stub's launches were instrumented) and nothing in any other kernel (the workload was clean)."""
    import re

    from builder.bundle import BuildOptions, build_bundle
    from builder.default_model import write_default_checkpoint
    from client.lib import ClientError, generate_stream_grpc
    from deploy.triton import TritonServer

    ckpt, bundle = root / "san_ckpt", root / "san_bundle"
    if not (ckpt / "config.json").exists():
        write_default_checkpoint(ckpt, progress=lambda _m: None)
    build_bundle(ckpt, bundle, BuildOptions(backend="cuda", dtype="bfloat16", max_batch_size=8, max_seq_len=256,
                                            max_input_len=128), progress=lambda _m: None)
    san_log = OUT / "sanitizer_memcheck.log"
    server = TritonServer(parameters={"engine_dir": str(bundle), "multi_block_mode": "on"}, instance_kind="gpu",
                          exit_timeout_s=20, log_path=OUT / "tritonserver_sanitize.log",
                          server_args=("--backend-config=python,stub-timeout-seconds=300",),
                          env={"HYBRID_LLM_INJECT_FAULT": f"sticky@{SANITIZE_PROBE_STEP}"},
                          launcher=("compute-sanitizer", "--tool", "memcheck", "--target-processes", "all",
                                    "--report-api-errors", "no", "--print-limit", "64", "--log-file",
                                    str(san_log)))
    out: dict = {}
    server.start()
    try:
        server.wait("ready", timeout=400)
        errors: list[str] = []
        done: list[str] = []

        def run(w: int) -> None:
            for i in range(2):
                try:
                    r = generate_stream_grpc(server.grpc_url, input_ids=_ids(w, i, 24), max_tokens=24,
                                             sampling={"temperature": 0.7, "seed": w, "ignore_eos": True},
                                             timeout=300).wait()
                    done.append(r.finish_reason or "")
                except ClientError as e:
                    errors.append(str(e)[:200])

        threads = [threading.Thread(target=run, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        out.update(requests=len(done), errors=errors)
        # the probe: sequential requests until the injected fault at step SANITIZE_PROBE_STEP fails one
        probe = []
        for i in range(40):
            try:
                r = generate_stream_grpc(server.grpc_url, input_ids=_ids(9, i, 24), max_tokens=24,
                                         sampling={"temperature": 0.0, "ignore_eos": True}, timeout=300).wait()
                probe.append(r.finish_reason or "")
            except ClientError as e:
                out["probe_failed_request"] = {"index": i, "error": str(e)[:300]}
                break
        out["probe_requests_before_fault"] = len(probe)
        # stop tritonserver itself (the sanitizer's child): the sanitizer then exits with its summaries written
        import signal

        kids = [int(p) for p in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()]
        for pid in kids:
            os.kill(pid, signal.SIGTERM)
        assert server.proc is not None
        try:
            out["sanitizer_exit_code"] = server.proc.wait(90)
        except subprocess.TimeoutExpired:
            out["sanitizer_exit_code"] = None
    finally:
        out["exit_code"] = server.stop(timeout=60)
        server.cleanup()
    text = san_log.read_text(errors="replace") if san_log.exists() else ""
    out["error_summaries"] = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    out["sanitizer_log_lines"] = len(text.splitlines())
    records = memcheck_errors(text)
    injected = [r for r in records if r["kernel"] == "fill_f32"]
    other = [r for r in records if r["kernel"] != "fill_f32"]
    out["memcheck_records"] = len(records)
    out["injected_fault_reported"] = bool(injected)  # the stub's launches were instrumented
    out["other_errors"] = other[:20]
    out["verdict"] = ("clean (instrumentation proven by the injected fault)" if injected and not other else
                      "errors outside the injected fault" if other else
                      "inconclusive: the injected fault was not reported (stub not instrumented?)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--root", type=Path, default=Path("/tmp/gpu_serve"))
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-worker", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma-separated: offline,serve,fault")
    ap.add_argument("--variants", default="", help="semicolon-separated name:ENV=V[,ENV=V] server variants, each "
                    "benched again on a fresh server (diagnostics)")
    ap.add_argument("--offline-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sanitize", action="store_true",
                    help="only: compute-sanitizer memcheck over the server under a client workload (small model)")
    ap.add_argument("--soak", default="", metavar="DURATION",
                    help="only: the soak runner (16 users, multi-block on, faults 0.2) for DURATION against a KIND_GPU "
                         "server of the 35B-A3B shape cut to --layers, its vocabulary cut to the tokenizer's")
    args = ap.parse_args(argv)
    if args.soak:
        return soak(Path(args.root), args.layers, args.soak)
    if args.sanitize:
        res = sanitize_check(Path(args.root))
        (OUT / "gpu_serve_sanitize.json").write_text(json.dumps(res, indent=1))
        print("SANITIZE " + json.dumps(res))
        return 0
    cs = [int(c) for c in args.concurrency.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    if args.offline_only:  # in a subprocess of its own, so that its GPU memory is gone when it exits
        res = offline(Path(args.root) / "bundle", cs, args.prompt_tokens, args.max_tokens, args.requests_per_worker)
        print("OFFLINE " + json.dumps(res))
        return 0
    report: dict = {"date": datetime.date.today().isoformat(), "layers": args.layers, "concurrency": cs,
                    "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens}
    t0 = time.perf_counter()
    bundle = build(args.root, args.layers, max(cs), 2048)
    report["build_s"] = round(time.perf_counter() - t0, 1)

    def save() -> None:
        (OUT / "gpu_serve.json").write_text(json.dumps(report, indent=1, default=str))

    if "offline" not in skip:
        cmd = [sys.executable, "-m", "benchmarks.gpu_serve", "--offline-only", "--root", str(args.root),
               "--concurrency", args.concurrency, "--prompt-tokens", str(args.prompt_tokens),
               "--max-tokens", str(args.max_tokens), "--requests-per-worker", str(args.requests_per_worker)]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
        line = [x for x in p.stdout.splitlines() if x.startswith("OFFLINE ")]
        report["offline"] = json.loads(line[-1][8:]) if line else {"error": p.stderr[-2000:]}
        log(f"offline: {report['offline']}")
        save()
    if "serve" not in skip:
        # without the pinned and CUDA memory pools Triton copies inputs into the stub's shared memory with plain
        # memcpy (with them, on this GPU machine, BYTES inputs reached the stub as garbage)
        nopool = ("--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0")
        for kind, args_ in (("gpu", ()), ("gpu", nopool), ("cpu", nopool)):
            label = kind + ("+nopool" if args_ else "")
            try:
                t1 = time.perf_counter()
                server = start_server(bundle, kind, args=args_)
            except Exception as e:
                report.setdefault("instance_errors", {})[label] = str(e)[-1500:]
                log(f"KIND_{kind.upper()} failed: {str(e)[-500:]}")
                continue
            try:  # a smoke request: KIND_GPU may load and still fail at the first request
                from client.lib import generate_stream_grpc

                generate_stream_grpc(server.grpc_url, input_ids=_ids(0, 0, 8), max_tokens=2,
                                     sampling={"temperature": 0}, timeout=60).wait()
            except Exception as e:
                tail = [x for x in server.log_tail(60).splitlines() if "rror" in x or "what()" in x]
                report.setdefault("instance_errors", {})[label] = f"{e}; log: {tail[-6:]}"
                log(f"{label} loaded but failed its first request: {e}")
                server.stop(timeout=60)
                server.cleanup()
                continue
            report["instance_kind"] = kind
            report["server_args"] = list(args_)
            report["server_load_s"] = round(time.perf_counter() - t1, 1)
            try:
                report["functional"] = functional(server, _ids(0, 0, args.prompt_tokens))
                log(f"functional: {report['functional']}")
                report["bench"] = {}
                for c in cs:
                    report["bench"][str(c)] = client_bench(server.grpc_url, c, args.prompt_tokens, args.max_tokens,
                                                           args.requests_per_worker, server=server)
                    log(f"bench c={c}: {report['bench'][str(c)]}")
                    save()
            finally:
                report["server_exit_code"] = server.stop(timeout=60)
                report["server_leaked_shm"] = sorted(server.leaked_shm)
                server.cleanup()
            break
        save()
        if args.variants and "instance_kind" in report:
            report["variants"] = variants_bench(bundle, report["instance_kind"], tuple(report["server_args"]),
                                                [v for v in args.variants.split(";") if v], cs, args.prompt_tokens,
                                                args.max_tokens, args.requests_per_worker)
            save()
    if "fault" not in skip:
        report["fault"] = fault_check(bundle, report.get("instance_kind", "gpu"), tuple(report.get("server_args", ())))
        log(f"fault: {report['fault']}")
        save()
    (OUT / "gpu_serve_h200.md").write_text(render(report))
    print(render(report))
    return 0


def soak(root: Path, layers: int, duration: str) -> int:
    """``loadtests.soak`` (unchanged criteria: 16 users, multi-block forced on, faults on) against tritonserver
    serving a KIND_GPU instance of a dummy-weights bundle of the 35B-A3B shape with ``layers`` layers and the
    tokenizer's vocabulary; reports (verdict JSON, server log, memory series) under ``$GPU_REPORT_DIR/soak``."""
    from deploy.triton import write_model_repository
    from loadtests import soak as soak_runner

    bundle = build(root, layers, 16, 2048, tokenizer_vocab=True)
    repo = write_model_repository(root / "soakrepo", {"engine_dir": str(bundle)}, instance_kind="gpu")
    log(f"soak for {duration} over {repo} (bundle {bundle})")
    return soak_runner.main(["--model-repository", str(repo), "--users", "16", "--duration", duration,
                             "--multi-block", "on", "--fault-share", "0.2", "--reports", str(OUT / "soak")])


def render(r: dict) -> str:
    lines = [f"# Serving on the GPU through tritonserver ({r['date']})", "",
             f"`python3 -m benchmarks.gpu_serve --layers {r['layers']}` on an H200: a Qwen3.5-35B-A3B-shaped cuda "
             f"bundle ({r['layers']} layers, dummy bf16 weights generated on the GPU), token-id prompts of "
             f"{r['prompt_tokens']} tokens, {r['max_tokens']} new tokens, greedy; instance kind: "
             f"KIND_{str(r.get('instance_kind', '?')).upper()}.", ""]
    off, bench = r.get("offline", {}), r.get("bench", {})
    if bench:
        lines += ["| concurrency | offline decode step (ms) | offline in-process ITL (ms) "
                  "| decode step in the stub (ms) | engine ITL in the stub (ms) "
                  "| Triton ITL mean / p50 / p90 / p99 (ms) | ITL mean over step "
                  "| TTFT mean / p50 / p90 (ms) | tokens/s | errors |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for c in r["concurrency"]:
            b, o = bench.get(str(c)), off.get(str(c), {})
            if not b:
                continue
            step = o.get("decode_step_ms")
            itl, ttft = b["itl_ms"], b["ttft_ms"]
            ratio = f"{itl['mean'] / step:.3f}" if step and itl["mean"] else "n/a"
            eitl = o.get("engine_itl_ms")
            eitl_s = "n/a" if eitl is None else f"{eitl:.2f}"
            sitl = b.get("stub_itl_ms")
            sitl_s = "n/a" if sitl is None else f"{sitl:.2f}"
            sstep = b.get("stub_step_ms")
            sstep_s = "n/a" if sstep is None else f"{sstep:.2f}"
            lines.append(f"| {c} | {step:.2f} | {eitl_s} | {sstep_s} | {sitl_s} | "
                         f"{itl['mean']:.2f} / {itl['p50']:.2f} / {itl['p90']:.2f} / {itl['p99']:.2f} | {ratio} | "
                         f"{ttft['mean']:.1f} / {ttft['p50']:.1f} / {ttft['p90']:.1f} | "
                         f"{b['tokens_per_s']:.0f} | {b['n_errors']} |" if step else f"| {c} | n/a | ... |")
        lines += ["", "Goal (issue): Triton adds <= 10% to ITL over the offline step at concurrency 1 and 16."]
    if r.get("variants"):
        lines += ["", "Server variants (a fresh server each; diagnostics of the stub's threads):", "",
                  "| variant | env | concurrency | decode step in the stub (ms) | engine ITL in the stub (ms) "
                  "| client ITL mean (ms) | over the offline step |", "|---|---|---|---|---|---|---|"]
        for name, v in r["variants"].items():
            for c in r["concurrency"]:
                b = v.get(str(c))
                if not b:
                    continue
                step = off.get(str(c), {}).get("decode_step_ms")
                mean = b["itl_ms"]["mean"]
                fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
                ratio = f"{mean / step:.3f}" if step and mean else "n/a"
                lines.append(f"| {name} | `{v['env']}` | {c} | {fmt(b.get('stub_step_ms'))} | "
                             f"{fmt(b.get('stub_itl_ms'))} | {fmt(mean)} | {ratio} |")
    for key in ("functional", "fault", "instance_errors"):
        if key in r:
            lines += ["", f"{key}: `{json.dumps(r[key], default=str)}`"]
    if off.get("load"):
        lines += ["", f"load: `{json.dumps(off['load'])}`"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
