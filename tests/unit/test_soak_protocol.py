"""The soak's transport choice (``--protocol`` / ``PROTOCOL``, ``SOAK_PROTOCOL`` for locust): which valid users,
faults and warm-up requests run. No server needed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.common import protocols
from loadtests.soak import parse_args

REPO = Path(__file__).resolve().parents[2]
# Never import locust here (not even through pytest.importorskip): it monkey-patches the process with gevent.
needs_locust = pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust is not installed")


def test_protocols_parse_and_refuse_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SOAK_PROTOCOL", raising=False)
    assert protocols() == ("grpc", "http")
    assert protocols("gRPC") == ("grpc",) and protocols("http") == ("http",) and protocols("") == ("grpc", "http")
    monkeypatch.setenv("SOAK_PROTOCOL", "grpc")
    assert protocols() == ("grpc",)
    with pytest.raises(SystemExit, match="SOAK_PROTOCOL"):
        protocols("websocket")


def test_soak_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROTOCOL", raising=False)
    assert parse_args([]).protocol == "both"
    monkeypatch.setenv("PROTOCOL", "GRPC")
    assert parse_args([]).protocol == "grpc"
    assert parse_args(["--protocol", "http"]).protocol == "http"
    with pytest.raises(SystemExit):
        parse_args(["--protocol", "udp"])


def _in_subprocess(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter: importing locust monkey-patches the process with gevent, which
    must not happen inside pytest's (other tests' threads would deadlock)."""
    full = {**os.environ, **env,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=120, check=True).stdout.strip().splitlines()[-1]


@needs_locust
def test_faults_follow_the_transport_and_the_filter() -> None:
    code = ("import json, re; from loadtests.faults import FAULT_NAMES, fault_wanted as w; "
            "print(json.dumps({f'{t}|{p}': [n for n in FAULT_NAMES if w(n, tuple(t.split('+')), re.compile(p))] "
            "for t in ('grpc', 'http', 'grpc+http') for p in ('.', 'cancel')}))")
    got = json.loads(_in_subprocess(code))
    grpc_only, http_only, both = got["grpc|."], got["http|."], got["grpc+http|."]
    assert grpc_only and all(n.endswith("/grpc") for n in grpc_only)
    assert http_only and all(n.endswith("/http") for n in http_only)
    assert sorted(grpc_only + http_only) == sorted(both)
    assert "cancel_after_final/grpc" in grpc_only and "disconnect_mid_stream/http" in http_only
    assert got["http|cancel"] == []
    assert set(got["grpc|cancel"]) == {"cancel_mid_stream/grpc", "cancel_after_final/grpc"}


@pytest.mark.parametrize(("value", "users"), [("both", {"GrpcStreamUser", "HttpStreamUser", "FaultUser"}),
                                              ("grpc", {"GrpcStreamUser", "FaultUser"}),
                                              ("http", {"HttpStreamUser", "FaultUser"})])
@needs_locust
def test_locustfile_defines_only_the_users_of_the_transport(value: str, users: set[str]) -> None:
    """locust runs every User class the locustfile defines: the others must be gone from its namespace."""
    code = ("import json, locust, loadtests.locustfile as f; "
            "print(json.dumps(sorted(k for k, v in vars(f).items() if isinstance(v, type) and "
            "issubclass(v, locust.User) and not v.__module__.startswith('locust'))))")
    assert set(json.loads(_in_subprocess(code, SOAK_PROTOCOL=value, FAULT_SHARE="0.2"))) == users
