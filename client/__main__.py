"""``python -m client``: talk to the hybrid_llm model on a running Triton server.

    python -m client generate "prompt" [--protocol grpc|http] [--url HOST:PORT] [--max-tokens N]
                                       [--temperature T] [--stream | --no-stream]
    python -m client health [--protocol grpc|http] [--url HOST:PORT]
    python -m client bench [--protocol grpc|http] [--concurrency 16] [--prompt-tokens 32] [--max-tokens 32]

Every subcommand speaks gRPC by default (127.0.0.1:8001); --protocol http uses Triton's HTTP endpoint
(127.0.0.1:8000).

Exit status 0 on success, 1 when the server is down, the model not ready or the request failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from .lib import (
    DEFAULT_GRPC_URL,
    DEFAULT_HTTP_URL,
    MODEL,
    ClientError,
    Result,
    ServerUnavailable,
    generate_http,
    generate_stream_grpc,
    health,
)


def _generate(args: argparse.Namespace) -> int:
    sampling = {"temperature": args.temperature} if args.temperature is not None else None
    if args.protocol == "grpc":
        gen = generate_stream_grpc(args.url or DEFAULT_GRPC_URL, args.prompt, max_tokens=args.max_tokens,
                                   sampling=sampling, stream=args.stream, model=args.model, timeout=args.timeout)
    else:
        gen = generate_http(args.url or DEFAULT_HTTP_URL, args.prompt, max_tokens=args.max_tokens,
                            sampling=sampling, stream=args.stream, model=args.model, timeout=args.timeout)
    with gen:
        for delta in gen:
            print(delta, end="", flush=True)
    print()
    r = gen.result
    itl = f", ITL {statistics.mean(r.itls) * 1e3:.1f} ms" if r.itls else ""
    ttft = f", TTFT {r.ttft * 1e3:.1f} ms" if r.ttft is not None else ""
    print(f"[finish_reason={r.finish_reason}, {len(r.output_ids)} tokens{ttft}{itl}]", file=sys.stderr)
    return 0


def _health(args: argparse.Namespace) -> int:
    h = health(args.url, args.protocol, args.model, timeout=args.timeout)
    print(f"server {h['url']}: live={h['live']} ready={h['ready']}")
    print(f"model {args.model}: ready={h['model_ready']}")
    if not h["model_ready"]:
        print(f"  the model is not ready: see the server log (it says why {args.model} failed to load)")
        return 1
    print(f"  max_batch_size (Triton) = {h.get('max_batch_size')}")
    for key, value in sorted(h["parameters"].items()):
        print(f"  parameter {key} = {value}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Greedy requests with token-id prompts at a fixed concurrency; prints TTFT and ITL."""
    url = args.url or (DEFAULT_GRPC_URL if args.protocol == "grpc" else DEFAULT_HTTP_URL)
    start = generate_stream_grpc if args.protocol == "grpc" else generate_http
    results: list[Result] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        for i in range(args.requests_per_worker):
            ids = [50 + (w * 31 + i * 7 + j * 13) % 200 for j in range(args.prompt_tokens)]
            try:
                r = start(url, input_ids=ids, max_tokens=args.max_tokens, model=args.model,
                          sampling={"temperature": 0, "ignore_eos": True}, timeout=args.timeout).wait()
                with lock:
                    results.append(r)
            except ClientError as e:
                with lock:
                    errors.append(str(e))

    # warm-up (first-run costs of the engine's sessions stay out of the numbers)
    start(url, input_ids=[50] * 4, max_tokens=2, model=args.model, timeout=args.timeout).wait()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        print(f"{len(errors)} requests failed, first: {errors[0]}", file=sys.stderr)
    if not results:
        return 1
    ttfts = sorted(r.ttft for r in results if r.ttft is not None)
    itls = sorted(x for r in results for x in r.itls)
    tokens = sum(len(r.output_ids) for r in results)

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")

    print(f"concurrency {args.concurrency}, {len(results)} requests, prompt {args.prompt_tokens} tokens, "
          f"max_tokens {args.max_tokens}: {tokens / wall:.0f} tokens/s")
    print(f"  TTFT ms: mean {statistics.mean(ttfts) * 1e3:.1f}  p50 {pct(ttfts, 0.5):.1f}  p90 {pct(ttfts, 0.9):.1f}")
    if itls:
        print(f"  ITL  ms: mean {statistics.mean(itls) * 1e3:.2f}  p50 {pct(itls, 0.5):.2f}  p90 {pct(itls, 0.9):.2f}")
    return 0 if not errors else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--protocol", choices=["grpc", "http"], default="grpc",
                        help="gRPC (the default, for every subcommand) or Triton's HTTP endpoint")
    common.add_argument("--url", help=f"HOST:PORT (default {DEFAULT_GRPC_URL} for gRPC, {DEFAULT_HTTP_URL} for HTTP)")
    common.add_argument("--model", default=MODEL)
    common.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each response")
    g = sub.add_parser("generate", parents=[common], help="generate text and print it as it arrives")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    sub.add_parser("health", parents=[common], help="server and model status, model parameters")
    b = sub.add_parser("bench", parents=[common], help="TTFT / ITL at a fixed concurrency (greedy)")
    b.add_argument("--concurrency", type=int, default=1)
    b.add_argument("--requests-per-worker", type=int, default=4)
    b.add_argument("--prompt-tokens", type=int, default=32)
    b.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    try:
        return {"generate": _generate, "health": _health, "bench": _bench}[args.cmd](args)
    except ServerUnavailable as e:
        print(f"error: {e}\n(is the server running? start it with `make serve` or `python -m deploy serve`; every "
              f"subcommand speaks gRPC (port 8001) unless given --protocol http (port 8000))", file=sys.stderr)
        return 1
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # e.g. the gRPC port asked over HTTP: say what went wrong, no traceback
        print(f"error: {type(e).__name__}: {e}\n(check --url and --protocol: gRPC is 8001, HTTP is 8000 by "
              f"default)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
