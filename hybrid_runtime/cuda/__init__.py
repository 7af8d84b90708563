"""CUDA backend of the stateful mixers: NVRTC-compiled kernels launched through cuda-python.

* :mod:`.driver`    checked driver calls (typed ``CudaError``), devices, memory, ``DeviceArray``, limits
* :mod:`.kernels`   NVRTC compile + cache, library loading, per-device opt-in records, guarded launches
* :mod:`.attention` decode attention behind the dispatcher (single-block, split-KV + LSE merge)
* :mod:`.state`     recurrent-state buffers and the paged KV pool on the device
* :mod:`.gdn`       Gated DeltaNet conv + delta rule, decode and prefill

Nothing here is imported by the CPU path; importing this package needs neither a GPU nor cuda-bindings
(only using it does).
"""

from __future__ import annotations


def available() -> bool:
    """True when cuda-bindings, a driver and at least one GPU are present."""
    from .driver import device_count

    return device_count() > 0
