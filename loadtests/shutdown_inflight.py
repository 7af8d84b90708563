"""Shutdown with a stream in flight, repeated: ``python -m loadtests.shutdown_inflight [--runs 20] [--mode both]``.

Each run starts tritonserver on the default model (``deploy.triton.TritonServer``; built with the builder's
defaults in ``--work`` if missing, as ``make serve`` builds it), opens ``--streams`` greedy gRPC streams of 450
tokens (default 1), reads the first token of each, then stops the server and records how it ended:

* ``clean``: every stream got its final "cancelled" response, the server exited 0 and left no shared memory;
* ``exit 1``: Triton's exit timeout expired (the model never unloaded; the client got no final response);
* ``aborted``: the server died on a signal (``-6``: ``boost::interprocess::lock_exception`` in the Python backend);
* ``stub signal N``: the stub process ended on signal N (read from its zombie before the server reaped it).

Modes: ``stubs`` (``TritonServer.stop``'s default: SIGTERM to the model's stub, then the server; the model
drains on its own signal) and ``server`` (SIGTERM to the server alone, as an orchestrator that signals only the
container's first process: the model falls back to polling its readiness, which fails once the server is
exiting, on a path of Triton 2.51's Python backend that frees the error text while the stub reads it). The
table gives the count of each ending per mode (deploy/README.md, "Shutdown with requests in flight", has the
measured figures).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import Counter
from pathlib import Path

from client.lib import GenerationError, ServerUnavailable, generate_stream_grpc
from deploy.triton import TritonServer

PROMPT = "The quick brown fox jumps over the lazy dog."


def _bundle(work: Path) -> Path:
    """The default model built with the builder's defaults under ``work`` (``make serve``'s engine)."""
    from deploy.__main__ import build_default_engine

    work = work.resolve()  # engine_dir is resolved against the model repository otherwise
    if not (work / "bundle" / "manifest.json").exists():
        build_default_engine(work / "bundle", work / "checkpoint")
    return work / "bundle"


def _stub_exit_signal(pid: int) -> int | None:
    """The signal a zombie stub died of (``/proc/PID/stat`` exit_code, low 7 bits), or None if it is not one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[-1]) & 0x7F) or None if fields[0] == "Z" else None


def one_run(bundle: Path, signal_stubs: bool, streams: int = 1, exit_timeout_s: int = 8) -> str:
    """Start, stream, stop; return how it ended (the labels of the module docstring)."""
    server = TritonServer(parameters={"engine_dir": str(bundle)}, exit_timeout_s=exit_timeout_s)
    server.start()
    try:
        server.wait("ready", timeout=120)
        gens = [generate_stream_grpc(server.grpc_url, PROMPT, max_tokens=450,
                                     sampling={"temperature": 0, "ignore_eos": True}, timeout=exit_timeout_s + 10)
                for _ in range(streams)]
        for gen in gens:
            next(gen)
        finishes: list[str] = []

        def read(gen) -> None:
            try:
                finishes.append(gen.wait().finish_reason)
            except (ServerUnavailable, GenerationError, TimeoutError) as e:
                finishes.append(type(e).__name__)

        readers = [threading.Thread(target=read, args=(gen,), daemon=True) for gen in gens]
        for reader in readers:
            reader.start()
        stubs = dict(server.stubs)
        done: dict = {}
        stopper = threading.Thread(target=lambda: done.setdefault("code", server.stop(exit_timeout_s + 20,
                                                                                      signal_stubs)))
        stopper.start()
        stub_signal = None
        while stopper.is_alive() and stub_signal is None:  # a dead stub is a zombie until the server exits
            stub_signal = next((s for s in map(_stub_exit_signal, stubs) if s), None)
            time.sleep(0.05)
        stopper.join()
        for reader in readers:
            reader.join(exit_timeout_s + 15)
    finally:
        server.stop()
        server.cleanup()
    code = done.get("code")
    if stub_signal is not None:
        return f"stub signal {stub_signal}"
    if code == 0 and finishes == ["cancelled"] * streams and not server.leaked_shm:
        return "clean"
    if code is not None and code < 0:
        return "aborted"
    return f"exit {code}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20, help="runs per mode")
    ap.add_argument("--mode", choices=("both", "stubs", "server"), default="both")
    ap.add_argument("--streams", type=int, default=1, help="streams in flight at each shutdown")
    ap.add_argument("--work", type=Path, default=Path("build/shutdown_inflight"))
    args = ap.parse_args(argv)
    if args.runs < 1 or args.streams < 1:
        ap.error("--runs and --streams must be >= 1")
    bundle = _bundle(args.work)
    modes = ("stubs", "server") if args.mode == "both" else (args.mode,)
    results: dict[str, Counter] = {}
    for mode in modes:
        results[mode] = Counter()
        for i in range(args.runs):
            outcome = one_run(bundle, signal_stubs=mode == "stubs", streams=args.streams)
            results[mode][outcome] += 1
            print(f"[shutdown] {mode} run {i + 1}/{args.runs}: {outcome}", flush=True)
    labels = sorted({k for c in results.values() for k in c}, key=lambda k: (k != "clean", k))
    print(f"\n{args.streams} stream(s) in flight at each shutdown\n")
    print(f"| SIGTERM to | runs | {' | '.join(labels)} |")
    print("|---|---|" + "---|" * len(labels))
    for mode, c in results.items():
        who = "stub, then server" if mode == "stubs" else "server only"
        print(f"| {who} | {sum(c.values())} | {' | '.join(str(c.get(k, 0)) for k in labels)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
