"""A fake ``cupy`` for running mgnn's GPU code paths on a machine without a GPU (tests only).

"Device" arrays are a NumPy subclass that refuses to mix with plain NumPy arrays in ufuncs and
array functions (as CuPy does), ``RawModule`` compiles the CUDA C through mgnn's host emulation,
and work runs at once on the host, except under stream capture (``Stream.begin_capture``): then,
as in CUDA, nothing runs; kernel launches, cuBLAS GEMMs, ufuncs, assignments, copies and fills
are recorded and run in order by every ``launch()`` of the graph ``end_capture`` returns (new
arrays made during the capture are the graph's own, refilled at every launch), and reading a
device value on the host (``get``, ``float``, ``item``, ``asnumpy``, a synchronize) is an error,
as CUDA's "operation not permitted when stream is capturing". Put ``tests/fakegpu`` first on
``sys.path`` (in a subprocess) and run with ``NUMBA_ENABLE_CUDASIM=1`` so that the Numba CUDA
kernels run in the simulator.
"""
import ctypes
import re
import types

import numpy as np

__version__ = "0.0-fake"
float32, float64, int32, int64, uint64 = (np.float32, np.float64, np.int32, np.int64,
                                          np.uint64)
calls = {"to_device": 0, "to_host": 0}  # transfers, for tests
_capture = None  # the operations recorded while a stream captures (None: not capturing)


def _not_capturing(what):
    if _capture is not None:
        raise RuntimeError(f"fake cupy: {what} while a stream is capturing (CUDA: operation not "
                           "permitted when stream is capturing)")


def _record(op):
    """``op()`` at every launch of the graph being captured (not now)."""
    _capture.append(op)


def _allocated():
    """Count an array made while a stream captures (``calls["capture_allocs"]``): real CuPy
    returns it to the memory pool once Python drops it, while the graph still writes it, so
    mgnn's captured cycles must make none (here the recorded work keeps it alive)."""
    if _capture is not None:
        calls["capture_allocs"] = calls.get("capture_allocs", 0) + 1


def _host(a):
    return a.view(np.ndarray) if isinstance(a, np.ndarray) else a


def _fresh(like_result):
    """A new "device" array shaped like ``like_result`` (an array or a NumPy scalar): a graph's
    own output buffer."""
    _allocated()
    return np.array(like_result, copy=True).view(ndarray)


def _into(targets, values):
    for t, v in zip(targets, values):
        t.view(np.ndarray)[...] = v


