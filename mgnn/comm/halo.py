"""Typed, tagged, nonblocking boundary messages between layer neighbours, with wait timers."""
import os
import time

import numpy as np

#: Named message tags (a level's tag is base + 16 * level).
TAGS = {"f_relax": 1, "c_relax": 2, "residual": 3, "fas_rhs": 4, "coarsest": 5, "final": 6,
        "adjoint_halo": 7, "chain": 8}


def tag(name, level=0):
    """Integer tag of message kind ``name`` on ``level``."""
    return TAGS[name] + 16 * level


def wait_request(request):
    """Complete an MPI request (or anything with ``Wait``) by polling ``Test``, so that a signal
    (Ctrl-C) is handled as soon as it arrives: Python runs signal handlers only between
    bytecodes, never inside a blocking ``MPI_Wait``. Yields the CPU while polling (ranks may
    share cores)."""
    test = getattr(request, "Test", None)
    if test is None:
        request.Wait()
        return
    spins = 0
    while not test():
        spins += 1
        if spins > 32:
            _yield()


_yield = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


class SerialHalo:
    """The null communicator of a single-process solve: no messages.

    ``reduce_comm`` (optional) is the communicator residual norms are summed over (e.g. the data
    replicas of a layer-serial, data-parallel run).
    """

    rank, size = 0, 1
    cuda_aware = False

    def __init__(self, reduce_comm=None):
        self.timers = {"halo_wait": 0.0, "recv_wait": 0.0, "halo_total": 0.0, "allreduce": 0.0}
        self.reduce_comm = reduce_comm if reduce_comm is not None and \
            reduce_comm.Get_size() > 1 else None

    @property
    def reduce_rank(self):
        """This rank's index in the reduction communicator (0 when there is none)."""
        return 0 if self.reduce_comm is None else self.reduce_comm.Get_rank()

    def allgather_rows(self, send, recv, counts, displs):
        """Every rank's ``send`` rows into ``recv`` at its row offset (``counts``, ``displs``:
        rows per rank, in rank order): here, the one rank's rows."""
        recv[displs[0]:displs[0] + counts[0]] = send

    def allgather_objects(self, items):
        """[items of rank 0, items of rank 1, ...] (pickled; for arrays of any kind)."""
        return [items]

    def allreduce_sum(self, value):
        """Sum of a float over the ranks of the reduction communicator."""
        if self.reduce_comm is None:
            return value
        from mpi4py import MPI
        t0 = time.perf_counter()
        buf = np.array([float(value)])
        wait_request(self.reduce_comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM))  # polled
        self.timers["allreduce"] += time.perf_counter() - t0
        return float(buf[0])


class Halo(SerialHalo):
    """Nonblocking typed messages of array states over ``comm`` (mpi4py), with wait timers.

    Receive buffers are preallocated per (tag, shape, dtype) and reused.
    """

    def __init__(self, comm, reduce_comm=None):
        super().__init__(reduce_comm if reduce_comm is not None else comm)
        from mpi4py import MPI
        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._types = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
                       np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX}
        self._buffers = {}

    def _mpi_type(self, dtype):
        try:
            return self._types[np.dtype(dtype)]
        except KeyError:
            raise TypeError(f"no MPI type for state dtype {dtype}") from None

    def isend(self, array, dest, tag_):
        """Start sending ``array`` (kept alive by the returned request pair) to ``dest``."""
        buf = np.ascontiguousarray(array)
        req = self.comm.Isend([buf, self._mpi_type(buf.dtype)], dest=dest, tag=tag_)
        return req, buf

    def irecv(self, template, source, tag_):
        """Start receiving an array shaped like ``template``; returns (request, buffer)."""
        key = (tag_, source, template.shape, template.dtype.str)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = np.empty(template.shape, dtype=template.dtype)
        req = self.comm.Irecv([buf, self._mpi_type(buf.dtype)], source=source, tag=tag_)
        return req, buf, time.perf_counter()

    def allgather_rows(self, send, recv, counts, displs):
        """Allgatherv of C-contiguous host arrays of rows (timed as exposed halo time)."""
        t0 = time.perf_counter()
        row = int(np.prod(send.shape[1:], dtype=np.int64))
        mpi_type = self._mpi_type(send.dtype)
        # nonblocking and polled (wait_request): a blocking collective spins on its core, which
        # starves ranks that share cores and still have work before they reach it
        wait_request(self.comm.Iallgatherv([send, mpi_type],
                                           [recv, self._elements(counts, displs, row),
                                            mpi_type]))
        self.timers["halo_wait"] += time.perf_counter() - t0

    @staticmethod
    def _elements(counts, displs, row):
        """(counts, displs) in rows scaled to elements of ``row`` each: int64 arrays, read-only
        and kept per (counts, displs) pair of tuples (immutable) for every Halo of the process.
        The callers pass the partition's cached tuples every cycle (virtual ranks: one pair for
        all of them), and at thousands of ranks a fresh product per call costs more than the
        message."""
        if not (isinstance(counts, tuple) and isinstance(displs, tuple)):  # may change later
            return np.asarray(counts, np.int64) * row, np.asarray(displs, np.int64) * row
        key = (id(counts), id(displs), row)
        got = _SCALED.get(key)
        if got is None or got[0] is not counts or got[1] is not displs:
            if len(_SCALED) >= 64:
                _SCALED.clear()
            scaled = (np.asarray(counts, np.int64) * row, np.asarray(displs, np.int64) * row)
            for a in scaled:
                a.flags.writeable = False
            got = _SCALED[key] = (counts, displs, scaled)
        return got[2]

    def allgather_objects(self, items):
        t0 = time.perf_counter()
        out = self.comm.allgather(items)
        self.timers["halo_wait"] += time.perf_counter() - t0
        return out

    def wait(self, pending):
        """Wait for a pending (request, buffer[, post time]); returns the buffer.

        The time blocked here is charged to ``halo_wait`` (exposed halo time); for a receive, the
        time blocked also to ``recv_wait`` and the time from posting it to its completion to
        ``halo_total``, so recv_wait / halo_total is the share of message time not hidden behind
        computation.
        """
        t0 = time.perf_counter()
        wait_request(pending[0])
        t1 = time.perf_counter()
        self.timers["halo_wait"] += t1 - t0
        if len(pending) == 3:
            self.timers["recv_wait"] += t1 - t0
            self.timers["halo_total"] += t1 - pending[2]
        return pending[1]



#: (id(counts), id(displs), row) -> (counts, displs, their element vectors): Halo._elements
_SCALED = {}


def make_halo(comm, reduce_comm=None):
    """:class:`SerialHalo` for ``None`` or a size-1 communicator, else :class:`Halo`; norms are
    summed over ``reduce_comm`` (default: ``comm``)."""
    if comm is None or comm.Get_size() == 1:
        return SerialHalo(reduce_comm)
    return Halo(comm, reduce_comm)


def ping_pong(comm, send, recv, reps, tag=99):
    """Seconds of one message one way (round trip / 2) between ranks 0 and 1 of ``comm``:
    ``reps`` Send/Recv round trips of ``send`` (into ``recv``), timed on ranks 0 and 1; other
    ranks return 0.0 at once (no barrier here)."""
    rank = comm.Get_rank()
    if rank >= 2:
        return 0.0
    t0 = time.perf_counter()
    for _ in range(reps):
        if rank == 0:
            comm.Send(send, dest=1, tag=tag)
            comm.Recv(recv, source=1, tag=tag)
        else:
            comm.Recv(recv, source=0, tag=tag)
            comm.Send(send, dest=0, tag=tag)
    return (time.perf_counter() - t0) / (2 * reps)
