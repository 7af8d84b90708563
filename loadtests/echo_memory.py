"""Memory of Triton itself under the soak's client patterns: ``python -m loadtests.echo_memory``.

Serves ``loadtests/echo_repository`` (a decoupled Python-backend echo model with no project code) with the
same tritonserver as the soak (``deploy.triton.TritonServer``), drives it with ``--users`` threads the way
the soak's users drive hybrid_llm, samples the RSS of the server and its stub every ``--sample-s`` seconds
(``loadtests.memory.MemorySampler``) and prints the Theil-Sen slopes after ``--settle-s``. Used for issue 21
to put tritonserver's growth on one frontend and one client pattern (deploy/README.md has the figures).

Actions (``--mix`` weights), per transport:

* ``normal``: a streamed request of 4..32 responses, read to its final one;
* ``invalid``: an empty prompt (the model answers with an error response);
* ``reject``: a request Triton refuses before the model (gRPC: unknown input, wrong dtype or shape,
  missing input; HTTP: malformed JSON, wrong dtype, unknown field);
* ``cancel_mid``: a 64-response request cancelled after 0..8 responses (gRPC ``stop_stream(cancel_requests=
  True)``; HTTP: the socket is shut down);
* ``cancel_after_final``: a request of 1..8 responses read to its final one, then the stream is cancelled
  (gRPC; over HTTP it closes the connection after the final event).

A gRPC user keeps one stream (``loadtests.common.GrpcStream``) and opens a new one after every cancel; an
HTTP user keeps one keep-alive connection and opens a new one after a cancel, an invalid or rejected
request, and after ``--new-conn`` of the normal ones. ``--param key=value`` sets the model's parameters
(``token_ms``, ``zero_byte_outputs``, ``metrics_per_token``, ``cancelled_final_with_data``, ``hold_requests``:
config.pbtxt); ``--model-repository model_repository --model hybrid_llm`` drives this project's model with
the same clients (it takes the same inputs); ``--heaptrack`` attaches heaptrack to the server after it is
ready (``heaptrack_print --print-leaks 1 -f <out>/heaptrack.zst``).

Example (the HTTP frontend's zero-byte-output leak, and without it)::

    python -m loadtests.echo_memory --protocol http --mix normal=100 --param zero_byte_outputs=true --out /tmp/e1
    python -m loadtests.echo_memory --protocol http --mix normal=100 --out /tmp/e2
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from deploy.triton import TritonServer

from . import memory as mem
from .common import REPO, GrpcStream, StreamTimeout, grpc_input, reply_from_sse, sse_payload

ECHO_REPOSITORY = REPO / "loadtests" / "echo_repository"
ACTIONS = ("normal", "invalid", "reject", "cancel_mid", "cancel_after_final")


class Driver:
    def __init__(self, args: argparse.Namespace, server: TritonServer) -> None:
        self.args, self.server = args, server
        self.mix = [(k, float(v)) for k, v in (p.split("=") for p in args.mix.split(","))]
        unknown = [k for k, _ in self.mix if k not in ACTIONS]
        if unknown:
            raise SystemExit(f"--mix: unknown actions {unknown}; choose from {', '.join(ACTIONS)}")
        self.wait = tuple(float(x) for x in args.wait.split(","))
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.halt = threading.Event()

    def count(self, key: str, n: int = 1, error: str | None = None) -> None:
        with self.lock:
            self.counts[key] += n
            if error is not None and len(self.errors) < 5:
                self.errors.append(error)

    def pick(self, rng: random.Random) -> tuple[str, str, int]:
        action = rng.choices([k for k, _ in self.mix], [w for _, w in self.mix])[0]
        text = "hello world " * rng.randint(1, 20)
        n = {"cancel_mid": 64, "cancel_after_final": rng.randint(1, 8)}.get(action, rng.randint(4, 32))
        return action, text, n

    def grpc_user(self, i: int) -> None:
        from tritonclient.utils import InferenceServerException

        rng = random.Random(1000 + i)
        stream = GrpcStream(self.server.grpc_url, model=self.args.model)
        while not self.halt.is_set():
            action, text, n = self.pick(rng)
            inputs = [grpc_input("text_input", "" if action == "invalid" else text), grpc_input("stream", True),
                      grpc_input("max_tokens", n)]
            if action == "reject":
                inputs = rng.choice([[*inputs, grpc_input("bogus", 1, "INT32")],
                                     [inputs[0], inputs[1], grpc_input("max_tokens", 4.0, "FP32")],
                                     [inputs[1], inputs[2]],
                                     [grpc_input("text_input", ["a", "b"]), inputs[1], inputs[2]]])
            got, err, after = 0, None, rng.randint(0, 8)
            try:
                if action == "cancel_mid" and after == 0:
                    stream.send(inputs)  # cancelled before any response can arrive
                else:
                    for r in stream.generate(inputs, timeout=60):
                        err = err or r.error
                        got += 1
                        if action == "cancel_mid" and got >= after:
                            break
            except (StreamTimeout, InferenceServerException) as e:
                err = f"{type(e).__name__}: {e}"
                stream.reset()
            if err and self.args.close_after_error:
                stream.reset(cancel=False)  # a stream that carried an error is closed, not reused
            elif action == "cancel_after_final":
                stream.reset(cancel=True)
            elif action == "cancel_mid" or (action == "normal" and rng.random() < self.args.new_conn):
                stream.reset()  # cancels only a request still in flight
            self.count(action)
            self.count("responses", got, f"{action}: {err}" if err and action not in ("invalid", "reject") else None)
            time.sleep(rng.uniform(*self.wait))
        stream.close()

    def http_user(self, i: int) -> None:
        rng = random.Random(2000 + i)
        host, port = self.server.http_url.split(":")
        conn: http.client.HTTPConnection | None = None
        while not self.halt.is_set():
            action, text, n = self.pick(rng)
            body = json.dumps({"text_input": "" if action == "invalid" else text, "stream": True, "max_tokens": n})
            if action == "reject":
                body = rng.choice(["{not json", "[]",
                                   json.dumps({"text_input": text, "stream": True, "max_tokens": 1.5}),
                                   json.dumps({"text_input": text, "stream": True, "bogus": 1})])
            conn = conn or http.client.HTTPConnection(host, int(port), timeout=60)
            got, err, after = 0, None, rng.randint(0, 8)
            try:
                conn.request("POST", f"/v2/models/{self.args.model}/generate_stream", body=body.encode(),
                             headers={"Content-Type": "application/json"})
                if action != "cancel_mid":
                    for line in conn.getresponse().read().splitlines():
                        obj = sse_payload(line)
                        if obj is not None:
                            got += 1
                            err = err or reply_from_sse(obj, 0.0).error
                elif after:
                    resp = conn.getresponse()
                    while got < after and (line := resp.fp.readline()):
                        got += sse_payload(line) is not None
            except (OSError, http.client.HTTPException, ValueError) as e:
                err = f"{type(e).__name__}: {e}"
            if action in ("cancel_mid", "cancel_after_final", "invalid", "reject") or err is not None or \
                    (action == "normal" and rng.random() < self.args.new_conn):
                if conn.sock is not None:
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
                conn.close()
                conn = None
            self.count(action)
            self.count("responses", got, f"{action}: {err}" if err and action not in ("invalid", "reject") else None)
            time.sleep(rng.uniform(*self.wait))
        if conn is not None:
            conn.close()


def slopes(samples: list[mem.Sample], settle_s: float, duration_s: float, requests: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in [None, *sorted({k for s in samples for k in s.rss_mib})]:
        g = mem.growth_verdict(key or "tree", mem.series_of(samples, key), settle_s, 1.0, 1.0)
        if g is None:
            continue
        d = g.as_dict()
        if key:
            anon = mem.growth_verdict("anon", mem.series_of(samples, key, part=0), settle_s, 1.0, 1.0)
            if anon is not None:
                d |= {"anon_slope_mib_h": anon.slope_mib_h, "anon_first_mib": anon.first_mib,
                      "anon_last_mib": anon.last_mib}
        d["bytes_per_request"] = round(g.slope_mib_h * 2**20 * duration_s / 3600 / max(1, requests), 1)
        out[key or "tree"] = d
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.echo_memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    ap.add_argument("--model-repository", default=str(ECHO_REPOSITORY),
                    help="serve this repository instead (e.g. model_repository: hybrid_llm takes the same inputs)")
    ap.add_argument("--model", default="echo", help="the model to drive (default echo)")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--duration-s", type=float, default=900)
    ap.add_argument("--settle-s", type=float, default=120)
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--mix", default="normal=50,cancel_mid=10,cancel_after_final=10,invalid=30")
    ap.add_argument("--new-conn", type=float, default=0.0, help="share of normal requests followed by a new connection")
    ap.add_argument("--wait", default="0.05,0.5", help="seconds between a user's requests: low,high")
    ap.add_argument("--close-after-error", action="store_true",
                    help="gRPC: close a stream (without cancelling) after a request on it ended in an error")
    ap.add_argument("--param", action="append", default=[], help="model parameter key=value (config.pbtxt)")
    ap.add_argument("--server-arg", action="append", default=[], help="one more tritonserver option")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE in the server's environment")
    ap.add_argument("--heaptrack", action="store_true", help="attach heaptrack to tritonserver once it is ready")
    ap.add_argument("--out", required=True, help="folder for server.log, memory.csv, result.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = TritonServer(Path(args.model_repository), model=args.model,
                          parameters=dict(p.split("=", 1) for p in args.param),
                          log_path=out / "server.log", env=dict(kv.split("=", 1) for kv in args.env),
                          server_args=args.server_arg)
    driver = Driver(args, server)
    server.start()
    heaptrack, samples = None, []
    try:
        server.wait("ready", timeout=120)
        print(f"tritonserver pid {server.pid}: HTTP {server.http_url}, gRPC {server.grpc_url}", flush=True)
        if args.heaptrack:
            heaptrack = subprocess.Popen(["heaptrack", "-o", str(out / "heaptrack"), "-p", str(server.pid)],
                                         stdout=(out / "heaptrack.log").open("w"), stderr=subprocess.STDOUT)
            time.sleep(15)  # injection through gdb
        sampler = mem.MemorySampler(server.pid, args.sample_s)  # type: ignore[arg-type]
        sampler.sample()
        sampler.start()
        users = [threading.Thread(target=driver.grpc_user if args.protocol == "grpc" else driver.http_user,
                                  args=(i,), daemon=True) for i in range(args.users)]
        t0 = time.monotonic()
        for u in users:
            u.start()
        while (left := args.duration_s - (time.monotonic() - t0)) > 0:
            time.sleep(min(120.0, left))
            last = sampler.samples[-1]
            print(f"t={time.monotonic() - t0:6.0f} s  RSS {last.rss_mib}  {dict(driver.counts)}", flush=True)
        driver.halt.set()
        for u in users:
            u.join(70)
        samples = sampler.stop()
    finally:
        driver.halt.set()
        code = server.stop(timeout=60)
        if heaptrack is not None:
            heaptrack.wait(120)
    mem.write_csv(samples, out / "memory.csv")
    requests = sum(v for k, v in driver.counts.items() if k in ACTIONS)
    result = {"args": vars(args), "counts": dict(driver.counts), "requests": requests, "errors": driver.errors,
              "exit_code": code, "samples": len(samples),
              "slopes": slopes(samples, args.settle_s, args.duration_s, requests)}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    for key, g in result["slopes"].items():
        print(f"{key}: {g['slope_mib_h']:+.2f} MiB/h ({g['first_mib']:.1f} -> {g['last_mib']:.1f} MiB"
              + (f", anonymous {g['anon_first_mib']:.2f} -> {g['anon_last_mib']:.2f}" if "anon_first_mib" in g else "")
              + f"), {g['bytes_per_request']:+.0f} B per request")
    print(f"{requests} requests, {driver.counts['responses']} responses, exit code {code}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