class ndarray(np.ndarray):
    """A "device" array."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _no_host_arrays(ufunc.__name__, inputs + tuple(kwargs.get("out", ())))
        args = [a.view(np.ndarray) if isinstance(a, ndarray) else a for a in inputs]
        outs = kwargs.get("out")
        if outs is not None:
            kwargs["out"] = tuple(o.view(np.ndarray) for o in outs)
        fn = getattr(ufunc, method)
        if _capture is None:
            return _wrap(fn(*args, **kwargs))
        if outs is not None:  # into existing arrays: at every launch
            _record(lambda: fn(*args, **kwargs))
            return outs[0] if len(outs) == 1 else outs
        res = fn(*args, **kwargs)  # (now only for the result's shape: refilled at launches)
        res = tuple(_fresh(r) for r in res) if isinstance(res, tuple) else _fresh(res)
        targets = res if isinstance(res, tuple) else (res,)
        _record(lambda: _into(targets, fn(*args, **kwargs) if len(targets) > 1
                              else (fn(*args, **kwargs),)))
        return res

    def __array_function__(self, func, types_, args, kwargs):
        _no_host_arrays(func.__name__, _flat(args) + _flat(tuple(kwargs.values())))
        if _capture is not None:
            if func is np.copyto:
                dst, src = (_host(a) for a in args[:2])
                _record(lambda: np.copyto(dst, src, **kwargs))
                return None
            res = super().__array_function__(func, types_, args, kwargs)
            if not isinstance(res, np.ndarray):
                _not_capturing(f"{func.__name__} returning a host value")
            if any(np.shares_memory(res, a) for a in _flat(args) if isinstance(a, np.ndarray)):
                return res  # a view
            res = _fresh(res)
            _record(lambda: _into((res,), (super(ndarray, res).__array_function__(
                func, types_, args, kwargs),)))
            return res
        return super().__array_function__(func, types_, args, kwargs)

    def __getitem__(self, key):
        out = super().__getitem__(key)
        if isinstance(out, np.ndarray):
            return out
        # an element: a 0-d view, as CuPy returns (reading it on the host is a transfer)
        return super().__getitem__((key if isinstance(key, tuple) else (key,)) + (Ellipsis,))

    def __setitem__(self, key, value):
        if _capture is None:
            return super().__setitem__(key, value)
        dst = self.view(np.ndarray)
        src = _host(value) if isinstance(value, ndarray) else np.array(value, copy=True)
        _record(lambda: dst.__setitem__(key, src))

    def copy(self, order="C"):
        if _capture is None:
            return super().copy(order)
        _allocated()
        out = np.empty_like(self.view(np.ndarray), order=order).view(ndarray)
        src = self.view(np.ndarray)
        _record(lambda: np.copyto(out.view(np.ndarray), src))
        return out

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if _capture is None or (not copy and np.dtype(dtype) == self.dtype):
            return super().astype(dtype, order, casting, subok, copy)
        _allocated()
        out = np.empty(self.shape, dtype=dtype).view(ndarray)
        src = self.view(np.ndarray)
        _record(lambda: np.copyto(out.view(np.ndarray), src, casting="unsafe"))
        return out

    def fill(self, value):
        if _capture is None:
            return super().fill(value)
        dst = self.view(np.ndarray)
        _record(lambda: dst.fill(value))

    def get(self):
        """Device -> host copy."""
        _not_capturing("a device -> host copy")
        calls["to_host"] += 1
        return np.array(self.view(np.ndarray), copy=True)

    def set(self, arr):
        """Host -> device copy into this array."""
        calls["to_device"] += 1
        if _capture is not None:  # (CUDA: a memcpy node reading the host buffer at launch)
            dst, src = self.view(np.ndarray), arr
            _record(lambda: dst.__setitem__(Ellipsis, src))
            return
        self.view(np.ndarray)[...] = arr


    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def __dlpack_device__(self):
        """A device array: (kDLCUDA, device 0), as CuPy reports."""
        return (_DL_CUDA, 0)


def _host_read(name):
    """ndarray method ``name``, refused while a stream captures (it reads a device value)."""
    def method(self, *args):
        _not_capturing(f"{name}()")
        return getattr(np.ndarray, name)(self, *args)
    method.__name__ = name
    return method


for _name in ("item", "tolist", "__float__", "__int__", "__bool__"):
    setattr(ndarray, _name, _host_read(_name))


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
    _allocated()
    return np.array(a, dtype=dtype, copy=True, order=order or "K").view(ndarray)


def ascontiguousarray(a, dtype=None):
    a = asarray(a, dtype)
    return a if a.flags.c_contiguous else a.copy()


def asnumpy(a, out=None):
    _not_capturing("asnumpy")
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


def _make(fn, refill=True):
    """A constructor; under capture one that fills its array refills it at every launch (CUDA:
    a memset or fill kernel in the graph)."""
    def made(*args, **kwargs):
        _allocated()
        out = fn(*args, **kwargs).view(ndarray)
        if _capture is not None and refill:
            value = np.array(out.view(np.ndarray), copy=True)
            _record(lambda: out.view(np.ndarray).__setitem__(Ellipsis, value))
        return out
    return made


empty, zeros, ones, full, arange = (_make(np.empty, refill=False), _make(np.zeros),
                                    _make(np.ones), _make(np.full), _make(np.arange))


def broadcast_to(a, shape):
    """A read-only broadcast view that stays a "device" array (stride 0 where broadcast)."""
    return np.broadcast_to(a, shape, subok=True)


def empty_like(a, dtype=None):
    _allocated()
    return np.empty(a.shape, dtype=dtype or a.dtype).view(ndarray)


def zeros_like(a, dtype=None):
    return zeros(a.shape, dtype=dtype or a.dtype)


def ones_like(a, dtype=None):
    return ones(a.shape, dtype=dtype or a.dtype)


for _name in ("argmax", "isfinite", "count_nonzero", "where", "sqrt", "tanh", "matmul",
              "copyto", "unique", "concatenate", "maximum"):
    globals()[_name] = getattr(np, _name)


# ------------------------------------------------------------------------------- cuda namespace
class _Graph:
    """A captured graph: its recorded operations, run in order by :meth:`launch`."""

    def __init__(self, ops):
        self.ops = ops

    def launch(self, stream=None):
        _not_capturing("a graph launch")
        calls["graph_launches"] = calls.get("graph_launches", 0) + 1
        for op in self.ops:
            op()


class Stream:
    """A stream (work runs at once on the host) with CUDA stream capture."""

    ptr = 0

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.capturing = False

    def use(self):
        global _current
        _current = self
        return self

    def synchronize(self):
        _not_capturing("a stream synchronize")
        calls["sync"] = calls.get("sync", 0) + 1

    def begin_capture(self, mode=None):
        global _capture
        if _capture is not None:
            raise RuntimeError("fake cupy: a capture is already running")
        _capture, self.capturing = [], True
        calls["captures"] = calls.get("captures", 0) + 1

    def end_capture(self):
        global _capture
        if not self.capturing:
            raise RuntimeError("fake cupy: end_capture on a stream that is not capturing")
        ops, _capture, self.capturing = _capture, None, False
        return _Graph(ops)

    def is_capturing(self):
        return self.capturing


_STREAM = Stream()
_current = _STREAM


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
            if _capture is not None:  # the same launch at every launch of the graph
                _record(lambda: launch_now(grid, block, args))
                return
            launch_now(grid, block, args)

        def launch_now(grid, block, args):
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
    Stream=Stream,
    get_current_stream=lambda: _current,
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
    Device=_Device,
    device=types.SimpleNamespace(get_cublas_handle=lambda: 1),  # see tests/fakegpu/cupy_backends
)
