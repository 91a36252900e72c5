"""Halo messages of device (GPU) array states: CUDA-aware MPI, or staged through pinned memory.

docs/design.md, "Parallel layout": on the GPU the message buffers are device arrays handed to MPI directly when
the loaded MPI library is CUDA-aware (decided at run time by :func:`cuda_aware_mpi`), otherwise
they are staged through pinned host buffers; the CUDA stream is synchronised before MPI touches a
buffer.

Nothing here imports mpi4py or CuPy at module import: serial and CPU-only runs never load them.
The device array module (``xp``, default :mod:`cupy`), the stream synchronisation and the pinned
allocator are injectable, so both paths are tested without a GPU (tests/mpi/device_cases.py).
"""
import ctypes
import os
import time

import numpy as np

from .halo import Halo, SerialHalo, make_halo

#: Environment variable that overrides the detection (0/1/true/false/yes/no).
ENV_CUDA_AWARE = "MGNN_CUDA_AWARE_MPI"
#: ``MPIX_GPU_SUPPORT_CUDA`` of MPICH's mpi.h (ZE = 1, HIP = 2).
MPIX_GPU_SUPPORT_CUDA = 0

_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")
_detected = {}  # the cached library answer: {"answer": (bool, str)}


def cuda_aware_mpi():
    """Whether the loaded MPI library accepts device (CUDA) pointers, and how that was decided.

    In order: the environment override ``MGNN_CUDA_AWARE_MPI`` (``0/1/true/false/yes/no``, case
    insensitive; empty counts as unset), then a query of the MPI library mpi4py has loaded, through
    ctypes: MPICH's ``int MPIX_GPU_query_support(int gpu_type, int *is_supported)`` with
    ``MPIX_GPU_SUPPORT_CUDA``, else Open MPI's (also MPICH >= 4.1's) ``int
    MPIX_Query_cuda_support(void)``. Without a query function, or without mpi4py, the answer is
    False. The library's answer is cached for the process (the environment is read every call).

    Returns
    -------
    aware : bool
    reason : str
        How it was decided, for users (``--timings``), e.g. ``"env MGNN_CUDA_AWARE_MPI=1"`` or
        ``"MPIX_GPU_query_support(CUDA) = 0 (MPICH 5.0.2)"``.

    Raises
    ------
    ValueError
        ``MGNN_CUDA_AWARE_MPI`` holds another value (the message names it).
    """
    raw = os.environ.get(ENV_CUDA_AWARE)
    if raw is not None and raw.strip():
        value = raw.strip().lower()
        if value in _TRUE or value in _FALSE:
            return value in _TRUE, f"env {ENV_CUDA_AWARE}={raw}"
        raise ValueError(f"{ENV_CUDA_AWARE}={raw!r}: expected 0, 1, true, false, yes or no")
    if "answer" not in _detected:
        try:
            libs, vendor = _mpi_libraries()
        except ImportError as exc:
            return False, f"mpi4py is not available ({exc}): assuming not CUDA-aware"
        if libs is None:  # MPI not initialised (yet) or finalised: ask again later
            return False, f"{vendor}: MPI is not initialised: assuming not CUDA-aware"
        _detected["answer"] = query_cuda_support(libs, vendor)
    return _detected["answer"]


def _mpi_libraries():
    """([(name, ctypes library)], vendor) of the MPI library mpi4py has loaded.

    The mpi4py.MPI extension's own handle is asked first: ``dlsym`` on it searches the libraries
    it depends on (libmpi), however mpi4py loaded them (RTLD_LOCAL on Linux); then the global
    symbol table (macOS, or a libmpi loaded RTLD_GLOBAL). Raises ImportError without mpi4py.
    """
    from mpi4py import MPI
    vendor = _vendor(MPI.Get_library_version())
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return None, vendor
    libs = []
    path = getattr(MPI, "__file__", None)
    candidates = [(os.path.basename(path), path)] if path else []
    for name, target in candidates + [("the global symbols", None)]:
        try:
            libs.append((name, ctypes.CDLL(target)))
        except OSError:
            pass
    return libs, vendor


