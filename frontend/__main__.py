"""``python -m frontend``: serve the OpenAI API for the models of a running tritonserver.

    python -m frontend [--host 127.0.0.1] [--port 9000] [--triton-url 127.0.0.1:8001]
                       [--model-repository DIR] [--bundle MODEL=DIR ...] [--cache-ttl 10]
                       [--request-timeout S] [--log-level info]

Environment (the one place the frontend reads it): FRONTEND_HOST, FRONTEND_PORT, TRITON_GRPC_URL give the
defaults of --host, --port and --triton-url.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bundle(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--bundle takes MODEL=DIR, got {text!r}")
    return name, Path(path).expanduser().resolve()


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number")
    return int(text)


def parser() -> argparse.ArgumentParser:
    env = os.environ
    ap = argparse.ArgumentParser(prog="python -m frontend", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default=env.get("FRONTEND_HOST") or "127.0.0.1",
                    help="address to listen on (default 127.0.0.1; FRONTEND_HOST)")
    ap.add_argument("--port", type=_port, default=_port(env.get("FRONTEND_PORT") or "9000"),
                    help="port (default 9000; FRONTEND_PORT)")
    ap.add_argument("--triton-url", default=env.get("TRITON_GRPC_URL") or "127.0.0.1:8001",
                    help="tritonserver's gRPC HOST:PORT (default 127.0.0.1:8001; TRITON_GRPC_URL)")
    ap.add_argument("--model-repository", type=Path, default=REPO / "model_repository",
                    help="where a relative engine_dir of a model's config.pbtxt is resolved (default: this "
                         "project's model_repository)")
    ap.add_argument("--bundle", type=_bundle, action="append", default=[], metavar="MODEL=DIR",
                    help="read MODEL's tokenizer files and chat template from DIR instead of its engine_dir "
                         "(a server on another machine); repeatable")
    ap.add_argument("--cache-ttl", type=float, default=10.0,
                    help="seconds a model's config and chat template are cached (default 10)")
    ap.add_argument("--request-timeout", type=float, default=None,
                    help="seconds a generation may take before it is cancelled (default: no limit)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import uvicorn

    from .app import Settings, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = Settings(triton_url=args.triton_url, model_repository=args.model_repository.resolve(),
                        bundles=dict(args.bundle), cache_ttl_s=args.cache_ttl, request_timeout_s=args.request_timeout)
    # Graceful shutdown waits for open streams at most 5 s; they are cancelled (and so are their Triton
    # requests) after that.
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
