"""Programs run under ``mpiexec -n 2 python -m tests.mpi.device_cases CASE [MODE]`` by
tests/mpi/test_device.py: device-state halo messages through :class:`mgnn.comm.DeviceHalo`.

``shim staged|cuda-aware`` runs both paths without a GPU: ``Shim`` is an ``xp`` module (the subset
of CuPy DeviceHalo uses) over NumPy memory. In the cuda-aware mode its "device" arrays are a NumPy
subclass (so MPI can read them, as a CUDA-aware MPI reads device pointers); in the staged mode they
are opaque objects MPI cannot read at all. A recording communicator logs every Isend/Irecv buffer
and every stream synchronisation in one list. ``cupy`` runs the same exchange with real CuPy arrays
(staged, and CUDA-aware when the MPI library says it is).

Every rank raises on a mismatch (mpiexec exits non-zero); rank 0 prints one JSON summary line.
"""
import json
import sys
import time

import numpy as np
from mpi4py import MPI

from mgnn.comm.device import DeviceHalo, cuda_aware_mpi, make_device_halo
from mgnn.comm.halo import Halo, SerialHalo, tag

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
TAGS = (tag("f_relax"), tag("residual", 1), tag("adjoint_halo", 2))
KINDS = ((np.float32, (3, 5)), (np.float64, (2, 4, 4)), (np.float64, (3, 5)))


def _check(ok, what):
    if not ok:
        raise AssertionError(f"rank {RANK}: {what}")


class DeviceArray(np.ndarray):
    """A "device" array MPI can read (the cuda-aware shim): NumPy memory flagged as device."""

    def set(self, host):
        """Host -> device copy (cupy.ndarray.set)."""
        np.copyto(self, host)


class OpaqueDeviceArray:
    """A "device" array MPI cannot read (the staged shim): no buffer protocol, no CAI."""

    def __init__(self, data):
        self._data = data

    shape = property(lambda self: self._data.shape)
    dtype = property(lambda self: self._data.dtype)

    def set(self, host):
        np.copyto(self._data, host)


class _Stream:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append(("sync", None))


class Shim:
    """An ``xp`` module over NumPy: what DeviceHalo calls of CuPy, logging stream syncs."""

    def __init__(self, device_type, log):
        self.ndarray, self.log, self.pinned = device_type, log, 0
        stream = _Stream(log)

        class cuda:  # noqa: N801 -- mirrors cupy.cuda
            get_current_stream = staticmethod(lambda: stream)
        self.cuda = cuda

    def _wrap(self, host):
        return host.view(DeviceArray) if self.ndarray is DeviceArray else OpaqueDeviceArray(host)

    def _host(self, a):
        return a._data if isinstance(a, OpaqueDeviceArray) else np.asarray(a).view(np.ndarray)

    def asarray(self, a):
        return a if isinstance(a, self.ndarray) else self._wrap(np.array(a))

    def ascontiguousarray(self, a):
        return self._wrap(np.ascontiguousarray(self._host(a)))

    def empty(self, shape, dtype):
        return self._wrap(np.empty(shape, dtype))

    def asnumpy(self, a, out=None):
        if out is None:
            return self._host(a).copy()
        np.copyto(out, self._host(a))
        return out

    def empty_pinned(self, shape, dtype):
        self.pinned += 1
        return np.empty(shape, dtype)

    def to_device(self, host, noncontiguous=False):
        """A device array equal to ``host`` (a transposed view when ``noncontiguous``)."""
        if noncontiguous:
            return self._wrap(np.ascontiguousarray(host.T).T)
        return self._wrap(host.copy())


class RecordingComm:
    """A communicator that logs (call, buffer) of every Isend/Irecv in ``log`` and forwards."""

    def __init__(self, comm, log):
        self._comm, self._log = comm, log

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Isend(self, spec, dest, tag):  # noqa: N802 -- mpi4py's name
        self._log.append(("Isend", spec[0]))
        return self._comm.Isend(spec, dest=dest, tag=tag)

    def Irecv(self, spec, source, tag):  # noqa: N802
        self._log.append(("Irecv", spec[0]))
        return self._comm.Irecv(spec, source=source, tag=tag)