def _vendor(version):
    """Short MPI library name from MPI_Get_library_version ('MPICH 5.0.2', 'Open MPI v5.0.3')."""
    first = (version.strip().splitlines() or ["unknown MPI"])[0].split(",")[0].strip()
    if first.startswith("MPICH Version:"):
        first = "MPICH " + first[len("MPICH Version:"):].strip()
    return first or "unknown MPI"


def _symbol(lib, name):
    try:
        return getattr(lib, name)
    except AttributeError:
        return None


def query_cuda_support(libs, vendor):
    """Ask ctypes libraries for CUDA support; never raises for a missing symbol.

    Parameters
    ----------
    libs : list of (str, ctypes.CDLL-like)
        Where to look, in order (the name is only used in the reason). A library object exposes the
        C functions as attributes (AttributeError when absent), each with settable ``restype`` and
        ``argtypes``.
    vendor : str
        The MPI library's name, shown in the reason.

    Returns
    -------
    (bool, str)
        As :func:`cuda_aware_mpi`.
    """
    for _, lib in libs:
        fn = _symbol(lib, "MPIX_GPU_query_support")
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            flag = ctypes.c_int(0)
            err = fn(MPIX_GPU_SUPPORT_CUDA, ctypes.pointer(flag))
            if err != 0:
                return False, (f"MPIX_GPU_query_support(CUDA) returned error {err} ({vendor}): "
                               "assuming not CUDA-aware")
            return bool(flag.value), f"MPIX_GPU_query_support(CUDA) = {flag.value} ({vendor})"
        fn = _symbol(lib, "MPIX_Query_cuda_support")
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, []
            value = fn()
            return bool(value), f"MPIX_Query_cuda_support() = {value} ({vendor})"
    where = " or ".join(name for name, _ in libs) or "no loaded library"
    return False, f"no query function in {vendor} ({where}): assuming not CUDA-aware"


class _Staged:
    """A staged message in flight: the MPI request, its pinned host buffer and, for a receive, the
    device buffer the data is copied to in :meth:`DeviceHalo.wait`."""

    __slots__ = ("request", "host", "device", "pool")

    def __init__(self, request, host, device=None, pool=None):
        self.request, self.host, self.device, self.pool = request, host, device, pool


