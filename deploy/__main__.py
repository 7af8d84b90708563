"""``python -m deploy serve``: run tritonserver with the project's model repository (what ``make serve`` runs).

Environment (the one place this package reads it):
    HTTP_PORT / GRPC_PORT / METRICS_PORT   ports on 127.0.0.1 (default 8000 / 8001 / 8002)
    FRONTEND_PORT                          the OpenAI-compatible frontend (python -m frontend) on
                                           127.0.0.1 (default 9000; "off" = Triton only)
    ENGINE=DIR                             serve this bundle (default engines/default, built if missing)
    MAX_BATCH_SIZE, MULTI_BLOCK, PROFILE_PINNING, DEVICE, GPU_MEMORY_FRACTION
                                           override the model parameters max_batch_size,
                                           multi_block_mode, profile_pinning, device and
                                           gpu_memory_fraction of config.pbtxt
    INSTANCE_KIND=cpu|gpu                  the instance group: one KIND_CPU instance, or KIND_GPU (one
                                           instance per visible GPU, each on its own GPU)
    READY_TIMEOUT                          seconds to wait for the model to load (default 300)
The server (and the frontend beside it) run in the foreground with their logs on this terminal; Ctrl-C
(or SIGTERM) stops both cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from frontend.process import FrontendError, FrontendProcess

from .triton import MODEL_REPOSITORY, REPO, SHM_DIR, TritonError, TritonServer, shm_regions

DEFAULT_ENGINE = REPO / "engines" / "default"
DEFAULT_CHECKPOINT = REPO / "build" / "default_checkpoint"
# environment variable -> model parameter in config.pbtxt
PARAMETER_ENV = {"MAX_BATCH_SIZE": "max_batch_size", "MULTI_BLOCK": "multi_block_mode",
                 "PROFILE_PINNING": "profile_pinning", "DEVICE": "device", "GPU_MEMORY_FRACTION": "gpu_memory_fraction"}


def _port(env: dict[str, str], name: str, default: int) -> int:
    value = env.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise SystemExit(f"error: {name}={value!r} is not a port number")
    return int(value)


def build_default_engine(engine: Path = DEFAULT_ENGINE, checkpoint: Path = DEFAULT_CHECKPOINT) -> None:
    """Write the embedded default checkpoint and build it into ``engine`` (the builder's defaults)."""
    print(f"[deploy] {engine / 'manifest.json'} is missing: building the default engine", flush=True)
    for cmd in (["default-checkpoint", str(checkpoint)],
                ["build", "--checkpoint", str(checkpoint), "--output", str(engine)]):
        subprocess.run([sys.executable, "-m", "builder", *cmd], check=True, cwd=REPO)


def serve(env: dict[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    params = {key: env[var].strip() for var, key in PARAMETER_ENV.items() if env.get(var, "").strip()}
    if env.get("ENGINE", "").strip():
        engine = Path(env["ENGINE"].strip()).expanduser().resolve()
        if not (engine / "manifest.json").is_file():
            print(f"error: ENGINE={engine} holds no manifest.json; build a bundle there with "
                  f"`python -m builder build --checkpoint CKPT --output {engine}`", file=sys.stderr)
            return 2
        params["engine_dir"] = str(engine)
    elif not (DEFAULT_ENGINE / "manifest.json").is_file():
        build_default_engine()
    if shm_regions():
        print(f"[deploy] note: {len(shm_regions())} Python-backend shared-memory region(s) already in {SHM_DIR} "
              "(other running servers, or stubs that crashed earlier)", flush=True)
    kind = env.get("INSTANCE_KIND", "").strip().lower() or None
    if kind not in (None, "cpu", "gpu"):
        print(f"error: INSTANCE_KIND={kind!r}: cpu or gpu", file=sys.stderr)
        return 2
    server = TritonServer(MODEL_REPOSITORY, parameters=params, http_port=_port(env, "HTTP_PORT", 8000),
                          grpc_port=_port(env, "GRPC_PORT", 8001), metrics_port=_port(env, "METRICS_PORT", 8002),
                          log_path="-", instance_kind=kind)
    frontend_off = env.get("FRONTEND_PORT", "").strip().lower() == "off"
    frontend = None if frontend_off else FrontendProcess(server.grpc_url, port=_port(env, "FRONTEND_PORT", 9000),
                                                         log_path="-")

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # also when started in the background, where SIGINT is ignored
    try:
        server.start()
        print(f"[deploy] tritonserver pid {server.pid} starting (overrides: {params or 'none'})", flush=True)
        server.wait("ready", timeout=float(env.get("READY_TIMEOUT", "300")))
        print(f"[deploy] ready: gRPC {server.grpc_url}  HTTP {server.http_url}  metrics {server.metrics_url}\n"
              f"[deploy] try: python -m client generate \"Hello\" --url {server.grpc_url}   (Ctrl-C stops)",
              flush=True)
        if frontend is not None:
            frontend.start().wait(timeout=60)
            print(f"[deploy] OpenAI API: {frontend.url}/v1 (frontend pid {frontend.pid}); try: curl "
                  f"{frontend.url}/v1/completions -d '{{\"model\": \"{server.model}\", \"prompt\": \"Hello\"}}'",
                  flush=True)
        return _watch(server, frontend)
    except (TritonError, FrontendError) as e:
        print(f"[deploy] error: {str(e).splitlines()[0]} (the log above says why)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[deploy] stopping", flush=True)
        return 0
    finally:
        if frontend is not None:
            frontend.stop()
        code = server.stop()
        if server.leaked_shm:
            print(f"[deploy] warning: shared-memory regions left in /dev/shm: {sorted(server.leaked_shm)}",
                  file=sys.stderr)
        server.cleanup()
        if code not in (None, 0):
            print(f"[deploy] tritonserver exited with code {code}", file=sys.stderr)


def _watch(server: TritonServer, frontend: FrontendProcess | None) -> int:
    """Run until either process exits: the server's exit code, or 1 when the frontend died under it."""
    assert server.proc is not None
    while True:
        code = server.proc.poll()
        if code is not None:
            return code
        if frontend is not None and frontend.proc is not None and frontend.proc.poll() is not None:
            print(f"[deploy] error: the frontend exited with code {frontend.proc.returncode}", file=sys.stderr)
            return 1
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="run tritonserver in the foreground (Ctrl-C stops it)")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        return serve()
    return 2


if __name__ == "__main__":
    sys.exit(main())
