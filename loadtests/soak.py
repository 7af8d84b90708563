"""Soak runner: ``python -m loadtests.soak`` (what ``make soak`` runs). Exit code 0 only if every check passes.

1. Starts tritonserver on free 127.0.0.1 ports with the requested model parameters
   (deploy.triton.TritonServer), or uses the running server at ``URL`` (its HTTP host:port).
2. Polls ``/v2/health/ready`` every second from a background thread until the end (any not-ready or
   unanswered poll is a failure).
3. Warms up (2 x max_batch_size concurrent requests, half of them at max_input_len) and takes the
   memory baseline: the summed RSS of the tritonserver process tree (the Python-backend stubs are its
   children), read from /proc.
4. Runs locust headless as a subprocess with a hard timeout:
   ``locust -f loadtests/locustfile.py --headless -u USERS -r ... -t DURATION --csv reports/soak
   --html reports/soak.html``.
5. Waits (at most DRAIN_TIMEOUT s) until the model's gauges on the metrics port show no request running
   or waiting and zero state slots and KV pages in use; reads the profile-switch counter.
6. Stops the server by PID and checks it left no process and no /dev/shm region behind.

Checks: zero failed valid requests; every fault got its expected outcome; server always ready; slots
and KV pages back to zero after the drain; profile switches == 0 with per_context pinning; no request
ended in an engine error; end RSS <= max(1.25 x baseline, baseline + 64 MiB); the growth slope of the
tree's RSS (plus the bound of Triton 2.51's late-cancel leak for the late cancels sent), of each stub's RSS
and of each stub's Python heap after the settle time within the budget (loadtests.memory);
clean shutdown (Triton 2.51's unload hang after late cancels accepted only in its exact shape).
Printed: requests served, faults by kind, p50/p99 TTFT and ITL, memory, drain; written:
``reports/soak_stats.csv`` (and the other locust CSVs), ``reports/soak.html``, ``reports/soak_verdict.json``.

Environment (flags override): USERS (16), DURATION (5m), MULTI_BLOCK (auto|on|off), PROFILE_PINNING
(per_context|single_context), FAULT_SHARE (0.2), URL, GRPC_URL / METRICS_URL (with URL; default the
HTTP port + 1 / + 2), REPORTS (reports), SPAWN_RATE, DRAIN_TIMEOUT (60), SOAK_SEED; memory: MEMORY_BUDGET
(1 MiB/h), MEMORY_FLOOR (1 MiB), MEMORY_SETTLE_S, MEMORY_SAMPLE_S, HEAP_DEBUG (1), HEAP_SNAPSHOT_S;
FAULT_CANCEL_AFTER_FINAL (1), FAULT_REUSE_STREAM_AFTER_ERROR (0: a gRPC stream that carried an error is
closed, as this project's clients do; 1 reuses it, which trips a Triton 2.51 leak), SERVER_LOG_VERBOSE (0),
PROTOCOL (both | grpc | http: the transports of the
valid users, the faults and the warm-up, so that a memory slope can be put on one of Triton's frontends;
readiness polls and metric scrapes stay on HTTP).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import memory as mem
from .common import (
    MODEL,
    PROTOCOLS,
    REPO,
    BundleInfo,
    GrpcStream,
    PromptPool,
    Target,
    check_result,
    grpc_inputs,
    http_get,
    model_config,
    model_parameters,
    protocols,
)
from .memory import proc_stat, process_tree, rss_mib

MEMORY_RATIO = 1.25
MEMORY_JUMP_MIB = 64.0  # the end-vs-start jump bound: max(start x MEMORY_RATIO, start + this)
SHM_MARK = "/dev/shm/triton_python_backend_shm_region_"
# "Signal (15) received." / "(2)" are the server's own lines on SIGTERM / SIGINT: not crashes.
CRASH_PATTERNS = re.compile(r"Signal \((?!15\)|2\))\d+\) received|Traceback \(most recent call last\)|"
                            r"engine thread died|"
                            r"Segmentation fault|core dumped", re.IGNORECASE)


def log(msg: str) -> None:
    print(f"[soak] {msg}", flush=True)


def parse_duration(text: str) -> float:
    """Seconds of a locust-style duration: "90", "60s", "30m", "1h30m"."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"duration {text!r}: use e.g. 60s, 30m, 1h30m")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


# ---- /proc ------------------------------------------------------------------------------------------

