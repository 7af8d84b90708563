"""The load-time dequantiser of packed GPTQ weights (``ops/cuda/nbits.cu``, ``cuda/quant.py``) on any machine: NVRTC
compiles ``nbits_dequant`` and ``nbits_dequant8`` for sm_90 in every output dtype without spills, their PTX rounds
with ``cvt.rn`` (round to nearest even, as the host's ``to_dtype``), and the host picks the eight-codes-a-thread
kernel only where its loads and stores are aligned. The per-code kernel's index mapping is modelled in numpy in
tests/unit/test_gptq_cuda.py; tests/gpu/test_nbits_gpu.py compares both kernels on the device."""

from __future__ import annotations

import pytest
from test_cuda_compile import check_log, nvrtc_or_skip, ptx

from hybrid_runtime.cuda.quant import DT_CODES, SOURCE


@pytest.mark.parametrize("dtype", sorted(DT_CODES))
def test_nbits_dequant_compiles_for_sm90_without_spills(dtype: str) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    log = compile_log(source(SOURCE), SOURCE, (f"-DDT={DT_CODES[dtype]}",), "sm_90")
    check_log(log)
    assert "nbits_dequant" in log and "nbits_dequant8" in log, log


@pytest.mark.parametrize("dtype,cvt", [("float16", "cvt.rn.f16.f32"), ("bfloat16", "cvt.rn.bf16.f32")])
def test_nbits_dequant_rounds_to_nearest_even(dtype: str, cvt: str) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import source

    text = ptx(source(SOURCE), SOURCE, (f"-DDT={DT_CODES[dtype]}",))
    assert cvt in text and ".entry nbits_dequant(" in text and ".entry nbits_dequant8(" in text


def test_the_vectorized_dequantiser_is_picked_only_where_aligned() -> None:
    from types import SimpleNamespace

    from hybrid_runtime.cuda.quant import NBitsDequant

    def w(**kw):
        base = {"perm": None, "K": 2048, "block_size": 128}
        return SimpleNamespace(**{**base, **kw})

    pick = NBitsDequant.vectorized
    assert pick(None, w(), 256, 2048, 1024 * 2048)  # type: ignore[arg-type]
    assert not pick(None, w(perm=object()), 256, 2048, 0)  # act order: the per-code kernel scatters columns
    assert not pick(None, w(K=2044), 256, 2044, 0) and not pick(None, w(block_size=4), 256, 2048, 0)
    assert not pick(None, w(), 256 + 8, 2048, 0) and not pick(None, w(), 256, 2052, 0)  # unaligned out / ldo
    assert not pick(None, w(), 256, 2048, 4)  # an expert stride that breaks the 16-byte stores
