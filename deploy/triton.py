"""Run the real ``tritonserver`` of the nvidia-pytriton 0.7.0 wheel (Triton 2.51) on this machine.

The wheel's layout is internal to that version (pin it): ``<site-packages>/pytriton/tritonserver/`` holds
``bin/tritonserver``, ``backends/python/`` (``libtriton_python.so``, ``triton_python_backend_utils.py``)
and one Python-backend stub per Python version under ``python_backend_stubs/<X.Y>/``. We lay out a
backend directory with the stub of the running interpreter, set the library path the stub and backend
need, put this interpreter's ``bin`` first on PATH (the stub runs the first ``python3`` on PATH, so the
model code runs in this venv), and start the server on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("deploy.triton")

REPO = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO / "model_repository"
BACKEND_DIR = REPO / "build" / "backends"
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "triton_python_backend_shm_region_"
STUB_SIGNAL_WAIT_S = 2.0  # stop(): how long the server's SIGTERM waits for the stubs to take theirs
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


class TritonError(RuntimeError):
    """The server cannot be found, set up, started, or it died."""


@dataclass(frozen=True, slots=True)
class TritonInstall:
    """Paths inside the pytriton wheel."""

    root: Path  # <site-packages>/pytriton/tritonserver

    @property
    def server(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    def stub(self, version: str = PYTHON_VERSION) -> Path:
        return self.root / "python_backend_stubs" / version / "triton_python_backend_stub"

    @property
    def libs(self) -> Path:
        return self.root.parents[1] / "nvidia_pytriton.libs"


def find_triton() -> TritonInstall:
    """Locate the wheel's tritonserver without importing pytriton (which pulls in a lot)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonError("nvidia-pytriton is not installed: pip install -e '.[serve]' (nvidia-pytriton==0.7.0)")
    install = TritonInstall(Path(next(iter(spec.submodule_search_locations))) / "tritonserver")
    for path in (install.server, install.python_backend / "libtriton_python.so", install.stub()):
        if not path.exists():
            raise TritonError(f"{path} is missing: this code expects the layout of nvidia-pytriton==0.7.0 "
                              f"(Python {PYTHON_VERSION})")
    return install


def prepare_backend_dir(dest: Path = BACKEND_DIR, install: TritonInstall | None = None) -> Path:
    """Lay out ``dest/python/`` (backend library, utils, the stub for this Python); returns ``dest``.

    Files are copied (not linked: the stub and backend resolve libraries relative to their own path)
    and replaced atomically when the wheel's copy differs, so concurrent callers are safe.
    """
    install = install or find_triton()
    target = dest / "python"
    target.mkdir(parents=True, exist_ok=True)
    sources = [install.python_backend / "libtriton_python.so",
               install.python_backend / "triton_python_backend_utils.py", install.stub()]
    for src in sources:
        dst = target / src.name
        if dst.exists() and dst.stat().st_size == src.stat().st_size and dst.stat().st_mtime >= src.stat().st_mtime:
            continue
        fd, tmp = tempfile.mkstemp(dir=target, prefix=f".{src.name}.")
        os.close(fd)
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    return dest


def server_env(install: TritonInstall | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its stubs: library path and this interpreter first on PATH."""
    install = install or find_triton()
    env = dict(os.environ if base is None else base)
    libdirs = [sysconfig.get_config_var("LIBDIR") or "", str(install.libs), str(install.python_backend),
               str(install.root / "lib")]
    old = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = os.pathsep.join([d for d in libdirs if d and Path(d).is_dir()] + ([old] if old else []))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    # The stub ignores PYTHONPATH; model.py puts these first on its sys.path: this project, then what this
    # interpreter searches (its venv, PYTHONPATH directories).
    entries = [str(REPO)] + [p for p in sys.path if p and Path(p).is_dir() and p != str(REPO)]
    env["HYBRID_LLM_SYS_PATH"] = os.pathsep.join(entries)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_regions() -> set[str]:
    """Python-backend shared-memory regions present now (a crashed stub leaves its region behind)."""
    return {p.name for p in SHM_DIR.glob(SHM_PREFIX + "*")} if SHM_DIR.is_dir() else set()


def child_stubs(server_pid: int) -> dict[int, str]:
    """Python-backend stub processes descended from ``server_pid`` (its children, or its grandchildren when the
    server runs under a launcher such as compute-sanitizer): pid -> their shm region name."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out: dict[int, str] = {}
    for pid in parents:
        up, hops = parents.get(pid), 0
        while up is not None and up != server_pid and up > 1 and hops < 8:
            up, hops = parents.get(up), hops + 1
        if up != server_pid:
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"triton_python_backend_stub"):
            out[pid] = next((a.decode() for a in argv if a.startswith(SHM_PREFIX.encode())), "")
    return out