def mapped_shm(pids: list[int] | dict[int, int]) -> set[str]:
    """Names of the Python-backend shared-memory regions these processes have mapped."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                i = line.find(SHM_MARK)
                if i >= 0:
                    found.add(line[i + len("/dev/shm/"):].split()[0])
    return found


def alive(pid: int, start: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[1] != "Z" and st[2] == start


def find_server_pid(http: str) -> int | None:
    """The tritonserver process serving HTTP on ``http`` (host:port), found by its command line."""
    port = http.rpartition(":")[2]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            args = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
            if args and args[0].endswith(b"tritonserver") and f"--http-port={port}".encode() in args:
                return int(entry.name)
    return None


# ---- metrics ------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str, model: str = MODEL) -> dict[str, dict[str, float]] | None:
    """``hybrid_llm_*`` samples of ``model``: name -> {label string: value}; None if unanswered."""
    status, body = http_get(url, timeout=5.0)
    if status != 200:
        return None
    out: dict[str, dict[str, float]] = {}
    for line in body.decode(errors="replace").splitlines():
        m = _SAMPLE.match(line)
        if not m or not m.group(1).startswith("hybrid_llm_"):
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        if labels.get("model", model) != model:
            continue
        rest = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("model", "version"))
        with contextlib.suppress(ValueError):
            out.setdefault(m.group(1)[len("hybrid_llm_"):], {})[rest] = float(m.group(3))
    return out


def heap_by_pid(url: str) -> dict[str, tuple[float, float | None]]:
    """"stub:<pid>" -> (traced Python heap, tracemalloc's own memory) in MiB, from the model's heap-debugging
    gauges (empty when off). tracemalloc's own memory (its trace and traceback tables) is part of the stub's
    RSS but not of the traced heap: a heap-debugging soak shows it beside the stub's RSS."""
    snap = scrape(url) or {}
    overhead = snap.get("tracemalloc_overhead_bytes", {})
    return {f"stub:{labels.partition('=')[2]}": (v / 2**20, overhead[labels] / 2**20 if labels in overhead else None)
            for labels, v in snap.get("python_heap_bytes", {}).items() if labels.startswith("pid=")}


def malloc_by_pid(url: str) -> dict[str, dict[str, float]]:
    """"stub:<pid>" -> glibc figure (``malloc_*`` heap-debugging gauges, deploy.heap_debug.malloc_stats) -> MiB
    (counts as they are)."""
    snap = scrape(url) or {}
    out: dict[str, dict[str, float]] = {}
    for name, values in snap.items():
        if not name.startswith("malloc_"):
            continue
        for labels, v in values.items():
            if labels.startswith("pid="):
                counted = name in ("malloc_arenas", "malloc_mmap_chunks")
                out.setdefault(f"stub:{labels.partition('=')[2]}", {})[name] = round(v if counted else v / 2**20, 3)
    return out


def metric(snap: dict[str, dict[str, float]] | None, name: str) -> float | None:
    if not snap or name not in snap:
        return None
    return sum(snap[name].values())


def _int(v: float | None) -> int | float | None:
    return int(v) if v is not None and float(v).is_integer() else v


def by_label(snap: dict[str, dict[str, float]] | None, name: str) -> dict[str, float]:
    if not snap or name not in snap:
        return {}
    return {k.partition("=")[2] or "all": _int(v) for k, v in snap[name].items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: _int(v - before.get(k, 0)) for k, v in after.items() if v - before.get(k, 0)}


# ---- readiness ------------------------------------------------------------------------------------------

class ReadinessPoller(threading.Thread):
    """GET /v2/health/ready every ``period`` s until stopped; every answer other than 200 is recorded."""

    def __init__(self, http: str, period: float = 1.0, timeout: float = 5.0) -> None:
        super().__init__(name="soak-readiness", daemon=True)
        self.http, self.period, self.timeout = http, period, timeout
        self.polls = 0
        self.not_ready: list[dict[str, Any]] = []
        self.max_latency = 0.0
        self._halt = threading.Event()
        self.t_start = time.time()

    def run(self) -> None:
        while not self._halt.is_set():
            t = time.monotonic()
            status, _ = http_get(f"http://{self.http}/v2/health/ready", timeout=self.timeout)
            took = time.monotonic() - t
            self.polls += 1
            self.max_latency = max(self.max_latency, took)
            if status != 200 and len(self.not_ready) < 1000:
                self.not_ready.append({"t_s": round(time.time() - self.t_start, 1), "status": status})
            self._halt.wait(max(0.0, self.period - took))

    def stop(self) -> None:
        self._halt.set()
        self.join(self.timeout + 2)


# ---- warm-up ----------------------------------------------------------------------------------------------

def warm_up(target: Target, bundle: BundleInfo, pool: PromptPool, timeout: float = 300.0,
            transports: tuple[str, ...] = ("grpc", "http")) -> dict[str, Any]:
    """Bring the server to its working set before the memory baseline is taken.

    Round 1: max_batch_size concurrent gRPC requests with the longest prompt (max_input_len) and as many
    tokens as the soak's longest requests (256, ignore_eos), so the KV pages the soak can hold at once
    are all touched (pages are handed out lowest first); plus two HTTP requests. Round 2: 2 x
    max_batch_size short gRPC requests through a full batch and a queue. With one of ``transports`` only,
    every request goes over that one (so a gRPC-only soak never touches the HTTP generate endpoint).
    """
    from .common import Spec, reply_from_sse, sse_payload

    longest = max(pool.prompts, key=lambda p: p.tokens)
    short = min(pool.prompts, key=lambda p: p.tokens)
    b = bundle.max_batch_size
    long_tokens = max(1, min(256, bundle.max_seq_len - longest.tokens))
    rounds = [[Spec(longest, long_tokens, {"temperature": 0, "ignore_eos": True}, True, True, None)] * b,
              [Spec(short, 32, {"temperature": 0}, True, i % 2 == 0, None) for i in range(2 * b)]]
    problems: list[str] = []
    deadline = time.monotonic() + timeout

    def grpc_one(spec: Spec) -> list[str]:
        stream = GrpcStream(target.grpc)
        ids, text, reason = [], [], None
        try:
            for r in stream.generate(grpc_inputs(spec.request_dict()), timeout=max(1.0, deadline - time.monotonic())):
                if r.error:
                    return [f"grpc error: {r.error}"]
                ids += r.ids
                text.append(r.text)
                reason = r.finish_reason if r.final else reason
        except Exception as e:  # warm-up failures are reported, not raised
            return [f"grpc {type(e).__name__}: {e}"]
        finally:
            stream.close()
        return check_result(spec, ids, "".join(text), reason)

    def http_one(spec: Spec) -> list[str]:
        import http.client

        host, _, port = target.http.partition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=max(1.0, deadline - time.monotonic()))
        ids, text, reason = [], [], None
        try:
            conn.request("POST", f"/v2/models/{MODEL}/generate_stream", body=json.dumps(spec.request_dict()),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            for line in resp:
                obj = sse_payload(line)
                if obj is None:
                    continue
                r = reply_from_sse(obj, time.perf_counter())
                if r.error:
                    return [f"http error: {r.error}"]
                ids += r.ids
                text.append(r.text)
                if r.final:
                    reason = r.finish_reason
                    break
        except Exception as e:
            return [f"http {type(e).__name__}: {e}"]
        finally:
            conn.close()
        return check_result(spec, ids, "".join(text), reason)

    t0 = time.monotonic()
    sent = 0
    main_one = grpc_one if "grpc" in transports else http_one
    side_one = http_one if "http" in transports else grpc_one
    with ThreadPoolExecutor(max_workers=2 * b + 2) as ex:
        for i, specs in enumerate(rounds):
            futures = [ex.submit(main_one, s) for s in specs]
            if i == 0:
                futures += [ex.submit(side_one, Spec(p, 16, {}, True, False, None)) for p in (short, longest)]
            for f in futures:
                problems += f.result()
            sent += len(futures)
    return {"requests": sent, "problems": problems, "seconds": round(time.monotonic() - t0, 1)}


# ---- locust -----------------------------------------------------------------------------------------------

def locust_command(args: argparse.Namespace, target: Target, reports: Path) -> list[str]:
    exe = Path(sys.executable).parent / "locust"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "locust"]
    rate = args.spawn_rate or max(1.0, args.users / 5.0)
    return [*cmd, "-f", str(REPO / "loadtests" / "locustfile.py"), "--headless", "-u", str(args.users), "-r",
                  f"{rate:g}", "-t", args.duration, "--stop-timeout", str(args.stop_timeout), "--host",
                  f"http://{target.http}", "--csv", str(reports / "soak"), "--html", str(reports / "soak.html"),
                  "--only-summary", "--loglevel", "INFO", "--exit-code-on-error", "1"]