class DeviceHalo:
    """:class:`~mgnn.comm.halo.Halo` messages of device array states (CuPy, or anything exposing
    ``__cuda_array_interface__``); host (NumPy) arrays pass through to the wrapped halo unchanged.

    Parameters
    ----------
    halo : Halo
        The host halo over the layer communicator (its tags, types, timers and request handling).
    cuda_aware : bool or None
        Hand device buffers to MPI directly (``path = "cuda-aware"``) or stage them through pinned
        host buffers (``path = "staged"``); None: :func:`cuda_aware_mpi` decides.
    xp : module or None
        The device array module (default :mod:`cupy`). Used: ``xp.ndarray`` (the device array
        type), ``xp.asarray``, ``xp.ascontiguousarray``, ``xp.empty(shape, dtype)``,
        ``xp.asnumpy(a, out=host)`` (device -> host), ``device.set(host)`` (host -> device) and,
        unless injected, ``xp.cuda.get_current_stream().synchronize()`` and ``xp.empty_pinned`` or
        ``cupyx.empty_pinned``.
    sync : callable or None
        Synchronises the current stream (default: CuPy's current stream). Called before every
        Isend/Irecv of a device message.
    empty_pinned : callable or None
        ``empty_pinned(shape, dtype)`` -> page-locked host ``numpy.ndarray``.

    Notes
    -----
    Receives land in a device buffer reused per (tag, source, shape, dtype), as :class:`Halo`'s
    host buffers: the caller must copy what :meth:`wait` returns before the next receive of that
    kind and never keep it as a state. Staged sends copy into pinned buffers pooled per (shape,
    dtype), free again once their send was waited for. Device -> host and host -> device copies
    (with their stream synchronisation) are timed into ``timers["staging"]`` (seconds); ``timers``
    is the wrapped halo's dict (its ``halo_wait``, ``recv_wait``, ``halo_total`` count as there).
    """

    def __init__(self, halo, cuda_aware=None, xp=None, *, sync=None, empty_pinned=None):
        if not isinstance(halo, Halo):
            raise TypeError(f"DeviceHalo wraps a Halo over a communicator, got {halo!r} "
                            "(make_device_halo returns a SerialHalo for serial runs)")
        if xp is None:
            import cupy as xp
        if cuda_aware is None:
            cuda_aware, reason = cuda_aware_mpi()
        else:
            reason = f"set by the caller (cuda_aware={bool(cuda_aware)})"
        self.halo, self.xp = halo, xp
        self.cuda_aware, self.reason = bool(cuda_aware), reason
        self.path = "cuda-aware" if self.cuda_aware else "staged"
        self.timers = halo.timers
        self.timers.setdefault("staging", 0.0)
        if sync is None:
            def sync():
                xp.cuda.get_current_stream().synchronize()
        if empty_pinned is None:
            empty_pinned = getattr(xp, "empty_pinned", None)
            if empty_pinned is None:
                from cupyx import empty_pinned
        self._sync, self._empty_pinned = sync, empty_pinned
        self._recv_device = {}  # (tag, source, shape, dtype) -> device buffer
        self._recv_host = {}    # (tag, source, shape, dtype) -> pinned buffer
        self._send_host = {}    # (shape, dtype) -> free pinned buffers

    rank = property(lambda self: self.halo.rank)
    reduce_rank = property(lambda self: self.halo.reduce_rank)
    size = property(lambda self: self.halo.size)
    comm = property(lambda self: self.halo.comm)

    def allgather_rows(self, send, recv, counts, displs):
        """:meth:`Halo.allgather_rows` of device arrays (through host copies unless CUDA-aware)."""
        if not self._is_device(send) or self.cuda_aware:
            if self._is_device(send):
                self._sync()
            return self.halo.allgather_rows(send, recv, counts, displs)
        t0 = time.perf_counter()
        key = ("gather", send.shape, recv.shape, send.dtype.str)
        bufs = self._recv_host.get(key)
        if bufs is None:  # pinned host buffers per shape, reused by every coarsest solve
            bufs = self._recv_host[key] = (self._empty_pinned(send.shape, send.dtype),
                                           self._empty_pinned(recv.shape, recv.dtype))
        host_send, host_recv = bufs
        self.xp.asnumpy(send, out=host_send)
        self.timers["staging"] += time.perf_counter() - t0
        self.halo.allgather_rows(host_send, host_recv, counts, displs)
        t0 = time.perf_counter()
        recv.set(host_recv)
        self.timers["staging"] += time.perf_counter() - t0

    def allgather_objects(self, items):
        return self.halo.allgather_objects(items)

    def allreduce_sum(self, value):
        """Sum of a float over the ranks of the wrapped halo's reduction communicator."""
        return self.halo.allreduce_sum(value)

    def _is_device(self, a):
        return isinstance(a, self.xp.ndarray) or hasattr(a, "__cuda_array_interface__")

    def isend(self, array, dest, tag_):
        """Start sending ``array`` (device or host) to ``dest``; returns the pending pair for
        :meth:`wait`.

        Parameters
        ----------
        array : device or numpy array, float32/float64/complex128, any shape and strides
        dest, tag_ : int
        """
        if not self._is_device(array):
            return self.halo.isend(array, dest, tag_)
        mpi_type = self.halo._mpi_type(array.dtype)
        xp = self.xp
        buf = xp.ascontiguousarray(array if isinstance(array, xp.ndarray) else xp.asarray(array))
        if self.cuda_aware:
            self._sync()  # the kernels writing buf are done before MPI reads it
            req = self.halo.comm.Isend([buf, mpi_type], dest=dest, tag=tag_)
            return req, buf
        key = (buf.shape, np.dtype(buf.dtype).str)
        free = self._send_host.setdefault(key, [])
        host = free.pop() if free else self._empty_pinned(buf.shape, buf.dtype)
        self._sync()  # not staging time: the kernels producing buf
        t0 = time.perf_counter()
        xp.asnumpy(buf, out=host)
        self._sync()
        self.timers["staging"] += time.perf_counter() - t0
        req = self.halo.comm.Isend([host, mpi_type], dest=dest, tag=tag_)
        return _Staged(req, host, pool=free), host

    def irecv(self, template, source, tag_):
        """Start receiving an array shaped like ``template`` (device: into a device buffer; host:
        as :meth:`Halo.irecv`); returns the pending (request, buffer, post time) for :meth:`wait`.
        """
        if not self._is_device(template):
            return self.halo.irecv(template, source, tag_)
        mpi_type = self.halo._mpi_type(template.dtype)
        key = (tag_, source, tuple(template.shape), np.dtype(template.dtype).str)
        dev = self._recv_device.get(key)
        if dev is None:
            dev = self._recv_device[key] = self.xp.empty(key[2], dtype=template.dtype)
        if self.cuda_aware:
            self._sync()  # queued kernels reading the reused buffer are done before MPI writes it
            req = self.halo.comm.Irecv([dev, mpi_type], source=source, tag=tag_)
            return req, dev, time.perf_counter()
        host = self._recv_host.get(key)
        if host is None:
            host = self._recv_host[key] = self._empty_pinned(key[2], template.dtype)
        self._sync()
        req = self.halo.comm.Irecv([host, mpi_type], source=source, tag=tag_)
        return _Staged(req, host, device=dev), dev, time.perf_counter()

    def wait(self, pending):
        """Wait for a pending message from :meth:`isend`/:meth:`irecv` (or any (request, buffer[,
        post time]) :meth:`Halo.wait` takes); returns its buffer, for a staged receive the device
        buffer after the host -> device copy. Timers as :meth:`Halo.wait`, plus ``staging``."""
        staged = pending[0]
        if not isinstance(staged, _Staged):
            return self.halo.wait(pending)
        self.halo.wait((staged.request, staged.host) + tuple(pending[2:]))
        if staged.device is None:  # a send: its pinned buffer is free again
            staged.pool.append(staged.host)
            return pending[1]
        t0 = time.perf_counter()
        staged.device.set(staged.host)
        self._sync()  # the copy is done before the pinned buffer takes the next message
        self.timers["staging"] += time.perf_counter() - t0
        return staged.device


