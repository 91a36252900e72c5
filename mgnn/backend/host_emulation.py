"""Host emulation of the RawKernels: the CUDA C of ``kernels/*.cu`` compiled by the system C++
compiler against ``kernels/host_emulation.cuh`` and launched through ctypes on NumPy arrays.

It runs every RawKernel on machines without a GPU (slowly: the threads of a block one after
another, as fibers that meet at ``__syncthreads``), with the same launch code as the GPU
(:class:`mgnn.backend.cupy_raw.RawBackend`), so the kernels and their launch geometry are
checked against the NumPy reference wherever mgnn is built.
"""
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np

from . import kernel_dir
from .._config import cache_root
from ..errors import MGNNError

#: Tiny tiles so that small test inputs span several blocks and ragged edges (see common.cuh).
EMULATION_GEOMETRY = {"BM": 8, "BN": 8, "BK": 4, "TM": 2, "TN": 2, "REDUCE": 8, "ELEM": 8,
                      "MAX_GRID": 8}


class EmulationBuildError(MGNNError, RuntimeError):
    """The C++ compiler rejected the host-emulation build of the kernels."""


def cache_dir():
    """Folder of compiled emulation libraries: ``host_emulation`` under
    :func:`mgnn._config.cache_root` (``$MGNN_CACHE_DIR``, ``$XDG_CACHE_HOME/mgnn`` or
    ``~/.cache/mgnn``)."""
    return os.path.join(cache_root(), "host_emulation")


def emulation_source(files, kernels_of):
    """C++ translation unit: the shim, every kernel file, and an export per kernel template."""
    lines = ['#include "host_emulation.cuh"']
    lines += [f'#include "{f}"' for f in files]
    lines += [f"MGNN_EMU_EXPORT({k})" for f in files for k in kernels_of[f]]
    return "\n".join(lines) + "\n"


def build_library(files, kernels_of, geometry, compiler=None):
    """Compile (once per source and geometry; cached) and load the emulation library.

    Returns
    -------
    ctypes.CDLL
        With ``mgnn_emu_<kernel>_f32`` / ``_f64(grid, block, args) -> int`` for every kernel.

    Raises
    ------
    EmulationBuildError
        No C++ compiler, or the compiler reported an error or a warning (``-Werror``).
    """
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise EmulationBuildError("host emulation needs a C++20 compiler (g++); none found")
    kdir = kernel_dir()
    source = emulation_source(files, kernels_of)
    flags = ["-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden",
             "-fno-gnu-unique", "-Wall", "-Wextra", "-Werror",
             f"-I{kdir}"] + [f"-DMGNN_{k}={v}" for k, v in sorted(geometry.items())
                             if k != "MAX_GRID"]
    digest = hashlib.sha256()
    for part in [source, cxx, *flags]:
        digest.update(part.encode())
    for f in sorted(os.listdir(kdir)):
        if f.endswith((".cu", ".cuh")):
            with open(os.path.join(kdir, f), "rb") as fh:
                digest.update(f.encode() + fh.read())
    out_dir = cache_dir()
    os.makedirs(out_dir, exist_ok=True)
    lib_path = os.path.join(out_dir, f"mgnn_emu_{digest.hexdigest()[:20]}.so")
    if not os.path.exists(lib_path):
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            src = os.path.join(tmp, "emulation.cpp")
            with open(src, "w") as fh:
                fh.write(source)
            tmp_lib = os.path.join(tmp, "lib.so")
            proc = subprocess.run([cxx, *flags, src, "-o", tmp_lib], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                raise EmulationBuildError(f"{cxx} failed on the host emulation of the kernels:\n"
                                          f"{proc.stderr[-4000:]}")
            os.replace(tmp_lib, lib_path)  # atomic: a concurrent build never sees half a file
    return ctypes.CDLL(lib_path)


class EmulationLauncher:
    """Launches RawKernels of the emulation library on NumPy arrays (the ``xp`` of this launcher).

    ``launch(name, dtype, grid, block, args)`` takes the kernel's arguments as for the GPU: arrays
    (passed as pointers), ``None`` (a null pointer), Python ints (int), scalars of the element
    type (T), and runs the whole grid before returning.
    """

    xp = np
    name = "emulation"
    on_device = False

    def __init__(self, files, kernels_of, geometry=None):
        self.geometry = dict(EMULATION_GEOMETRY if geometry is None else geometry)
        self.lib = build_library(files, kernels_of, self.geometry)
        self.launches = 0

    @staticmethod
    def ptr(a):
        """Address of the first element of ``a``."""
        return a.ctypes.data

    def to_device(self, a):
        """``a`` as an array of this launcher (a C-contiguous NumPy array)."""
        return np.ascontiguousarray(a)

    def launch(self, name, dtype, grid, block, args):
        fn = getattr(self.lib, f"mgnn_emu_{name}_{'f32' if dtype == np.float32 else 'f64'}")
        scalar = ctypes.c_float if dtype == np.float32 else ctypes.c_double
        objs = []
        for a in args:
            if a is None:
                objs.append(ctypes.c_void_p(0))
            elif isinstance(a, np.ndarray):
                objs.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, (bool, int, np.integer)):
                objs.append(ctypes.c_int(int(a)))
            elif isinstance(a, (float, np.floating)):
                objs.append(scalar(a))
            else:
                raise TypeError(f"kernel {name}: cannot pass {type(a).__name__}")
        argv = (ctypes.c_void_p * max(len(objs), 1))(*[ctypes.addressof(o) for o in objs])
        g = (ctypes.c_uint * 3)(*grid)
        b = (ctypes.c_uint * 3)(*block)
        self.launches += 1
        if fn(g, b, argv) != 0:
            raise MGNNError(f"emulated kernel {name} raised on the host")

    def gemm(self, A, B, C, trans_a=False, trans_b=False):
        """C[p] = op(A[p]) op(B[p]) with NumPy's matmul (cuBLAS's stand-in on the host)."""
        from .cupy_raw import batched_gemm
        self.launches += 1
        batched_gemm(np, A, B, C, trans_a, trans_b)

    def synchronize(self):
        """Nothing to wait for: emulated launches are synchronous."""