def read_locust_csv(path: Path) -> list[dict[str, str]]:
    import csv

    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# ---- the run ------------------------------------------------------------------------------------------------

@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Soak:
    args: argparse.Namespace
    reports: Path
    checks: list[Check] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)


def run(args: argparse.Namespace) -> Soak:
    from deploy.triton import TritonError, TritonServer

    reports = Path(args.reports).resolve()
    reports.mkdir(parents=True, exist_ok=True)
    for old in [*reports.glob("soak_*.csv"), reports / "soak.html", reports / "soak_verdict.json",
                reports / "soak_summary.json", reports / "soak_memory.csv", reports / "soak_heap.txt"]:
        old.unlink(missing_ok=True)
    heap_dir = reports / "soak_heap"
    shutil.rmtree(heap_dir, ignore_errors=True)
    soak = Soak(args, reports)
    duration_s = parse_duration(args.duration)
    mem_plan = mem.Plan.for_duration(duration_s, args.memory_sample_s, args.memory_settle_s, args.memory_budget,
                                     args.memory_floor, args.heap_snapshot_s)
    soak.data["config"] = {"users": args.users, "duration": args.duration, "duration_s": duration_s,
                           "fault_share": args.fault_share, "multi_block": args.multi_block,
                           "profile_pinning": args.profile_pinning, "url": args.url or None,
                           "cancel_after_final": args.cancel_after_final, "protocol": args.protocol,
                           "memory": mem_plan.as_dict(), "heap_debug": args.heap_debug}
    server = None
    poller = None
    tree_end: dict[int, int] = {}
    ours_shm: set[str] = set()
    t_begin = time.monotonic()
    try:
        # -- server --------------------------------------------------------------------------------
        if args.url:
            target = Target.from_url(args.url, os.environ.get("GRPC_URL") or None,
                                     os.environ.get("METRICS_URL") or None)
            pid = find_server_pid(target.http)
            log(f"using the running server at {target.http} (gRPC {target.grpc}, metrics {target.metrics})"
                + (f", pid {pid}" if pid else ", pid not found here: memory not measured"))
        else:
            params = {"multi_block_mode": args.multi_block, "profile_pinning": args.profile_pinning}
            if args.heap_debug:
                heap_dir.mkdir(parents=True, exist_ok=True)
                params |= {"heap_debug_dir": str(heap_dir), "heap_snapshot_period_s": str(mem_plan.heap_snapshot_s)}
            server = TritonServer(Path(args.model_repository), parameters=params,
                                  log_path=reports / "soak_tritonserver.log", log_verbose=args.server_log_verbose)
            server.start()
            log(f"tritonserver pid {server.pid} starting with {params}")
            server.wait("ready", timeout=args.ready_timeout)
            target = Target(server.http_url, server.grpc_url, server.metrics_url)
            pid = server.pid
            log(f"ready: HTTP {target.http}  gRPC {target.grpc}  metrics {target.metrics}")
        params = model_parameters(model_config(target.http))
        bundle = BundleInfo.from_server(target.http)
        soak.data["server"] = {"pid": pid, "started_by_runner": server is not None, "http": target.http,
                               "grpc": target.grpc, "metrics": target.metrics, "parameters": params,
                               "bundle": str(bundle.engine_dir), "max_batch_size": bundle.max_batch_size,
                               "max_input_len": bundle.max_input_len, "max_seq_len": bundle.max_seq_len}
        poller = ReadinessPoller(target.http)
        poller.start()

        # -- warm-up and baseline ------------------------------------------------------------------
        pool = PromptPool(bundle, seed=args.seed)
        warm = warm_up(target, bundle, pool, transports=protocols(args.protocol))
        soak.data["warmup"] = warm
        soak.check("warm-up", not warm["problems"],
                   f"{warm['requests']} requests in {warm['seconds']} s" +
                   (f"; problems: {warm['problems'][:3]}" if warm["problems"] else ""))
        time.sleep(1.0)
        tree = process_tree(pid) if pid else {}
        mem_start = rss_mib(tree) if tree else None
        ours_shm = mapped_shm(tree)
        before = scrape(target.metrics)
        soak.data["memory"] = {"start_mib": mem_start, "processes": len(tree)}
        log(f"warm-up: {warm['requests']} requests in {warm['seconds']} s; server tree RSS "
            f"{f'{mem_start:.1f} MiB' if mem_start else 'n/a'} over {len(tree)} processes")

        # -- locust ---------------------------------------------------------------------------------
        env = dict(os.environ)
        env["FAULT_CANCEL_AFTER_FINAL"] = "1" if args.cancel_after_final else "0"
        env["SOAK_PROTOCOL"] = args.protocol
        env.update({"PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                    "SOAK_GRPC_URL": target.grpc, "SOAK_METRICS_URL": target.metrics,
                    "SOAK_ENGINE_DIR": str(bundle.engine_dir), "SOAK_SUMMARY": str(reports / "soak_summary.json"),
                    "FAULT_SHARE": str(args.fault_share), "SOAK_SEED": str(args.seed)})
        cmd = locust_command(args, target, reports)
        hard_timeout = duration_s + args.stop_timeout + 180
        log(f"locust: {args.users} users for {args.duration} (hard timeout {hard_timeout:.0f} s): {' '.join(cmd)}")
        sampler = None
        if pid:
            sampler = mem.MemorySampler(pid, mem_plan.sample_s, lambda: heap_by_pid(target.metrics),
                                        alloc=(lambda: malloc_by_pid(target.metrics)) if args.heap_debug else None,
                                        smaps=args.heap_debug)
            sampler.sample()  # t = 0: right after warm-up
            sampler.start()
        with open(reports / "soak_locust.log", "wb") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        t_locust = time.monotonic()
        next_report = t_locust + args.progress_every
        timed_out = False
        while proc.poll() is None:
            now = time.monotonic()
            if now - t_locust > hard_timeout:
                timed_out = True
                log(f"locust still running after {hard_timeout:.0f} s: stopping it (pid {proc.pid})")
                _stop_group(proc)
                break
            if now >= next_report:
                next_report = now + args.progress_every
                snap = scrape(target.metrics)
                log(f"{now - t_locust:5.0f}/{duration_s:.0f} s: finished "
                    f"{metric(snap, 'requests_finished_total') or 0:.0f}, tokens "
                    f"{metric(snap, 'generated_tokens_total') or 0:.0f}, running "
                    f"{metric(snap, 'requests_running') or 0:.0f}, waiting {metric(snap, 'requests_waiting') or 0:.0f}"
                    f", RSS {rss_mib(process_tree(pid)) if pid else 0:.1f} MiB, not-ready polls "
                    f"{len(poller.not_ready)}")
            time.sleep(min(5.0, max(0.2, next_report - time.monotonic())))
        rc = proc.wait(30)
        samples = sampler.stop() if sampler is not None else []
        soak.data["locust"] = {"exit_code": rc, "timed_out": timed_out,
                               "seconds": round(time.monotonic() - t_locust, 1), "command": cmd}
        summary_path = reports / "soak_summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        soak.data["summary"] = summary
        soak.check("locust ran to the end", not timed_out and rc in (0, 1) and bool(summary),
                   f"exit code {rc}" + (" (timed out)" if timed_out else "") +
                   ("" if summary else "; no summary written") + (" (2 = unhandled exception in a user)"
                                                                  if rc == 2 else ""))

        # -- valid requests and faults ----------------------------------------------------------------
        valid = Counter(summary.get("valid", {}))
        ok_n = sum(v for k, v in valid.items() if k.endswith(":ok"))
        bad_n = sum(v for k, v in valid.items() if k.endswith(":failed"))
        soak.check("valid requests: none failed", ok_n > 0 and bad_n == 0,
                   f"{ok_n} served ({', '.join(f'{k} {v}' for k, v in sorted(valid.items()))}), {bad_n} failed"
                   + (f"; reasons: {dict(list(summary.get('failure_reasons', {}).items())[:5])}" if bad_n else ""))
        faults = summary.get("faults", {})
        totals = Counter()
        for outcomes in faults.values():
            totals.update(outcomes)
        if args.fault_share > 0:
            soak.check("faults: every one got its expected outcome",
                       totals["expected"] > 0 and totals["unexpected_success"] == 0 and totals["wrong_error"] == 0,
                       f"{sum(totals.values())} faults: {totals['expected']} expected, "
                       f"{totals['unexpected_success']} unexpected success, {totals['wrong_error']} wrong error"
                       + (f"; e.g. {summary.get('fault_examples', [])[:3]}"
                          if totals["unexpected_success"] or totals["wrong_error"] else ""))

        # -- drain -------------------------------------------------------------------------------------
        t_drain = time.monotonic()
        gauges: dict[str, float | None] = {}
        while True:
            snap = scrape(target.metrics)
            gauges = {g: _int(metric(snap, g)) for g in ("requests_running", "requests_waiting", "slots_in_use",
                                                   "kv_pages_in_use", "profile_switches")}
            drained = all(gauges[g] == 0 for g in ("requests_running", "requests_waiting", "slots_in_use",
                                                   "kv_pages_in_use"))
            if drained or time.monotonic() - t_drain > args.drain_timeout:
                break
            time.sleep(0.5)
        drain_s = round(time.monotonic() - t_drain, 1)
        after = snap
        soak.data["drain"] = {"seconds": drain_s, **gauges}
        soak.check("drain: slots and KV pages back to zero", drained,
                   f"after {drain_s} s: slots {gauges['slots_in_use']}, KV pages {gauges['kv_pages_in_use']}, "
                   f"running {gauges['requests_running']}, waiting {gauges['requests_waiting']}"
                   + ("" if drained else f" (gave up after {args.drain_timeout:.0f} s)"))
        pinning = params.get("profile_pinning", "per_context") or "per_context"
        switches = gauges.get("profile_switches")
        if pinning == "per_context":
            soak.check("profile switches == 0 (per_context)", switches == 0, f"profile switches {switches}")
        finished = delta(by_label(after, "requests_finished_total"), by_label(before, "requests_finished_total"))
        rejected = delta(by_label(after, "requests_rejected_total"), by_label(before, "requests_rejected_total"))
        soak.data["server_counters"] = {
            "finished_by_reason": finished, "rejected_by_code": rejected,
            "generated_tokens": (metric(after, "generated_tokens_total") or 0)
            - (metric(before, "generated_tokens_total") or 0),
            "attention_plans": delta(by_label(after, "attention_plans_total"),
                                     by_label(before, "attention_plans_total")),
            "attention_fallbacks": delta(by_label(after, "attention_fallbacks_total"),
                                         by_label(before, "attention_fallbacks_total")),
            "profile_switches": switches, "profile_pinning": pinning}
        soak.check("no request ended in an engine error", not finished.get("error"),
                   f"finished by reason {finished}")

        # -- memory ------------------------------------------------------------------------------------
        tree_end = process_tree(pid) if pid else {}
        if mem_start and tree_end:
            mem_end = rss_mib(tree_end)
            allowance = mem.Allowance.late_cancels(late_cancels(summary), duration_s)
            report = mem.soak_report(samples, mem_plan, mem_start, mem_end, MEMORY_RATIO, MEMORY_JUMP_MIB,
                                     heap_dir if args.heap_debug else None, sampler.t0_wall if sampler else 0.0,
                                     allowance, mem.ort_arena_series(server.log_path, sampler.t0_wall)
                                     if args.heap_debug and server is not None and server.log_path and sampler
                                     else ())
            for name, ok, detail in report.checks:
                soak.check(name, ok, detail)
            soak.data["memory"].update(report.data)
            soak.data["memory_lines"] = report.lines
            mem.write_csv(samples, reports / "soak_memory.csv")
        elif mem_start:
            soak.check("memory: server alive at the end", False, f"process {pid} is gone")
        ours_shm |= mapped_shm(tree_end)

        # -- readiness -----------------------------------------------------------------------------------
        poller.stop()
        soak.data["readiness"] = {"polls": poller.polls, "not_ready": len(poller.not_ready),
                                  "first_not_ready": poller.not_ready[:5],
                                  "max_poll_s": round(poller.max_latency, 3)}
        soak.check("server ready throughout", poller.polls > 0 and not poller.not_ready,
                   f"{poller.polls} polls, {len(poller.not_ready)} not ready"
                   + (f" (first: {poller.not_ready[:3]})" if poller.not_ready else ""))
    except (TritonError, RuntimeError, OSError, ValueError) as e:
        soak.check("soak ran", False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        log(f"error: {e}")
        if server is not None and server.pid:
            tree_end = process_tree(server.pid)
            ours_shm |= mapped_shm(tree_end)
    finally:
        if poller is not None and poller.is_alive():
            poller.stop()
        if server is not None:
            _stop_server(soak, server, tree_end, ours_shm)
    soak.data["wall_s"] = round(time.monotonic() - t_begin, 1)
    return soak


def late_cancels(summary: dict[str, Any]) -> int:
    """How many ``cancel_after_final`` faults the locust summary counts (every outcome)."""
    return sum(sum(o.values()) for k, o in summary.get("faults", {}).items() if k.startswith("cancel_after_final"))


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group we started (its pid is its group id), SIGKILL after 15 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def unload_hang(log_text: str) -> dict[str, Any]:
    """What the server log says about a shutdown that did not finish unloading (Triton 2.51's messages).

    ``no_inflight_inferences``: the last "Found N model versions that have in-flight inferences" said 0;
    ``live_model_waits``: how many "Found N live models" polls (N > 0) followed, i.e. seconds spent waiting
    for a model whose every request had completed.
    """
    inflight = re.findall(r"Found (\d+) model versions that have in-flight inferences", log_text)
    waits = len(re.findall(r"Found [1-9]\d* live models", log_text))
    return {"exit_timeout_expired": "Exit timeout expired" in log_text,
            "no_inflight_inferences": bool(inflight) and inflight[-1] == "0", "live_model_waits": waits}


def _stop_server(soak: Soak, server: Any, tree: dict[int, int], ours_shm: set[str]) -> None:
    """Stop by PID (TritonServer.stop); check the exit code, leftover processes and /dev/shm regions.

    TritonServer.stop already SIGKILLs a stub that outlives its server and removes the regions such a
    stub leaves (reporting them in ``leaked_shm``); whatever it reports or misses counts as a failure
    here, and anything of ours still left is ended by PID / removed after being reported.
    """
    tree = dict(tree) or process_tree(server.pid)
    t0 = time.monotonic()
    code = server.stop()
    stop_s = round(time.monotonic() - t0, 1)
    time.sleep(0.5)
    left = {p: s for p, s in tree.items() if p != server.pid and alive(p, s)}
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    still = {r for r in ours_shm if Path("/dev/shm", r).exists()}
    leaked = sorted(set(server.leaked_shm) | still)
    if still:
        in_use = mapped_shm([int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()])
        for r in still - in_use:  # ours, reported above: do not leave it on the machine
            with contextlib.suppress(OSError):
                Path("/dev/shm", r).unlink()
    log_text = server.log_text()
    crash = [ln.strip() for ln in log_text.splitlines() if CRASH_PATTERNS.search(ln)][:5]
    hang = unload_hang(log_text)
    late = late_cancels(soak.data.get("summary", {}))
    soak.data["shutdown"] = {"exit_code": code, "seconds": stop_s, "processes_left": sorted(left),
                             "shm_left": leaked, "exit_timeout_expired": hang["exit_timeout_expired"],
                             "unload_hang": hang, "late_cancels": late, "crash_lines": crash}
    # Triton 2.51's gRPC frontend keeps a model reference when a client cancels a stream while the write of
    # its final response is still pending (deploy/README.md): the model then never unloads and the server
    # exits on its exit timeout (code 1); stop() reaps the stub and its shm region. That upstream hang is
    # accepted only in its exact shape: the run sent late cancels, the server found no in-flight inference
    # (every request had its final response: the model is not holding anything) and then waited for the
    # last live model until the timeout. A hang with inferences in flight, a crash, a survivor process or a
    # leak outside that case fails the soak.
    upstream_hang = hang["exit_timeout_expired"] and hang["no_inflight_inferences"] and hang["live_model_waits"] > 0 \
        and code == 1 and not crash and late > 0
    detail = f"exit code {code} after {stop_s} s"
    if hang["exit_timeout_expired"]:
        detail += (" (the model unload hit the exit timeout with no inference in flight after "
                   f"{late} late cancels: Triton 2.51's gRPC frontend holds the model, see deploy/README.md)"
                   if upstream_hang else " (the exit timeout expired outside the known upstream case)")
    soak.check("clean shutdown: exit 0 (or Triton's known unload hang), no process or /dev/shm region left",
               (code == 0 or upstream_hang) and not left and (not leaked or upstream_hang),
               detail + f"; processes left {sorted(left) or 'none'}; /dev/shm regions left {leaked or 'none'}"
               + (" (removed after the check)" if leaked else ""))
    soak.check("server log: no crash", not crash, "; ".join(crash) if crash else "no crash signature in the log")
    server.cleanup()


# ---- report ---------------------------------------------------------------------------------------------------

def _ms(v: Any) -> str:
    return "n/a" if v is None else f"{v:.1f} ms"


def render(soak: Soak) -> str:
    d = soak.data
    s = d.get("summary", {})
    lines = [f"== soak verdict: {'PASS' if soak.passed else 'FAIL'} =="]
    srv = d.get("server", {})
    if srv:
        p = srv.get("parameters", {})
        how = "started by the runner" if srv.get("started_by_runner") else "already running"
        lines.append(f"server: tritonserver pid {srv.get('pid')} ({how})"
                     f", multi_block_mode={p.get('multi_block_mode')}, profile_pinning={p.get('profile_pinning')}, "
                     f"bundle {srv.get('bundle')} (max_batch_size {srv.get('max_batch_size')}, max_input_len "
                     f"{srv.get('max_input_len')}, max_seq_len {srv.get('max_seq_len')})")
    c = d.get("config", {})
    lines.append(f"load: {c.get('users')} users, fault share {c.get('fault_share')}, {c.get('duration')}; "
                 f"locust {d.get('locust', {}).get('seconds', 'n/a')} s, whole run {d.get('wall_s')} s")
    valid = s.get("valid", {})
    ok_n = sum(v for k, v in valid.items() if k.endswith(":ok"))
    bad_n = sum(v for k, v in valid.items() if k.endswith(":failed"))
    split = ", ".join(f"{k} {v}" for k, v in sorted(valid.items()))
    lines.append(f"valid requests: {ok_n} served, {bad_n} failed ({split}); "
                 f"{s.get('tokens', 0)} tokens; greedy repeats checked {s.get('greedy', {}).get('checked', 0)}, "
                 f"mismatches {s.get('greedy', {}).get('mismatches', 0)}")
    faults = s.get("faults", {})
    if faults:
        lines.append(f"faults by kind ({sum(sum(o.values()) for o in faults.values())} sent):")
        lines.append(f"  {'kind':42s} {'expected':>9s} {'unexp.success':>14s} {'wrong error':>12s}")
        for kind, o in faults.items():
            lines.append(f"  {kind:42s} {o.get('expected', 0):9d} {o.get('unexpected_success', 0):14d} "
                         f"{o.get('wrong_error', 0):12d}")
    lat = s.get("latency", {})
    for key, label in (("ttft", "TTFT"), ("itl", "ITL")):
        h = lat.get(key)
        if h:
            per = "; ".join(f"{t} p50 {_ms(lat[f'{key}:{t}']['p50_ms'])} p99 {_ms(lat[f'{key}:{t}']['p99_ms'])}"
                            for t in ("grpc", "http") if f"{key}:{t}" in lat)
            lines.append(f"{label}: p50 {_ms(h['p50_ms'])}, p99 {_ms(h['p99_ms'])}, max {_ms(h['max_ms'])} "
                         f"over {h['count']} samples ({per})")
    dr = d.get("drain")
    if dr:
        lines.append(f"after drain ({dr['seconds']} s): slots in use {dr.get('slots_in_use')}, KV pages in use "
                     f"{dr.get('kv_pages_in_use')}, running {dr.get('requests_running')}, waiting "
                     f"{dr.get('requests_waiting')}, profile switches {dr.get('profile_switches')}")
    sc = d.get("server_counters")
    if sc:
        lines.append(f"server counters during the run: finished {sc['finished_by_reason']}, rejected "
                     f"{sc['rejected_by_code']}, tokens {sc['generated_tokens']:.0f}, attention plans "
                     f"{sc['attention_plans']}, fallbacks {sc['attention_fallbacks'] or 'none'}")
    m = d.get("memory", {})
    if m.get("end_mib") is not None:
        lines.append(f"memory (RSS of tritonserver + stubs): {m['start_mib']} MiB after warm-up -> {m['end_mib']} MiB "
                     f"at the end, peak {m['peak_mib']} MiB; jump bound {m['bound_mib']} MiB "
                     f"= max(start x {MEMORY_RATIO}, start + {MEMORY_JUMP_MIB:.0f} MiB)")
        lines += d.get("memory_lines", [])
    r = d.get("readiness")
    if r:
        lines.append(f"readiness: {r['polls']} polls (every 1 s), {r['not_ready']} not ready, "
                     f"slowest {r['max_poll_s']} s")
    sd = d.get("shutdown")
    if sd:
        lines.append(f"shutdown: exit code {sd['exit_code']} after {sd['seconds']} s, processes left "
                     f"{sd['processes_left'] or 'none'}, "
                     f"/dev/shm regions left {sd['shm_left'] or 'none'}")
    lines.append("checks:")
    lines += [f"  [{'PASS' if ck.ok else 'FAIL'}] {ck.name}: {ck.detail}" for ck in soak.checks]
    rep = soak.reports
    lines.append(f"reports: {rep / 'soak_stats.csv'} (+ _failures, _exceptions, _stats_history), {rep / 'soak.html'}, "
                 f"{rep / 'soak_verdict.json'}, {rep / 'soak_locust.log'}"
                 + (f", {rep / 'soak_tritonserver.log'}" if srv.get("started_by_runner") else ""))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    ap = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=int(env.get("USERS") or 16))
    ap.add_argument("--duration", default=env.get("DURATION") or "5m", help="locust run time: 60s, 30m, 1h")
    ap.add_argument("--multi-block", default=env.get("MULTI_BLOCK") or "auto", choices=("auto", "on", "off"))
    ap.add_argument("--profile-pinning", default=env.get("PROFILE_PINNING") or "per_context",
                    choices=("per_context", "single_context"))
    ap.add_argument("--fault-share", type=float, default=float(env.get("FAULT_SHARE") or 0.2))
    ap.add_argument("--protocol", default=(env.get("PROTOCOL") or "both").lower(), choices=tuple(PROTOCOLS),
                    help="transports of the valid users, the faults and the warm-up: both (default; gRPC streams "
                         "and HTTP generate_stream) | grpc | http")
    ap.add_argument("--url", default=env.get("URL") or "", help="a running server's HTTP host:port")
    ap.add_argument("--reports", default=env.get("REPORTS") or str(REPO / "reports"))
    ap.add_argument("--spawn-rate", type=float, default=float(env.get("SPAWN_RATE") or 0))
    ap.add_argument("--stop-timeout", type=int, default=60, help="seconds locust lets running tasks finish")
    ap.add_argument("--drain-timeout", type=float, default=float(env.get("DRAIN_TIMEOUT") or 60))
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--progress-every", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=int(env.get("SOAK_SEED") or 0))
    ap.add_argument("--memory-budget", type=float, default=float(env.get("MEMORY_BUDGET") or 1.0),
                    help="allowed RSS / Python-heap growth after warm-up, MiB per hour (default 1)")
    ap.add_argument("--memory-floor", type=float, default=float(env.get("MEMORY_FLOOR") or 1.0),
                    help="the budget never asks for less than this many MiB of fitted growth over the fit window "
                         "(short runs cannot resolve less; default 1)")
    ap.add_argument("--memory-settle-s", type=float, default=float(env.get("MEMORY_SETTLE_S") or -1),
                    help="seconds after warm-up before the fit starts (default: 20%% of the run, at most 600)")
    ap.add_argument("--memory-sample-s", type=float, default=float(env.get("MEMORY_SAMPLE_S") or 0),
                    help="seconds between memory samples (default: duration / 360, 1..10)")
    ap.add_argument("--heap-debug", action=argparse.BooleanOptionalAction,
                    default=(env.get("HEAP_DEBUG") or "1") != "0",
                    help="run the model with heap debugging (tracemalloc gauges + snapshots in reports/soak_heap/); "
                         "only for a server the runner starts (default on)")
    ap.add_argument("--heap-snapshot-s", type=int, default=int(env.get("HEAP_SNAPSHOT_S") or 0),
                    help="seconds between heap snapshots (default: duration / 12, 10..600)")
    ap.add_argument("--cancel-after-final", action=argparse.BooleanOptionalAction,
                    default=(env.get("FAULT_CANCEL_AFTER_FINAL") or "1") != "0",
                    help="include the cancel_after_final fault (a gRPC stream cancelled right after its final "
                         "response; default on, FAULT_CANCEL_AFTER_FINAL=0 turns it off)")
    ap.add_argument("--server-log-verbose", type=int, default=int(env.get("SERVER_LOG_VERBOSE") or 0),
                    help="tritonserver --log-verbose level (1: the gRPC stream states, for debugging)")
    ap.add_argument("--model-repository", default=env.get("MODEL_REPOSITORY") or str(REPO / "model_repository"),
                    help="model repository the runner serves (default: the project's)")
    args = ap.parse_args(argv)
    if args.users < 1 or not 0 <= args.fault_share < 1:
        ap.error("--users must be >= 1 and --fault-share in [0, 1)")
    try:
        parse_duration(args.duration)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    soak = run(args)
    verdict = {"pass": soak.passed, "checks": [c.__dict__ for c in soak.checks], **soak.data}
    path = soak.reports / "soak_verdict.json"
    path.write_text(json.dumps(verdict, indent=1, default=str))
    print(render(soak), flush=True)
    print(f"SOAK_VERDICT {'PASS' if soak.passed else 'FAIL'} {path}", flush=True)
    return 0 if soak.passed else 1


if __name__ == "__main__":
    sys.exit(main())