def _is_stub(pid: int, region: str) -> bool:
    """``pid`` is still the stub that owns ``region`` (guards against PID reuse)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"triton_python_backend_stub" in argv and region.encode() in argv


def signal_pending(pid: int, signum: int) -> bool:
    """Whether ``signum``, sent to process ``pid``, is still pending there: no thread of it has taken it yet
    (``/proc/<pid>/status`` ShdPnd, the process-directed pending set, or SigPnd, its main thread's). False for a
    process that is gone."""
    bit = 1 << (signum - 1)
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return False
    return any(line.startswith(("ShdPnd:", "SigPnd:")) and int(line.split()[1], 16) & bit for line in lines)


def write_model_repository(dest: Path, parameters: dict[str, str], model: str = "hybrid_llm",
                           source: Path = MODEL_REPOSITORY, instance_kind: str | None = None) -> Path:
    """Copy ``source`` to ``dest`` with ``model``'s config.pbtxt parameters overridden; returns ``dest``.
    ``instance_kind`` ("cpu" | "gpu") replaces the instance group: one KIND_CPU instance, or KIND_GPU
    (Triton makes one instance per visible GPU).

    Triton reads parameters only from config.pbtxt, so overrides need a copy (the checked-in file is
    never touched). A relative engine_dir, given or inherited, is resolved against the original model
    directory so the copy still finds its bundle.
    """
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
    cfg_path = dest / model / "config.pbtxt"
    cfg = text_format.Parse(cfg_path.read_text(), model_config_pb2.ModelConfig())
    for key, value in parameters.items():
        cfg.parameters[key].string_value = str(value)
    if instance_kind is not None:
        group = model_config_pb2.ModelInstanceGroup
        kinds = {"cpu": group.KIND_CPU, "gpu": group.KIND_GPU}
        if instance_kind not in kinds:
            raise ValueError(f"instance_kind={instance_kind!r}: cpu or gpu")
        del cfg.instance_group[:]
        cfg.instance_group.add(count=1, kind=kinds[instance_kind])
    engine_dir = Path(cfg.parameters["engine_dir"].string_value or "../../engines/default").expanduser()
    if not engine_dir.is_absolute():
        cfg.parameters["engine_dir"].string_value = str((source / model / engine_dir).resolve())
    cfg_path.write_text("# Generated by deploy.triton.write_model_repository: a copy with overridden parameters.\n"
                        + text_format.MessageToString(cfg))
    return dest


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the server if the process that started it dies (no orphaned servers)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class TritonServer:
    """A tritonserver process serving ``model_repository`` on 127.0.0.1 (a context manager).

    Ports left as None are picked free. ``parameters`` override ``model``'s config.pbtxt parameters in a
    temporary copy of the repository. ``log_path=None`` writes the log to a temporary file (read it with
    :meth:`log_tail`); ``log_path="-"`` lets the server write to this process's stdout/stderr.
    ``exit_on_error=False`` keeps the server up when a model fails to load (the model is then not ready).
    """

    def __init__(self, model_repository: Path = MODEL_REPOSITORY, *, model: str = "hybrid_llm",
                 parameters: dict[str, str] | None = None, http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None, exit_timeout_s: int = 5,
                 exit_on_error: bool = True, log_path: str | Path | None = None, log_verbose: int = 0,
                 backend_dir: Path | None = None, env: dict[str, str] | None = None,
                 instance_kind: str | None = None, server_args: Sequence[str] = (),
                 launcher: Sequence[str] = ()) -> None:
        self.install = find_triton()
        self.model = model
        self.source_repository = Path(model_repository)
        self.parameters = dict(parameters or {})
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.exit_timeout_s = exit_timeout_s
        self.exit_on_error = exit_on_error
        self.log_verbose = log_verbose
        self.backend_dir = backend_dir
        self.env = dict(env or {})  # extra environment of the server (and so of its stubs)
        self.instance_kind = instance_kind  # "cpu" | "gpu": override the instance group (None: as configured)
        self.server_args = list(server_args)  # more tritonserver options, after the ones command() sets
        self.launcher = list(launcher)  # a command the server runs under, e.g. compute-sanitizer and its options
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._log_arg = log_path
        self.log_path: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.stubs: dict[int, str] = {}  # stub pid -> shm region, as last seen
        self.leaked_shm: set[str] = set()

    # ---- addresses ------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # ---- lifecycle ------------------------------------------------------------------------------
    def command(self, repository: Path, backend_dir: Path) -> list[str]:
        return [*self.launcher, str(self.install.server), f"--model-repository={repository}",
                f"--backend-directory={backend_dir}",
                # explicit + load every model at start: the same as "none" for a client, and it lets a model
                # whose GPU context is lost unload itself, so that readiness probes see it (model.py _on_fatal)
                "--model-control-mode=explicit", "--load-model=*",
                "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
                "--metrics-address=127.0.0.1", f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                f"--metrics-port={self.metrics_port}", "--allow-gpu-metrics=false",
                f"--exit-timeout-secs={self.exit_timeout_s}", f"--exit-on-error={str(self.exit_on_error).lower()}",
                f"--log-verbose={self.log_verbose}", *self.server_args]

    def start(self) -> TritonServer:
        if self.proc is not None:
            raise TritonError("server already started")
        self._tmp = tempfile.TemporaryDirectory(prefix="triton-")
        tmp = Path(self._tmp.name)
        repository = self.source_repository
        if self.parameters or self.instance_kind:
            repository = write_model_repository(tmp / "model_repository", self.parameters, self.model, repository,
                                                self.instance_kind)
        backend_dir = prepare_backend_dir(self.backend_dir or BACKEND_DIR, self.install)
        if self._log_arg == "-":
            out = None
        else:
            self.log_path = Path(self._log_arg) if self._log_arg else tmp / "tritonserver.log"
            out = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child, closed below
        cmd = self.command(repository, backend_dir)
        log.info("starting %s", " ".join(cmd))
        try:
            self.proc = subprocess.Popen(cmd, env={**server_env(self.install), **self.env}, stdin=subprocess.DEVNULL,
                                         stdout=out,
                                         stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        finally:
            if out is not None:
                out.close()
        return self

    def _get(self, path: str, timeout: float = 1.0) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (OSError, urllib.error.URLError):
            return 0

    def is_live(self) -> bool:
        return self._get("/v2/health/live") == 200

    def is_ready(self) -> bool:
        return self._get("/v2/health/ready") == 200

    def model_ready(self, model: str | None = None) -> bool:
        return self._get(f"/v2/models/{model or self.model}/ready") == 200

    def wait(self, condition: str = "ready", timeout: float = 120.0) -> TritonServer:
        """Wait until the server is ``live`` or ``ready`` (all models); raise with the log tail otherwise."""
        check = self.is_ready if condition == "ready" else self.is_live
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise TritonError(f"tritonserver exited with code {code} before it was {condition}\n{self.log_tail()}")
            if check():
                self._see_stubs()
                return self
            time.sleep(0.1)
        raise TritonError(f"tritonserver was not {condition} within {timeout:.0f} s\n{self.log_tail()}")

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_text()
        return "\n".join(text.splitlines()[-lines:]) if text else "(no server log captured)"

    def _see_stubs(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stubs.update(child_stubs(self.proc.pid))

    def stop(self, timeout: float | None = None, signal_stubs: bool = True) -> int | None:
        """SIGTERM by PID to the server's Python-backend stubs, then to the server; SIGKILL after ``timeout``
        (default exit timeout + 10 s); returns the exit code.

        The stubs get the signal first so that the model cancels its in-flight requests without asking Triton
        whether it is shutting down (a call that can crash the stub once it is: deploy/README.md, "Shutdown with
        requests in flight"); the stubs keep running until Triton finalizes the model. ``signal_stubs=False``
        signals the server alone, as an orchestrator that signals only the container's first process does
        (``loadtests.shutdown_inflight`` measures both).

        Then checks the server's stubs: a stub outlives its server only when the server crashed or was
        killed; such orphans are killed by PID, and their shared-memory regions are reported in
        ``leaked_shm`` (and removed, since nothing else can own them).
        """
        if self.proc is None:
            return None
        timeout = self.exit_timeout_s + 10.0 if timeout is None else timeout
        if self.proc.poll() is None:
            self._see_stubs()
            signalled = []
            for pid, region in self.stubs.items() if signal_stubs else ():
                if _is_stub(pid, region):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
                        signalled.append(pid)
            # the server only once every stub has taken its signal (bounded): on a busy host a stub may not run
            # before the server stops being ready, and the model would then drain through the readiness call
            deadline = time.monotonic() + STUB_SIGNAL_WAIT_S
            while any(signal_pending(p, signal.SIGTERM) for p in signalled) and time.monotonic() < deadline:
                time.sleep(0.005)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver (pid %d) did not stop within %.0f s: SIGKILL", self.proc.pid, timeout)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        deadline = time.monotonic() + 5.0
        for pid, region in self.stubs.items():
            while _is_stub(pid, region) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _is_stub(pid, region):
                log.warning("stub pid %d outlived tritonserver: SIGKILL", pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.leaked_shm = {r for r in self.stubs.values() if r and (SHM_DIR / r).exists()}
        if self.leaked_shm:
            log.warning("shared-memory regions left behind (removing them): %s", sorted(self.leaked_shm))
            for region in self.leaked_shm:
                with contextlib.suppress(OSError):
                    (SHM_DIR / region).unlink()
        self.stubs.clear()
        return self.proc.returncode

    def cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.cleanup()
