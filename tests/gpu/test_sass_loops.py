"""benchmarks/sass_loops.py (the loops of a kernel's SASS, counted on a CPU): the parser on a hand-written listing,
and the real tool on the decode MoE kernels, whose k-tile loop holds the MMAs."""

from __future__ import annotations

import pytest
from test_cuda_compile import nvdisasm_path, nvrtc_or_skip

from benchmarks.sass_loops import disassemble, kernels, loops, opcode, report

LISTING = """
        .text.toy:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IMAD R2, R2, R3, RZ ;
.L_x_2:
        /*0020*/              @!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   ISETP.GE.AND P0, PT, R2, R5, PT ;
        /*0040*/               @P0 BRA `(.L_x_2) ;
        /*0050*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0060*/                   ISETP.NE.AND P1, PT, R2, RZ, PT ;
        /*0070*/               @P1 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
"""


def test_loops_are_the_backward_branches_with_their_bodies() -> None:
    assert opcode("@!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4") == "HMMA" and opcode("EXIT") == "EXIT"
    ks = kernels(LISTING)
    assert list(ks) == ["toy"]
    found = {lp.label: lp for lp in loops(ks["toy"])}
    assert set(found) == {"L_x_1", "L_x_2"}  # the forward BRA to L_x_3 is no loop
    inner, outer = found["L_x_2"], found["L_x_1"]
    assert sum(inner.mix.values()) == 3 and inner.mix["HMMA"] == 1 and inner.mix["BRA"] == 1
    assert sum(outer.mix.values()) == 7 and outer.mix["BRA"] == 3 and outer.mix["IMAD"] == 1  # labels not counted
    lines = report(LISTING, ["toy"])
    assert lines[0] == "toy: 9 instructions" and len(lines) == 3


def test_the_decode_moe_k_tile_loop_holds_its_mmas() -> None:
    nvrtc_or_skip()
    if nvdisasm_path() is None:
        pytest.skip("no nvdisasm (the nvidia-cuda-nvdisasm dev dependency)")
    ks = kernels(disassemble("moe_decode.cu", ["DT=2"], "sm_90"))
    assert {"moe_dec_gate_up", "moe_dec_down"} <= set(ks)
    for name in ("moe_dec_gate_up", "moe_dec_down"):
        with_mma = [lp for lp in loops(ks[name]) if lp.mix["HMMA"]]
        assert with_mma, name
        # the innermost loop with MMAs: moe_decode.cu's k-tile loop (MD_GMAX = 4 groups x m-tiles, unrolled)
        inner = min(with_mma, key=lambda lp: lp.size)
        assert inner.mix["HMMA"] % 4 == 0 and inner.mix["LDGSTS"] > 0, (name, inner.mix)
