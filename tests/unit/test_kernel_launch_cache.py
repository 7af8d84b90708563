"""The guarded launch's fast path (``hybrid_runtime/cuda/kernels.py`` ``Kernel.launch``), on any machine: a geometry
the guard accepted keeps its verdict and its ``CUlaunchConfig``, so a repeated launch is validated once and reuses
the configuration; a rejected one is refused every time and never reaches the driver; the verdict is redone after
the kernel's shared-memory opt-in changes; the cache is bounded; ``pack_args`` packs the same bytes as before.

The CUDA driver is a recording stand-in here (the boundary that cannot run without a GPU): ``cuLaunchKernelEx``
records the configuration object and the kernel parameters it was given. The real launches run in every GPU
test (``pytest -m gpu``), all through this path."""

from __future__ import annotations

import ctypes
import struct
import types
from typing import Any

import numpy as np
import pytest

from hybrid_runtime.cuda import kernels
from hybrid_runtime.ops.dispatcher import DeviceLimits

LIMITS = DeviceLimits("sim-h200", sm_count=132, max_shared_mem_per_block=48 * 1024,
                      max_shared_mem_optin=227 * 1024)


class FakeDriver:
    """What Kernel.launch / set_max_dynamic_smem touch of cuda.bindings.driver; launches are recorded."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, Any, list[int]]] = []
        self.CUfunction_attribute = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES=1,
                                                          CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=2)
        self.CUlaunchAttributeID = types.SimpleNamespace(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION=6)

    class CUlaunchConfig:
        pass

    class CUlaunchAttribute:
        def __init__(self) -> None:
            self.value = types.SimpleNamespace()

    def cuKernelGetFunction(self, handle: Any) -> tuple[int, str]:
        return 0, f"function of {handle}"

    def cuKernelGetAttribute(self, attr: int, handle: Any, dev: Any) -> tuple[int, int]:
        return 0, 0  # no static shared memory

    def cuKernelSetAttribute(self, *a: Any) -> tuple[int]:
        return (0,)

    def cuFuncSetAttribute(self, *a: Any) -> tuple[int]:
        return (0,)

    def cuLaunchKernelEx(self, cfg: Any, f: Any, ptrs: np.ndarray, extra: int) -> tuple[int]:
        params = [ctypes.c_uint64.from_address(int(p)).value for p in ptrs if int(p)]  # (no args: one null)
        self.launches.append((cfg, f, params))
        return (0,)


class FakeDevice:
    def __init__(self, stream: int = 7, cc: tuple[int, int] = (9, 0)) -> None:
        self.ordinal, self.stream, self.limits, self.compute_capability, self.dev = 0, stream, LIMITS, cc, 0

    def activate(self) -> None:
        pass


@pytest.fixture()
def drv(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    d = FakeDriver()
    monkeypatch.setattr(kernels, "bindings", lambda: d)
    return d


def test_a_repeated_launch_is_validated_once_and_reuses_its_configuration(drv: FakeDriver,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    checks: list[tuple] = []
    real = kernels.launch_problems

    def counting(*a: Any) -> list[str]:
        checks.append(a[1:3])
        return real(*a)

    monkeypatch.setattr(kernels, "launch_problems", counting)
    k = kernels.Kernel(None, "k", "h")  # type: ignore[arg-type]
    dev = FakeDevice()
    for i in range(5):
        k.launch(dev, (4, 1, 1), (128, 1, 1), 1024, [("ptr", 100 + i), ("i32", i)], pdl=True)  # type: ignore[arg-type]
    assert len(checks) == 1
    cfgs = {id(c) for c, _, _ in drv.launches}
    assert len(cfgs) == 1  # one configuration object for the five launches
    cfg = drv.launches[0][0]
    assert (cfg.gridDimX, cfg.blockDimX, cfg.sharedMemBytes, cfg.hStream, cfg.numAttrs) == (4, 128, 1024, 7, 1)
    assert cfg.attrs[0].value.programmaticStreamSerializationAllowed == 1
    assert [p[0] for _, _, p in drv.launches] == [100, 101, 102, 103, 104]  # each launch's own arguments
    assert [p[1] & 0xFFFFFFFF for _, _, p in drv.launches] == [0, 1, 2, 3, 4]
    # another geometry, stream or pdl is another configuration (and another check)
    k.launch(dev, (8, 1, 1), (128, 1, 1), 1024, [("ptr", 1)])  # type: ignore[arg-type]
    k.launch(FakeDevice(stream=9), (4, 1, 1), (128, 1, 1), 1024, [("ptr", 1)], pdl=True)  # type: ignore[arg-type]
    k.launch(dev, (4, 1, 1), (128, 1, 1), 1024, [("ptr", 1)], pdl=False)  # type: ignore[arg-type]
    assert len(checks) == 4 and len({id(c) for c, _, _ in drv.launches}) == 4
    assert drv.launches[-1][0].numAttrs == 0 and drv.launches[-2][0].hStream == 9
    # pdl on a device before sm_90: asked, not set
    k.launch(FakeDevice(stream=11, cc=(8, 0)), (4, 1, 1), (128, 1, 1), 0, [], pdl=True)  # type: ignore[arg-type]
    assert drv.launches[-1][0].numAttrs == 0


def test_a_rejected_launch_is_refused_every_time_and_never_reaches_the_driver(drv: FakeDriver) -> None:
    k = kernels.Kernel(None, "k", "h")  # type: ignore[arg-type]
    dev = FakeDevice()
    for _ in range(3):
        with pytest.raises(kernels.LaunchRejected, match="threads"):
            k.launch(dev, (4, 1, 1), (2048, 1, 1), 0, [])  # type: ignore[arg-type]
        with pytest.raises(kernels.LaunchRejected, match="grid_zero"):
            k.launch(dev, (0, 1, 1), (128, 1, 1), 0, [])  # type: ignore[arg-type]
    assert drv.launches == [] and k._configs == {}


def test_the_verdict_is_redone_when_the_shared_memory_opt_in_changes(drv: FakeDriver) -> None:
    k = kernels.Kernel(None, "k", "h")  # type: ignore[arg-type]
    dev = FakeDevice()
    big = 100 * 1024  # above the 48 KB default: needs the opt-in
    with pytest.raises(kernels.LaunchRejected, match="smem_attr_not_set"):
        k.launch(dev, (1, 1, 1), (128, 1, 1), big, [])  # type: ignore[arg-type]
    k.set_max_dynamic_smem(dev, big)  # type: ignore[arg-type]
    k.launch(dev, (1, 1, 1), (128, 1, 1), big, [])  # type: ignore[arg-type]
    k.launch(dev, (1, 1, 1), (128, 1, 1), big, [])  # type: ignore[arg-type]
    assert len(drv.launches) == 2
    k.set_max_dynamic_smem(dev, 64 * 1024)  # lowered: the cached verdict must not stand
    with pytest.raises(kernels.LaunchRejected, match="smem_attr_not_set"):
        k.launch(dev, (1, 1, 1), (128, 1, 1), big, [])  # type: ignore[arg-type]
    assert len(drv.launches) == 2


def test_other_limits_on_the_device_are_checked_again(drv: FakeDriver) -> None:
    from dataclasses import replace

    k = kernels.Kernel(None, "k", "h")  # type: ignore[arg-type]
    dev = FakeDevice()
    k.launch(dev, (1, 1, 1), (512, 1, 1), 0, [])  # type: ignore[arg-type]
    dev.limits = replace(LIMITS, max_threads_per_block=256)  # a device whose limits are other
    with pytest.raises(kernels.LaunchRejected, match="threads"):
        k.launch(dev, (1, 1, 1), (512, 1, 1), 0, [])  # type: ignore[arg-type]
    assert len(drv.launches) == 1


def test_the_configuration_cache_is_bounded(drv: FakeDriver) -> None:
    k = kernels.Kernel(None, "k", "h")  # type: ignore[arg-type]
    dev = FakeDevice()
    for n in range(1, 3 * kernels.CONFIG_CACHE_MAX):  # prefill grids follow the token count
        k.launch(dev, (n, 1, 1), (128, 1, 1), 0, [("i32", n)])  # type: ignore[arg-type]
        assert len(k._configs) <= kernels.CONFIG_CACHE_MAX
    assert [c.gridDimX for c, _, _ in drv.launches] == list(range(1, 3 * kernels.CONFIG_CACHE_MAX))


def test_pack_args_packs_each_kind_in_its_slot() -> None:
    args = [("ptr", 0xDEADBEEF12), ("i32", -5), ("u32", 7), ("i64", -(2**40)), ("f32", 1.5), ("u64", 2**63 + 1),
            ("ptr", 0)]
    for _ in range(2):  # the format is made once per signature, then reused
        ptrs, vals = kernels.pack_args(args)
        assert ptrs.dtype == np.uint64 and len(ptrs) == len(args)
        assert [int(p) for p in ptrs] == [vals.ctypes.data + 8 * i for i in range(len(args))]
        raw = vals.tobytes()
        assert struct.unpack_from("<Q", raw, 0)[0] == 0xDEADBEEF12
        assert struct.unpack_from("<i", raw, 8)[0] == -5 and struct.unpack_from("<I", raw, 16)[0] == 7
        assert struct.unpack_from("<q", raw, 24)[0] == -(2**40) and struct.unpack_from("<f", raw, 32)[0] == 1.5
        assert struct.unpack_from("<Q", raw, 40)[0] == 2**63 + 1 and struct.unpack_from("<Q", raw, 48)[0] == 0
    ptrs, vals = kernels.pack_args([])
    assert len(ptrs) == 1 and len(vals) == 1
    with pytest.raises(KeyError):
        kernels.pack_args([("f64", 1.0)])
