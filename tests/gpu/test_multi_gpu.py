"""Two GPUs in one process: one dispatcher per device, decode batches served on both, and a device
whose opt-in attribute was never set is caught by the guard (and would be refused by the driver)."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_runtime.ops.dispatcher import MULTI, SINGLE, DecodeAttentionError, DecodeBatch, make_plan, validate

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def devs():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (run on the nvidia-h200-x2 kind)")
    from hybrid_runtime.cuda.driver import CudaDevice

    return CudaDevice(0), CudaDevice(1)


def case(torch, device: int, lens, hq, hkv, hd, ps, seed):
    rng = np.random.default_rng(seed)
    need = [-(-n // ps) for n in lens]
    pages = sum(need) + 1
    perm = rng.permutation(pages)
    starts = np.cumsum([0, *need])
    tables = [perm[starts[i]:starts[i + 1]].astype(np.int64) for i in range(len(lens))]
    g = torch.Generator(device=f"cuda:{device}").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device=f"cuda:{device}", generator=g).to(torch.bfloat16)  # noqa: E731
    return mk(len(lens), hq, hd), mk(pages, ps, hkv, hd), mk(pages, ps, hkv, hd), tables


def reference(torch, q, k, v, tables, lens):
    B, hq, hd = q.shape
    hkv = k.shape[2]
    out = []
    for b in range(B):
        idx = torch.as_tensor(tables[b], device=q.device)
        kk = k[idx].reshape(-1, hkv, hd)[:lens[b]].double().repeat_interleave(hq // hkv, 1)
        vv = v[idx].reshape(-1, hkv, hd)[:lens[b]].double().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), kk) / hd ** 0.5
        out.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv))
    return torch.stack(out)


def test_two_devices_one_process(devs) -> None:
    import torch

    from hybrid_runtime.cuda.attention import CudaDecodeAttention, choose_variant
    from hybrid_runtime.cuda.driver import DeviceArray

    d0, d1 = devs
    be0 = CudaDecodeAttention(d0, optin=True)
    be1 = CudaDecodeAttention(d1, optin=False)  # this device's opt-in attribute is never set
    assert be0.limits.optin_set == frozenset({SINGLE, MULTI}) and be1.limits.optin_set == frozenset()
    disp0, disp1 = be0.dispatcher("auto"), be1.dispatcher("auto")

    # Serve interleaved decode batches on both devices from this one thread.
    for step in range(4):
        for dev_i, disp in ((0, disp0), (1, disp1)):
            lens = [4000 + 500 * step, 33, 1]
            q, k, v, tables = case(torch, dev_i, lens, 16, 2, 256, 16, seed=10 * step + dev_i)
            out = disp.run(*(DeviceArray.from_torch(t) for t in (q, k, v)), tables, lens)
            got = torch.as_tensor(out, device=f"cuda:{dev_i}").double()
            ref = reference(torch, q, k, v, tables, lens)
            assert float((got - ref).norm() / ref.norm()) < 2e-2, (step, dev_i)
    assert sum(disp0.plans.values()) == 4 and sum(disp1.plans.values()) == 4

    # A batch whose every plan needs > 48 KB of shared memory: fine on device 0, caught on device 1.
    batch = DecodeBatch((64,), (np.zeros(4, np.int64),), num_q_heads=32, num_kv_heads=1, head_dim=256,
                        page_size=16, dtype="bfloat16", num_pool_pages=4)
    assert validate(make_plan(batch, 1, be0.limits), batch, be0.limits, be0.workspace_bytes) == []
    assert "smem_attr_not_set" in validate(make_plan(batch, 1, be1.limits), batch, be1.limits, be1.workspace_bytes)
    with pytest.raises(DecodeAttentionError) as e:
        disp1.select(batch)
    assert "smem_attr_not_set" in e.value.reasons
    q, k, v, tables = case(torch, 0, [64], 32, 1, 256, 16, seed=5)
    out = disp0.run(*(DeviceArray.from_torch(t) for t in (q, k, v)), tables, [64])
    ref = reference(torch, q, k, v, tables, [64])
    assert float((torch.as_tensor(out, device="cuda:0").double() - ref).norm() / ref.norm()) < 2e-2

    # The per-device attribute itself: set on device 0, default on device 1 (same CUkernel).
    variant = choose_variant("bfloat16", 256, 32)
    k0 = be0.kernels_for(variant)[SINGLE]
    k1 = be1.kernels_for(variant)[SINGLE]
    assert k0 is k1  # one library, loaded into both contexts
    attr = "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES"
    assert k0.attribute(d0, attr) == k0.optin_bytes(d0) > 48 * 1024
    assert k1.optin_bytes(d1) is None and k1.attribute(d1, attr) <= 48 * 1024
    p = make_plan(batch, 1, be0.limits)
    assert k1.problems(d1, p.grid, (p.block_threads, 1, 1), p.smem_bytes) == ["smem_attr_not_set"]
    assert k0.problems(d0, p.grid, (p.block_threads, 1, 1), p.smem_bytes) == []
    d0.synchronize()
    d1.synchronize()
