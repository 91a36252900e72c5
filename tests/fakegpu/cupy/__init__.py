"""A fake ``cupy`` for running mgnn's GPU code paths on a machine without a GPU (tests only).

"Device" arrays are a NumPy subclass that refuses to mix with plain NumPy arrays in ufuncs and
array functions (as CuPy does), ``RawModule`` compiles the CUDA C through mgnn's host emulation,
and the stream is a no-op. Put ``tests/fakegpu`` first on ``sys.path`` (in a subprocess) and run
with ``NUMBA_ENABLE_CUDASIM=1`` so that the Numba CUDA kernels run in the simulator.
"""
import ctypes
import re
import types

import numpy as np

__version__ = "0.0-fake"
float32, float64, int32, int64, uint64 = (np.float32, np.float64, np.int32, np.int64,
                                          np.uint64)
calls = {"to_device": 0, "to_host": 0}  # transfers, for tests


class ndarray(np.ndarray):
    """A "device" array."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _no_host_arrays(ufunc.__name__, inputs + tuple(kwargs.get("out", ())))
        args = [a.view(np.ndarray) if isinstance(a, ndarray) else a for a in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) for o in kwargs["out"])
        out = getattr(ufunc, method)(*args, **kwargs)
        return _wrap(out)

    def __array_function__(self, func, types_, args, kwargs):
        _no_host_arrays(func.__name__, _flat(args) + _flat(tuple(kwargs.values())))
        return super().__array_function__(func, types_, args, kwargs)

    def get(self):
        """Device -> host copy."""
        calls["to_host"] += 1
        return np.array(self.view(np.ndarray), copy=True)

    def set(self, arr):
        """Host -> device copy into this array."""
        calls["to_device"] += 1
        self.view(np.ndarray)[...] = arr

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def __dlpack_device__(self):
        """A device array: (kDLCUDA, device 0), as CuPy reports."""
        return (_DL_CUDA, 0)


def _flat(seq):
    out = []
    for a in seq:
        if isinstance(a, (list, tuple)):
            out.extend(_flat(a))
        else:
            out.append(a)
    return tuple(out)


def _no_host_arrays(name, operands):
    for a in operands:
        if isinstance(a, np.ndarray) and not isinstance(a, ndarray) and a.ndim > 0:
            raise TypeError(f"fake cupy: {name} mixes a device array with a host numpy array "
                            f"(shape {a.shape}); CuPy refuses implicit conversions")


def _wrap(out):
    if isinstance(out, tuple):
        return tuple(_wrap(o) for o in out)
    if isinstance(out, np.ndarray) and not isinstance(out, ndarray):
        return out.view(ndarray)
    return out


def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    calls["to_device"] += 1
    return np.array(a, dtype=dtype, copy=True, order=order or "K").view(ndarray)


def ascontiguousarray(a, dtype=None):
    a = asarray(a, dtype)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a.view(np.ndarray)).view(ndarray)


def asnumpy(a, out=None):
    host = a.get() if isinstance(a, ndarray) else np.asarray(a)
    if out is not None:
        out[...] = host
        return out
    return host


_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def from_dlpack(a):
    """Zero-copy import of a device-resident DLPack object; CPU-resident ones are refused with
    CuPy 14's TypeError (CuPy imports CUDA, CUDA-managed and ROCm memory only)."""
    kind = a.__dlpack_device__()[0]
    if kind not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise TypeError("CPU arrays cannot be directly imported to CuPy. Use "
                        "`cupy.array(numpy.from_dlpack(input))` instead.")
    return np.from_dlpack(_HostView(a)).view(ndarray)