def payload(sender, it, tag_, dtype, shape):
    """The message ``sender`` sends in round ``it`` with ``tag_``: random values plus -0.0, inf,
    nan and a subnormal, so equality is checked bit for bit."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([sender, it, tag_, dtype.itemsize, *shape])
    x = rng.standard_normal(shape).astype(dtype).ravel()
    x[:4] = [-0.0, np.inf, np.nan, np.finfo(dtype).smallest_subnormal]
    return x.reshape(shape)


class _Done:
    def Wait(self):  # noqa: N802
        pass


def exchange(halo, to_device, to_host, device_type, rounds=4):
    """Both ranks send each other one message per (tag, dtype, shape) per round (contiguous and
    transposed device arrays alternately) and compare what arrives bit for bit; returns the number
    of messages received."""
    other = 1 - RANK
    buffers, received = {}, 0
    for it in range(rounds):
        recvs = [((t, dtype, shape), halo.irecv(to_device(np.zeros(shape, dtype)), other, t))
                 for t in TAGS for dtype, shape in KINDS]
        sends = [halo.isend(to_device(payload(RANK, it, t, dtype, shape), it % 2 == 1), other, t)
                 for t in TAGS for dtype, shape in KINDS]
        for key, pending in recvs:
            got = halo.wait(pending)
            _check(isinstance(got, device_type), f"received a {type(got)}")
            want = payload(other, it, *key)
            host = to_host(got)
            _check(host.dtype == want.dtype and host.shape == want.shape, f"{key}: {host.dtype}")
            _check(host.tobytes() == want.tobytes(), f"{key} round {it}: {host} != {want}")
            _check(buffers.setdefault(key, got) is got, f"{key}: receive buffer not reused")
            _check(halo.wait((_Done(), got, time.perf_counter())) is got,
                   "a completed pending is not passed on")
            received += 1
        for pending in sends:
            halo.wait(pending)
    return received


def _synced_before_each_mpi_call(log):
    synced = False
    for call, _ in log:
        if call == "sync":
            synced = True
        else:
            _check(synced, f"{call} without a stream synchronisation before it")
            synced = False


def case_shim(mode):
    """Both paths with the NumPy-backed shim; checks the log of MPI buffers and syncs."""
    log = []
    device_type = DeviceArray if mode == "cuda-aware" else OpaqueDeviceArray
    xp = Shim(device_type, log)
    halo = DeviceHalo(Halo(RecordingComm(COMM, log)), cuda_aware=(mode == "cuda-aware"), xp=xp,
                      sync=lambda: log.append(("sync", None)), empty_pinned=xp.empty_pinned)
    _check(halo.path == mode and halo.cuda_aware == (mode == "cuda-aware"), halo.path)
    _check((halo.rank, halo.size) == (RANK, SIZE), "rank/size")
    _check(halo.timers is halo.halo.timers and halo.timers["staging"] == 0.0, "timers")
    received = exchange(halo, xp.to_device, xp.asnumpy, device_type, rounds=1)
    pinned_after_one_round = xp.pinned
    received += exchange(halo, xp.to_device, xp.asnumpy, device_type, rounds=5)
    mpi_calls = [(call, buf) for call, buf in log if call != "sync"]
    _check(len(mpi_calls) == 2 * received, f"{len(mpi_calls)} MPI calls for {received} messages")
    _synced_before_each_mpi_call(log)
    if mode == "staged":
        _check(all(type(buf) is np.ndarray for _, buf in mpi_calls),
               f"MPI was handed {sorted({type(b).__name__ for _, b in mpi_calls})}")
        _check(halo.timers["staging"] > 0, "staging time not counted")
        _check(0 < xp.pinned == pinned_after_one_round <= 2 * len(TAGS) * len(KINDS),
               f"{xp.pinned} pinned buffers allocated ({pinned_after_one_round} after one round)")
    else:
        _check(all(type(buf) is DeviceArray for _, buf in mpi_calls),
               f"MPI was handed {sorted({type(b).__name__ for _, b in mpi_calls})}")
        _check(halo.timers["staging"] == 0.0 and xp.pinned == 0, "cuda-aware path staged")
    _check(halo.timers["halo_wait"] > 0 and halo.timers["halo_total"] > 0, "wait timers")

    # host arrays pass through to the wrapped Halo unchanged: no syncs, no staging
    del log[:]
    staging = halo.timers["staging"]
    x = payload(RANK, 99, TAGS[0], np.float64, (3, 5))
    recv = halo.irecv(np.empty_like(x), 1 - RANK, TAGS[0])
    send = halo.isend(x, 1 - RANK, TAGS[0])
    got = halo.wait(recv)
    halo.wait(send)
    _check(type(got) is np.ndarray and got.tobytes() == payload(1 - RANK, 99, TAGS[0], np.float64,
                                                                 (3, 5)).tobytes(), "host message")
    _check([c for c, _ in log] == ["Irecv", "Isend"] and
           all(type(b) is np.ndarray for _, b in log), f"host message log {log}")
    _check(halo.timers["staging"] == staging, "host message counted as staging")

    # make_device_halo: serial, and detected / default sync + pinned allocator from xp
    serial = make_device_halo(MPI.COMM_SELF, xp=xp)
    _check(isinstance(serial, SerialHalo) and serial.path == "none", "serial make_device_halo")
    made = make_device_halo(COMM, xp=xp)
    aware, reason = cuda_aware_mpi()
    _check(isinstance(made, DeviceHalo) and made.cuda_aware == aware and made.reason == reason,
           f"make_device_halo: {made.path}, {made.reason}")
    forced = make_device_halo(COMM, xp=xp, cuda_aware=(mode == "cuda-aware"))
    del log[:]
    pinned = xp.pinned
    n = exchange(forced, xp.to_device, xp.asnumpy, device_type, rounds=1)
    _check(sum(call == "sync" for call, _ in log) >= 2 * n, "default sync (xp's current stream)")
    _check((xp.pinned > pinned) == (mode == "staged"), "default pinned allocator")
    if RANK == 0:
        print(json.dumps({"case": "shim", "mode": halo.path, "ranks": SIZE, "received": received,
                          "staging_s": halo.timers["staging"], "pinned": xp.pinned,
                          "detected": [aware, reason]}))


def case_cupy():
    """Real CuPy device arrays: staged, and CUDA-aware when the MPI library says so."""
    import cupy as cp
    cp.cuda.Device(RANK % cp.cuda.runtime.getDeviceCount()).use()
    aware, reason = cuda_aware_mpi()

    def to_device(host, noncontiguous=False):
        if noncontiguous:
            return cp.asarray(np.ascontiguousarray(host.T)).T
        return cp.asarray(host)

    paths = {}
    for cuda_aware in (False, True) if aware else (False,):
        halo = make_device_halo(COMM, xp=cp, cuda_aware=cuda_aware)
        received = exchange(halo, to_device, cp.asnumpy, cp.ndarray, rounds=3)
        if not cuda_aware:
            _check(halo.timers["staging"] > 0, "staging time not counted")
        else:
            _check(halo.timers["staging"] == 0.0, "cuda-aware path staged")
        paths[halo.path] = received
    if RANK == 0:
        print(json.dumps({"case": "cupy", "ranks": SIZE, "paths": paths,
                          "detected": [aware, reason]}))


if __name__ == "__main__":
    if SIZE != 2:
        raise RuntimeError(f"device_cases runs on 2 ranks, not {SIZE}")
    {"shim": case_shim, "cupy": case_cupy}[sys.argv[1]](*sys.argv[2:])
