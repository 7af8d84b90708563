"""The load-time dequantiser of packed GPTQ weights (``ops/cuda/nbits.cu``, ``cuda/quant.py``) on any machine: NVRTC
compiles ``nbits_dequant`` for sm_90 in every output dtype without spills, and its PTX rounds with ``cvt.rn`` (round
to nearest even, as the host's ``to_dtype``). Its index mapping is modelled in numpy in
tests/unit/test_gptq_cuda.py."""

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
    assert "nbits_dequant" in log, log


@pytest.mark.parametrize("dtype,cvt", [("float16", "cvt.rn.f16.f32"), ("bfloat16", "cvt.rn.bf16.f32")])
def test_nbits_dequant_rounds_to_nearest_even(dtype: str, cvt: str) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import source

    text = ptx(source(SOURCE), SOURCE, (f"-DDT={DT_CODES[dtype]}",))
    assert cvt in text and ".entry nbits_dequant(" in text