class _HostView:
    """The fake device's memory is host memory: re-export a "device" DLPack object as CPU."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (_DL_CPU, 0)


def get_array_module(*args):
    import sys
    return sys.modules[__name__]


def _make(fn):
    def made(*args, **kwargs):
        return fn(*args, **kwargs).view(ndarray)
    return made


empty, zeros, ones, full, arange = (_make(np.empty), _make(np.zeros), _make(np.ones),
                                    _make(np.full), _make(np.arange))


def broadcast_to(a, shape):
    """A read-only broadcast view that stays a "device" array (stride 0 where broadcast)."""
    return np.broadcast_to(a, shape, subok=True)


def empty_like(a, dtype=None):
    return np.empty(a.shape, dtype=dtype or a.dtype).view(ndarray)


def zeros_like(a, dtype=None):
    return np.zeros(a.shape, dtype=dtype or a.dtype).view(ndarray)


def ones_like(a, dtype=None):
    return np.ones(a.shape, dtype=dtype or a.dtype).view(ndarray)


for _name in ("argmax", "isfinite", "count_nonzero", "where", "sqrt", "tanh", "matmul",
              "copyto", "unique", "concatenate", "maximum"):
    globals()[_name] = getattr(np, _name)


# ------------------------------------------------------------------------------- cuda namespace
class _Stream:
    ptr = 0

    def synchronize(self):
        calls["sync"] = calls.get("sync", 0) + 1


_STREAM = _Stream()


def _geometry(options):
    geo = {}
    for opt in options:
        m = re.fullmatch(r"-DMGNN_(\w+)=(\d+)", opt)
        if m:
            geo[m.group(1)] = int(m.group(2))
    return geo


class RawModule:
    """Compiles the module's kernel file through mgnn's host emulation (same geometry defines)."""

    def __init__(self, code=None, options=(), name_expressions=()):
        from mgnn.backend.cupy_raw import KERNEL_FILES
        from mgnn.backend.host_emulation import build_library
        names = {e.split("<")[0] for e in name_expressions}
        files = [f for f, ks in KERNEL_FILES.items() if names <= set(ks)]
        geo = _geometry(options)
        geo.setdefault("MAX_GRID", 65535)
        self.lib = build_library(files, {f: KERNEL_FILES[f] for f in files}, geo)

    def get_function(self, expr):
        name, t = re.fullmatch(r"(\w+)<(float|double)>", expr).groups()
        fn = getattr(self.lib, f"mgnn_emu_{name}_{'f32' if t == 'float' else 'f64'}")

        def launch(grid, block, args):
            objs = []
            for a in args:
                if isinstance(a, ndarray):
                    objs.append(ctypes.c_void_p(a.ctypes.data))
                elif isinstance(a, np.ndarray):
                    raise TypeError(f"fake cupy: kernel {expr} got a host numpy array")
                elif isinstance(a, np.uint64):
                    objs.append(ctypes.c_uint64(int(a)))
                elif isinstance(a, np.int32):
                    objs.append(ctypes.c_int32(int(a)))
                elif isinstance(a, np.float32):
                    objs.append(ctypes.c_float(a))
                elif isinstance(a, np.float64):
                    objs.append(ctypes.c_double(a))
                else:
                    raise TypeError(f"fake cupy: kernel {expr} cannot pass {type(a).__name__} "
                                    f"{a!r} (CuPy takes arrays and numpy scalars)")
            argv = (ctypes.c_void_p * max(1, len(objs)))(*[ctypes.addressof(o) for o in objs])
            g = (ctypes.c_uint * 3)(*(tuple(grid) + (1, 1))[:3])
            b = (ctypes.c_uint * 3)(*(tuple(block) + (1, 1))[:3])
            if fn(g, b, argv):
                raise RuntimeError(f"fake cupy: kernel {expr} failed")
        return launch


class _Device:
    def __init__(self, index=0):
        self.id = index

    def use(self):
        calls["device"] = self.id


cuda = types.SimpleNamespace(
    is_available=lambda: True,
    get_current_stream=lambda: _STREAM,
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
    Device=_Device,
    device=types.SimpleNamespace(get_cublas_handle=lambda: 1),  # see tests/fakegpu/cupy_backends
)