def make_device_halo(comm, reduce_comm=None, xp=None, cuda_aware=None):
    """Halo for device array states over ``comm``.

    Parameters
    ----------
    comm : mpi4py communicator or None
        The layer communicator the boundary states travel over.
    reduce_comm : mpi4py communicator or None
        Residual norms are summed over it (default: ``comm``), as :func:`make_halo`.
    xp, cuda_aware
        As :class:`DeviceHalo` (default: CuPy; detected by :func:`cuda_aware_mpi` unless ``xp``
        has a ``cuda_aware_mpi`` attribute, as the host stand-in of ``bench gpu-launches``).

    Returns
    -------
    SerialHalo
        For ``comm`` None or of size 1 (``path = "none"``; ``timers["staging"]`` stays 0).
    DeviceHalo
        Else, over ``make_halo(comm, reduce_comm)``; ``xp`` and ``cuda_aware`` as
        :class:`DeviceHalo`.
    """
    if comm is None or comm.Get_size() == 1:
        halo = SerialHalo(reduce_comm)
        halo.path, halo.reason = "none", "single process: no messages"
        halo.timers["staging"] = 0.0
        return halo
    if cuda_aware is None:  # an array module may say (a host stand-in: True)
        cuda_aware = getattr(xp, "cuda_aware_mpi", None)
    return DeviceHalo(make_halo(comm, reduce_comm), cuda_aware=cuda_aware, xp=xp)


def select_device(comm):
    """Make the GPU ``node-local rank mod device count`` current for this rank (collective over
    ``comm``) and return its index: ranks of one node spread over its GPUs, several ranks share a
    GPU when there are more ranks than GPUs."""
    import cupy
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        index = local.Get_rank() % cupy.cuda.runtime.getDeviceCount()
    finally:
        local.Free()
    cupy.cuda.Device(index).use()
    return index
