"""The environment tritonserver and its Python-backend stubs start with (deploy.triton.server_env): the one
place the deploy path sets variables; what the caller's environment has reaches the stubs (issue 21: a soak
with MALLOC_ARENA_MAX=1 showed no glibc thread arena in the stub)."""

from __future__ import annotations

from pathlib import Path

from deploy.triton import REPO, TritonInstall, server_env


def _install(tmp_path: Path) -> TritonInstall:
    root = tmp_path / "site-packages" / "pytriton" / "tritonserver"
    for d in (root / "lib", root / "backends" / "python", tmp_path / "site-packages" / "nvidia_pytriton.libs"):
        d.mkdir(parents=True)
    return TritonInstall(root)


def test_server_env_passes_the_callers_allocator_settings_through(tmp_path: Path) -> None:
    base = {"PATH": "/usr/bin", "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "131072",
            "LD_LIBRARY_PATH": "/opt/x"}
    env = server_env(_install(tmp_path), base)
    assert env["MALLOC_ARENA_MAX"] == "2" and env["MALLOC_MMAP_THRESHOLD_"] == "131072"
    libs = env["LD_LIBRARY_PATH"].split(":")
    assert str(tmp_path / "site-packages" / "nvidia_pytriton.libs") in libs and libs[-1] == "/opt/x"
    assert env["HYBRID_LLM_SYS_PATH"].split(":")[0] == str(REPO) and env["PYTHONUNBUFFERED"] == "1"
    assert base == {"PATH": "/usr/bin", "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "131072",
                    "LD_LIBRARY_PATH": "/opt/x"}  # the caller's dict is not changed


def test_server_env_sets_no_allocator_variable_of_its_own(tmp_path: Path) -> None:
    """No malloc setting bounded the stub's growth (docs/soak_2h.md, issue 21's fourth round), so the deploy path
    leaves glibc's defaults alone."""
    env = server_env(_install(tmp_path), {"PATH": "/usr/bin"})
    assert not [k for k in env if k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))]
