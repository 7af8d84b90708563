"""benchmarks.gpu_serve.memcheck_errors: the compute-sanitizer memcheck log parser behind the through-server
sanitizer verdict (the verdict needs the injected fault's record AND no other record; the run itself needs a GPU)."""

from __future__ import annotations

from benchmarks.gpu_serve import memcheck_errors

CLEAN = """========= COMPUTE-SANITIZER
========= ERROR SUMMARY: 0 errors
"""

PROBED = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at fill_f32+0x90
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x100 is out of bounds
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2f1b3] in libcuda.so.1
=========
========= Invalid __global__ write of size 4 bytes
=========     at fill_f32+0x90
=========     by thread (1,0,0) in block (0,0,0)
=========     Address 0x104 is out of bounds
=========
========= ERROR SUMMARY: 2 errors
"""

BUG = """========= Invalid __global__ read of size 16 bytes
=========     at 0x1a0 in dense_decode
=========     by thread (3,0,0) in block (1,0,0)
=========
========= Program hit CUDA_ERROR_LAUNCH_FAILED (error 719) on CUDA API call to cuStreamSynchronize.
=========
========= ERROR SUMMARY: 2 errors
"""


def test_a_clean_log_has_no_records() -> None:
    assert memcheck_errors(CLEAN) == []


def test_the_injected_fault_is_found_per_thread_with_its_kernel() -> None:
    recs = memcheck_errors(PROBED)
    assert [r["kernel"] for r in recs] == ["fill_f32", "fill_f32"]
    assert all(r["error"].startswith("Invalid __global__ write") for r in recs)


def test_other_kernels_and_api_errors_are_records_too() -> None:
    recs = memcheck_errors(PROBED + BUG)
    kernels = [r["kernel"] for r in recs]
    assert kernels == ["fill_f32", "fill_f32", "dense_decode", ""]
    assert recs[-1]["error"].startswith("Program hit CUDA_ERROR_LAUNCH_FAILED")
