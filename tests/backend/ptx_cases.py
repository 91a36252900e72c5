"""Compile every Numba CUDA kernel of mgnn.backend.numba_cuda to sm_90 PTX without a GPU.

Run as ``python -m tests.backend.ptx_cases [--broken]`` (the CUDA simulator must be off); prints
one JSON object: the registry's completeness, and per (kernel, dtype) the PTX version and the
registers, spill bytes and static shared memory of its sm_90 assembly (nvJitLink). With
``--broken`` it compiles a deliberately mistyped kernel through the same path instead and reports
the error (the check must be able to fail).
"""
import json
import os
import re
import sys
import types as pytypes

import numpy as np

CC = (9, 0)


def _point_device_lookup_at_sm90():
    """numba-cuda asks the current device for its compute capability when it compiles a device
    function called by a kernel; without a GPU, answer sm_90."""
    from numba.cuda import dispatcher
    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=CC)


def assemble(ptx):
    """Assemble ``ptx`` for sm_90 with nvJitLink (the linker numba-cuda itself uses; from the
    ``cuda-toolkit`` wheels of ``numba-cuda[cu13]``, so its ptxas matches the PTX version of the
    wheel's NVVM, which a system ``ptxas`` may not) and return the ptxas resource usage."""
    from cuda.bindings import nvjitlink
    handle = nvjitlink.create(2, [f"-arch=sm_{CC[0]}{CC[1]}", "-verbose"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        try:
            nvjitlink.complete(handle)
        finally:
            log = bytearray(nvjitlink.get_info_log_size(handle))
            nvjitlink.get_info_log(handle, log)
            errors = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, errors)
    except nvjitlink.nvJitLinkError as exc:
        raise RuntimeError(f"nvJitLink failed: {exc}: {errors.decode(errors='replace')}") from None
    finally:
        nvjitlink.destroy(handle)
    log = log.decode(errors="replace")
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_bytes": int(spill.group(1)) + int(spill.group(2)),
            "smem_bytes": int(re.search(r"(\d+) bytes smem", log).group(1))}


def compile_one(py_func, sig):
    """PTX facts of ``py_func`` at ``sig`` and its ptxas resource usage."""
    from numba import cuda
    ptx, _ = cuda.compile_ptx(py_func, sig, cc=CC)
    row = {"ptx_version": re.search(r"^\.version\s+(\S+)", ptx, re.M).group(1),
           "target": re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)}
    row.update(assemble(ptx))
    return row


def _kernels_of_module(nc):
    """Every non-device ``cuda.jit`` dispatcher of the module (module globals and _UPDATE)."""
    def is_kernel(v):
        return hasattr(v, "py_func") and hasattr(v, "targetoptions") \
            and not v.targetoptions.get("device")
    found = {id(v): name for name, v in vars(nc).items() if is_kernel(v)}
    for dt, kernels in nc._UPDATE.items():
        for k in kernels:
            if is_kernel(k):
                found[id(k)] = f"{k.py_func.__name__}[{np.dtype(dt).name}]"
    return found


def main(argv):
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        raise SystemExit("run with the CUDA simulator off")
    _point_device_lookup_at_sm90()
    from mgnn.backend import numba_cuda as nc
    from numba import cuda, types
    out = {}
    if "--broken" in argv:
        def broken(x):
            i = cuda.grid(1)
            x[i] = {"a": x[i]}  # a dict in device code: no CUDA lowering
        try:
            compile_one(broken, (types.Array(types.float32, 1, "C"),))
            out["broken"] = "compiled"
        except Exception as exc:  # noqa: BLE001 -- any compile error is the expected outcome
            out["broken"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        print(json.dumps(out))
        return
    registry = nc.launch_signatures()
    listed = {id(k) for k, _ in registry.values()}
    out["missing"] = sorted(n for i, n in _kernels_of_module(nc).items() if i not in listed)
    out["kernels"] = {f"{name}/{dt}": compile_one(k.py_func, sig)
                      for (name, dt), (k, sig) in sorted(registry.items())}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
