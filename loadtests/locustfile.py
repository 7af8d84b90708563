"""Locust users for the hybrid_llm Triton model: gRPC streaming, HTTP generate_stream, and faults.

Run through the soak runner (``make soak`` / ``python -m loadtests.soak``), or by hand against a running
server (``make serve``)::

    .venv/bin/locust -f loadtests/locustfile.py --host http://127.0.0.1:8000 [--headless -u 16 -r 4 -t 5m]

Environment: ``FAULT_SHARE`` (share of fault users, default 0.2; 0 = none), ``SOAK_GRPC_URL`` (default: the
HTTP port + 1), ``SOAK_ENGINE_DIR`` (bundle for the tokenizer and limits; default: the ``engine_dir`` the
server reports), ``SOAK_SUMMARY`` (where the counters are written as JSON at exit; default
reports/locust_summary.json), ``SOAK_SEED``, ``SOAK_REQUEST_TIMEOUT`` (seconds, default 180), ``SOAK_PROTOCOL``
(both, the default | grpc | http: only that transport's valid users and faults).
"""

# tritonclient.grpc under gevent: grpc must be switched to gevent before any channel exists.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `locust -f` puts only loadtests/ on the path

from locust import events  # noqa: E402

from loadtests.common import protocols  # noqa: E402
from loadtests.faults import FaultUser  # noqa: E402
from loadtests.users import STATS, GrpcStreamUser, HttpStreamUser  # noqa: E402

log = logging.getLogger("loadtests")


def _fault_share() -> float:
    share = float(os.environ.get("FAULT_SHARE", "0.2") or 0)
    if not 0.0 <= share < 1.0:
        raise SystemExit(f"FAULT_SHARE={share}: must be in [0, 1)")
    return share


FAULT_SHARE = _fault_share()
GrpcStreamUser.weight = HttpStreamUser.weight = max(1, round((1.0 - FAULT_SHARE) * 50))
FaultUser.weight = round(FAULT_SHARE * 100)
if not FaultUser.weight:
    del FaultUser  # locust runs every User class it finds in this module
PROTOCOLS = protocols()
if "grpc" not in PROTOCOLS:
    del GrpcStreamUser
if "http" not in PROTOCOLS:
    del HttpStreamUser


def _summary_path() -> Path:
    return Path(os.environ.get("SOAK_SUMMARY") or Path(__file__).resolve().parents[1] / "reports"
                / "locust_summary.json")


def write_summary() -> Path:
    path = _summary_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = STATS.to_json()
    data["fault_share"] = FAULT_SHARE
    data["protocols"] = list(PROTOCOLS)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


@events.test_start.add_listener
def _on_test_start(environment, **_kw) -> None:
    STATS.__init__()  # a fresh count per run (the web UI can start several in one process)


@events.test_stop.add_listener
def _on_test_stop(environment, **_kw) -> None:
    write_summary()


@events.quitting.add_listener
def _on_quitting(environment, **_kw) -> None:
    path = write_summary()
    log.info("soak counters written to %s", path)
