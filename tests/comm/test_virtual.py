"""Virtual MPI ranks (mgnn.comm.virtual): scheduler, matching, collectives, clocks, failures, and
mgnn's real distributed code on virtual ranks equal to ``mpiexec`` bit for bit."""
import io
import json
import pickle
import sys
import time
from contextlib import redirect_stdout

import numpy as np
import pytest
from mpi4py import MPI

from mgnn import MGRITOptions, MGRITSolver
from mgnn.comm import layout
from mgnn.comm.virtual import (Network, VirtualAbort, VirtualComm, VirtualDeadlock, VirtualStop,
                               VirtualTimeout, charge, current_comm, module_copy, run_virtual)
from tests.comm.virtual_cases import everything, flatten
from tests.mpi.mpi_cases import Tanh
from tests.mpi.test_mpi import HAVE_MPI, mpirun

# a scheduler bug fails fast instead of hanging the suite; generous enough for the first
# (cold-cache) Numba compiles the case programs trigger, e.g. the captured-cycle interpreters
GUARD = pytest.mark.timeout(300)


class ChargedTanh(Tanh):
    """Tanh that charges its rank 1 ms per fine step times (level + 1)."""

    def __init__(self, n, comm):
        super().__init__(n)
        self.comm = comm

    def step(self, u, start, stop, level):
        self.comm.charge(1e-3 * (stop - start) * (level + 1))
        return super().step(u, start, stop, level)


def _solve_charged(comm, jitter_seed=None):
    """A charged MGRIT solve; optional wall-clock jitter between steps (must not matter)."""
    rng = None if jitter_seed is None else np.random.default_rng(jitter_seed + comm.Get_rank())
    prop = ChargedTanh(24, comm)
    if rng is not None:
        plain = prop.step

        def step(u, start, stop, level):
            time.sleep(float(rng.uniform(0, 2e-3)))
            return plain(u, start, stop, level)
        prop.step = step
    opts = MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=2)
    res = MGRITSolver(prop, 24, opts, comm=comm).solve(np.ones((2, 3)))
    return res.residuals, [s for s in res.states if s is not None], comm.clock


@GUARD
def test_same_run_twice_is_identical_including_clocks_and_traces():
    runs = [run_virtual(3, _solve_charged, jitter, network=Network(2e-4, 1e7), trace=True)
            for jitter in (None, 1, 2)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a[0] == b[0] and a[2] == b[2]
            assert all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))
        assert [s.as_dict() for s in other.stats] == [s.as_dict() for s in runs[0].stats]
        assert [s.events for s in other.stats] == [s.events for s in runs[0].stats]
    stats = runs[0].stats
    assert all(s.compute_s > 0 and s.message_s > 0 and s.collectives > 0 for s in stats)
    assert sum(s.sent_bytes for s in stats) == sum(s.recv_bytes for s in stats) > 0
    for s in stats:  # the clock is compute + waiting + messages, and the trace covers it
        assert s.clock == pytest.approx(s.compute_s + s.wait_s + s.message_s, rel=1e-12)
        for kind, total in (("compute", s.compute_s), ("wait", s.wait_s),
                            ("message", s.message_s)):
            assert sum(t1 - t0 for k, t0, t1, _ in s.events if k == kind) == \
                pytest.approx(total, rel=1e-9, abs=1e-15)
    assert runs[0].time == max(s.clock for s in stats)


@GUARD
def test_ping_pong_clock_arithmetic_by_hand():
    """alpha = 1 ms, beta = 1 MB/s: 1000 bytes cost 2 ms, 8 bytes 1.008 ms."""
    def ping_pong(comm):
        buf = np.zeros(125)
        if comm.Get_rank() == 0:
            comm.charge(0.5)
            comm.Send(buf, dest=1, tag=1)          # arrives at 0.502
            comm.Recv(buf[:1], source=1, tag=2)    # sent at 0.602: arrives at 0.603008
        else:
            comm.charge(0.2)
            comm.Recv(buf, source=0, tag=1)        # blocked 0.2 -> 0.502
            comm.charge(0.1)
            comm.Send(buf[:1], dest=0, tag=2)
        after_p2p = comm.clock
        comm.Barrier()                             # max(0.603008, 0.602) + 1 alpha
        after_barrier = comm.clock
        comm.allreduce(0.0)                        # pickled float: n bytes, 1 step
        return after_p2p, after_barrier, comm.clock
    res = run_virtual(2, ping_pong, network=Network(alpha=1e-3, beta=1e6))
    assert res[0][0] == pytest.approx(0.603008, abs=1e-15)
    assert res[1][0] == pytest.approx(0.602, abs=1e-15)
    assert res[0][1] == res[1][1] == pytest.approx(0.604008, abs=1e-15)
    n = len(pickle.dumps(0.0, pickle.HIGHEST_PROTOCOL))
    assert res[0][2] == res[1][2] == pytest.approx(0.604008 + 1e-3 + n / 1e6, abs=1e-15)
    s0, s1 = res.stats
    assert (s0.compute_s, s1.compute_s) == (0.5, pytest.approx(0.3))
    # rank 0 blocked 0.5 -> 0.603008: the last 1.008 ms is the message, the rest waiting
    assert s0.message_s == pytest.approx(1.008e-3 + 1e-3 + 1e-3 + n / 1e6)
    assert s0.wait_s == pytest.approx(0.603008 - 0.5 - 1.008e-3)
    assert s1.message_s == pytest.approx(2e-3 + 1e-3 + 1e-3 + n / 1e6)
    assert s1.wait_s == pytest.approx(0.3 + 1.008e-3)
    assert (s0.sent_bytes, s0.recv_bytes, s1.sent_bytes, s1.recv_bytes) == (1000, 8, 8, 1000)
    assert s0.collectives == s1.collectives == 2


@GUARD
def test_matching_by_source_and_tag_in_send_order_with_copies_at_send():
    def program(comm):
        r = comm.Get_rank()
        if r == 0:
            a = np.array([1.0])
            reqs = [comm.Isend(a, dest=2, tag=1)]
            a[0] = 2.0  # the receiver must see 1.0: copied at Isend
            reqs.append(comm.Isend(a, dest=2, tag=2))
            a[0] = 3.0
            reqs.append(comm.Isend([a, MPI.DOUBLE], dest=2, tag=1))
            for q in reqs:
                q.Wait()
            return None
        if r == 1:
            comm.charge(1.0)  # sends late: rank 2's receive is posted before
            comm.Send(np.array([10.0]), dest=2, tag=1)
            return None
        got = {}
        early = np.zeros(1)
        from_1 = comm.Irecv(early, source=1, tag=1)  # posted before rank 1 sends
        for name, src, tag in (("tag2", 0, 2), ("first", 0, 1), ("second", 0, 1)):
            b = np.zeros(1)
            comm.Recv([b, MPI.DOUBLE], source=src, tag=tag)
            got[name] = b[0]
        from_1.Wait()
        got["from1"] = early[0]
        return got
    res = run_virtual(3, program)
    assert res[2] == {"tag2": 2.0, "first": 1.0, "second": 3.0, "from1": 10.0}


@GUARD
def test_test_polls_without_spinning_and_counts_the_clock():
    def program(comm):
        if comm.Get_rank() == 0:
            comm.Recv(np.zeros(1), source=1, tag=9)  # rank 1 runs first and blocks in Test
            comm.charge(1.0)
            comm.Isend(np.array([7.0]), dest=1, tag=5).Wait()
            return None
        b = np.zeros(1)
        req = comm.Irecv(b, source=0, tag=5)
        comm.Send(np.zeros(1), dest=0, tag=9)
        polls = 0
        while not req.Test():
            polls += 1
        return polls, b[0], comm.clock, req.Test()
    polls, value, clock, again = run_virtual(2, program, network=Network(0.5, np.inf))[1]
    assert (polls, value, again) == (1, 7.0, True)
    assert clock == 0.5 + 1.0 + 0.5  # ping to rank 0, its compute, the message back


@GUARD
def test_collective_values_and_reduction_orders():
    def program(comm):
        r, P = comm.Get_rank(), comm.Get_size()
        out = {}
        x = np.array([float(r), -float(r)])
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.MAX)
        out["max"] = x.tolist()
        y = np.empty(2)
        comm.Allreduce(np.array([r, 1.0]), y, op=MPI.SUM)
        out["sum"] = y.tolist()
        z = np.array([r + 1.0])
        comm.Iallreduce(MPI.IN_PLACE, z, op=MPI.PROD).Wait()
        out["prod"] = z[0]
        # values whose sum depends on the order (see the module docstring at P = 5)
        v = np.array([[1.0], [1.0], [1e16], [-1e16], [1.0]][r])
        comm.Allreduce(MPI.IN_PLACE, v)
        out["order_typed"] = v[0]
        out["order_pickled"] = comm.allreduce([1.0, 1.0, 1e16, -1e16, 1.0][r])
        out["concat"] = comm.allreduce([r])  # op(lower ranks, higher ranks)
        rows = np.full((r + 1, 2), float(r))
        counts = [2 * (i + 1) for i in range(P)]
        displs = list(np.cumsum([0] + counts[:-1]))
        recv = np.zeros((sum(counts) // 2, 2))
        comm.Iallgatherv([rows, MPI.DOUBLE], [recv, (counts, displs), MPI.DOUBLE]).Wait()
        out["allgatherv"] = recv[:, 0].tolist()
        g = np.empty((P, 2))
        comm.Allgather(np.array([r, 2.0 * r]), g)
        out["allgather"] = g.tolist()
        b = np.array([float(r)] * 3)
        comm.Bcast(b, root=3)
        out["Bcast"] = b.tolist()
        obj = {"rank": r}
        out["bcast"] = comm.bcast(obj if r == 1 else None, root=1)
        out["gather"] = comm.gather(r * r, root=2)
        out["allgather_obj"] = comm.allgather(("r", r))
        comm.Barrier()
        comm.Ibarrier().Wait()
        return out
    res = run_virtual(5, program)
    for r, out in enumerate(res):
        assert out["max"] == [4.0, 0.0] and out["sum"] == [10.0, 5.0] and out["prod"] == 120.0
        # MPICH: ((v0 + v1) + v2) + (v3 + v4) = 2; mpi4py: ((v0 + v1) + (v2 + v3)) + v4 = 3
        assert out["order_typed"] == 2.0 and out["order_pickled"] == 3.0
        assert out["concat"] == [0, 1, 2, 3, 4]
        assert out["allgatherv"] == [i for i in range(5) for _ in range(i + 1)]
        assert out["allgather"] == [[i, 2.0 * i] for i in range(5)]
        assert out["Bcast"] == [3.0] * 3 and out["bcast"] == {"rank": 1}
        assert out["gather"] == ([0, 1, 4, 9, 16] if r == 2 else None)
        assert out["allgather_obj"] == [("r", i) for i in range(5)]
    assert res[0]["bcast"] is not res[1]["bcast"]  # every rank gets its own copy


@GUARD
def test_split_and_dup_give_isolated_contexts():
    def program(comm):
        r = comm.Get_rank()
        dup = comm.Dup()
        if r == 0:  # the same source and tag on two contexts: each receive gets its own
            dup.Send(np.array([1.0]), dest=1, tag=4)
            comm.Send(np.array([2.0]), dest=1, tag=4)
        elif r == 1:
            a, b = np.zeros(1), np.zeros(1)
            comm.Recv(a, source=0, tag=4)
            dup.Recv(b, source=0, tag=4)
            assert (a[0], b[0]) == (2.0, 1.0)
        half = comm.Split(color=r % 2, key=-r)  # key reverses the order
        total = half.allreduce(r)
        rest = comm.Split(MPI.UNDEFINED if r == 3 else 0, key=r)
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
        out = (half.Get_size(), half.Get_rank(), total, rest is MPI.COMM_NULL,
               shared.Get_size(), isinstance(dup, VirtualComm))
        shared.Free()
        with pytest.raises(ValueError, match="freed"):
            shared.Barrier()
        return out
    res = run_virtual(4, program)
    assert res == [(2, 1, 2, False, 4, True), (2, 1, 4, False, 4, True),
                   (2, 0, 2, False, 4, True), (2, 0, 4, True, 4, True)]


@GUARD
def test_deadlock_is_an_error_naming_every_blocked_rank():
    def lonely(comm):
        if comm.Get_rank() == 1:
            comm.Recv(np.zeros(1), source=0, tag=7)  # rank 0 never sends
    t0 = time.perf_counter()
    with pytest.raises(VirtualDeadlock) as info:
        run_virtual(2, lonely, timeout_s=30)
    assert time.perf_counter() - t0 < 10
    assert "rank 1 waits for a message from rank 0" in str(info.value)
    assert "tag 7" in str(info.value) and "rank 0 has ended" in str(info.value)
    assert list(info.value.blocked) == [1]

    def cycle(comm):
        r = comm.Get_rank()
        if r < 2:
            comm.Recv(np.zeros(1), source=1 - r, tag=3)
        else:
            comm.Barrier()
    with pytest.raises(VirtualDeadlock) as info:
        run_virtual(3, cycle, timeout_s=30)
    msg = str(info.value)
    assert list(info.value.blocked) == [0, 1, 2]
    assert "rank 0 waits for a message from rank 1" in msg
    assert "rank 1 waits for a message from rank 0" in msg
    assert "rank 2 waits for Barrier" in msg and "not yet: ranks [0, 1]" in msg


@GUARD
def test_exception_on_one_rank_ends_all_and_is_reraised_naming_the_rank():
    seen = {}

    def program(comm):
        r = comm.Get_rank()
        try:
            if r == 2:  # blocks first, so every rank has started when it raises
                comm.Recv(np.zeros(1), source=3, tag=0)
                raise RuntimeError("boom")
            if r == 3:
                comm.charge(1.0)
                comm.Send(np.zeros(1), dest=2, tag=0)
            comm.Barrier()
        except BaseException as exc:
            seen[r] = exc
            raise
    with pytest.raises(RuntimeError, match="boom") as info:
        run_virtual(4, program, timeout_s=30)
    assert "virtual rank 2 of 4" in "".join(info.value.__notes__)
    assert sorted(seen) == [0, 1, 2, 3]
    for r in (0, 1, 3):
        assert isinstance(seen[r], VirtualStop)
        assert "rank 2 raised RuntimeError: boom" in str(seen[r])


@GUARD
def test_abort_ends_every_rank_naming_the_rank_and_the_error():
    def program(comm):
        if comm.Get_rank() == 1:
            try:
                raise ValueError("bad shard")
            except ValueError:
                comm.Abort(3)
        comm.Barrier()
    with pytest.raises(VirtualAbort, match=r"virtual rank 1 called Abort\(3\) while handling "
                                           r"ValueError: bad shard") as info:
        run_virtual(3, program, timeout_s=30)
    assert (info.value.rank, info.value.errorcode) == (1, 3)
    assert isinstance(info.value.__cause__, ValueError)


@GUARD
def test_timeout_ends_a_run_that_never_blocks():
    def forever(comm):
        while True:
            comm.charge(1.0)
    with pytest.raises(VirtualTimeout, match="timeout of 0.5 s"):
        run_virtual(2, forever, timeout_s=0.5)


def test_bad_input_and_misuse_raise_naming_the_value():
    with pytest.raises(ValueError, match="size must be an int >= 1, got 0"):
        run_virtual(0, lambda comm: None)
    with pytest.raises(ValueError, match="alpha"):
        Network(alpha=-1.0)
    with pytest.raises(ValueError, match="beta"):
        Network(beta=0.0)
    with pytest.raises(RuntimeError, match="outside a virtual rank"):
        charge(1.0)
    assert current_comm() is None

    def misuse(comm, what):
        r = comm.Get_rank()
        if what == "dest":
            comm.Isend(np.zeros(1), dest=5, tag=0)
        elif what == "wildcard":
            comm.Irecv(np.zeros(1), source=0, tag=MPI.ANY_TAG)
        elif what == "strided":
            comm.Isend(np.zeros((4, 4))[:, 0], dest=0)
        elif what == "charge":
            current_comm().charge(-1.0)
        elif what == "truncated":
            if r == 0:
                comm.Send(np.zeros(4), dest=1, tag=1)
            else:
                comm.Recv(np.zeros(2), source=0, tag=1)
        elif what == "mismatch":
            if r == 0:
                comm.Barrier()
            else:
                comm.Bcast(np.zeros(1), root=0)
        elif what == "shared":
            if r == 0:
                shared.append(comm)
            else:
                comm.Barrier()
                shared[0].Barrier()
            comm.Barrier()
    shared = []
    for what, kind, pattern in (
            ("dest", ValueError, r"rank 5 is not in 0\.\.1"),
            ("wildcard", ValueError, "tag must be an int >= 0, got -1"),
            ("strided", BufferError, "not C-contiguous"),
            ("charge", ValueError, "seconds must be a finite number >= 0, got -1.0"),
            ("truncated", ValueError, "32 bytes received into a buffer of 16 bytes"),
            ("mismatch", ValueError, "collective mismatch on comm 0 .world.: rank 1 called "
                                     r"Bcast \(root 0\) where rank 0 called Barrier"),
            ("shared", RuntimeError, "communicator of virtual rank 0 was used while rank 1")):
        with pytest.raises(kind, match=pattern):
            run_virtual(2, misuse, what, timeout_s=30)


def _run_mpi_case(module, case, size, *argv):
    """``python -m tests.mpi.MODULE CASE *argv`` (an MPI case program of tests/mpi) on ``size``
    virtual ranks: a private copy of the module per rank with COMM/RANK/SIZE replaced, ``case``
    called as its ``__main__`` does; returns rank 0's JSON line."""
    def program(comm):
        import numba
        numba.set_num_threads(1)  # as under mpiexec (NUMBA_NUM_THREADS=1)
        cases = module_copy(f"tests.mpi.{module}", COMM=comm, RANK=comm.Get_rank(),
                            SIZE=comm.Get_size())
        fn = getattr(cases, f"case_{case}")
        fn(*argv) if module == "device_cases" else fn()
    saved, out = sys.argv, io.StringIO()
    sys.argv = [module, case, *argv]
    try:
        with redirect_stdout(out):
            # (the timeout includes Numba's compiles on a cold cache: the network case alone
            # compiles ~2.3 min of kernels on a 2-core VM; deadlocks are caught by the scheduler)
            run_virtual(size, program, timeout_s=600)
    finally:
        sys.argv = saved
    return json.loads(out.getvalue().strip().splitlines()[-1])


@GUARD
@pytest.mark.parametrize("module, case, size, argv, check", [
    ("mpi_cases", "solver", 3, (), lambda out: out["configs"] > 100),
    ("mpi_cases", "spatial", 3, (), lambda out: out["configs"] == 16),
    ("mpi_cases", "reference", 2, (), lambda out: out["cases"] >= 3),
    # 2 x 1 here (4 virtual ranks in one process redo the single-process reference four
    # times: ~120 s on a slow 2-core VM); tests/mpi runs the 2 x 2 case under mpiexec
    ("mpi_cases", "network", 2, ("1",), lambda out: out["checked"] == 14),
    ("mpi_cases", "composed", 2, ("1",), lambda out: out["checked"] == 16),
    ("mpi_cases", "recurrent", 3, ("1",), lambda out: out["checked"] == 8),
    ("mpi_cases", "bad_input", 3, (), lambda out: "rank 2" in out["message"]),
    ("mpi_cases", "robustness", 3, (), lambda out: out["ranks"] == 3),
    ("mpi_cases", "pipeline", 4, ("2",), lambda out: out["checked"] >= 4),
    ("contract_cases", "inplace", 3, (), lambda out: out["checked"] == 25 and
     out["converged_warned"] == [[False, 1], [False, 0], [False, 0]]),
    ("device_cases", "shim", 2, ("staged",), lambda out: out["received"] == 54 and
     out["staging_s"] > 0 and out["pinned"] > 0),
    ("device_cases", "shim", 2, ("cuda-aware",), lambda out: out["received"] == 54 and
     out["staging_s"] == 0 and out["pinned"] == 0),
])
def test_mpi_case_programs_on_virtual_ranks(module, case, size, argv, check):
    """The case programs of tests/mpi (one parametrisation each), unchanged, on the virtual
    communicator, with the checks tests/mpi makes of their output (the failing cases: the
    next test)."""
    out = _run_mpi_case(module, case, size, *argv)
    assert check(out), out


@GUARD
@pytest.mark.parametrize("module, case, argv, error, pattern, rank", [
    ("mpi_cases", "fail", (), RuntimeError, "user propagator failed at step", 2),
    ("contract_cases", "bad", ("2",), TypeError, r"level=2\)", None),
])
def test_failure_inside_the_solver_ends_fast_and_installs_no_hook(module, case, argv, error,
                                                                  pattern, rank):
    """The failing MPI case programs: MGRITSolver's abort_on_error / abort_on_uncaught leave
    virtual communicators alone (no report-sleep-Abort, no sys.excepthook); the original error
    comes back from the rank that raised it first."""
    hook, registered = sys.excepthook, list(layout._UNCAUGHT)
    t0 = time.perf_counter()
    with pytest.raises(error, match=pattern) as info:
        _run_mpi_case(module, case, 3, *argv)
    assert time.perf_counter() - t0 < 10
    note = "".join(info.value.__notes__)
    assert "of 3 (mgnn.comm.virtual)" in note and (rank is None or f"rank {rank} " in note)
    assert sys.excepthook is hook and layout._UNCAUGHT == registered


def _virtual_everything(comm):
    import numba
    numba.set_num_threads(1)  # as under mpiexec (NUMBA_NUM_THREADS=1)
    return everything(comm)


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_MPI, reason="mpi4py/mpiexec not installed")
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_virtual_ranks_equal_mpiexec_bit_for_bit(ranks, tmp_path):
    """MGRIT solves (5 propagator kinds x 3 cycle settings) and a LayerParallel training step
    (dense, conv, conv with spatial coarsening; both coarsest-level solves; at P = 4 also on a
    2 x 2 layer x data grid):
    every residual history, state, loss, gradient and update equal (np.array_equal)."""
    path = tmp_path / "real.npz"
    proc = mpirun(ranks, "-m", "tests.comm.virtual_cases", str(path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = dict(np.load(path))
    virtual = flatten(run_virtual(ranks, _virtual_everything, timeout_s=120))
    assert sorted(virtual) == sorted(real)
    assert sum(k.endswith("/gathered") for k in real) == ranks * (12 if ranks == 4 else 6)
    different = [k for k in real if not np.array_equal(real[k], virtual[k])]
    assert not different, different[:10]


@GUARD
def test_many_ranks_equal_the_serial_solve():
    """64 virtual ranks (uneven blocks, 3 levels): residuals and states of the serial solve."""
    n, opts = 150, MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=2)
    u0 = np.ones((2, 3))
    serial = MGRITSolver(Tanh(n), n, opts).solve(u0)

    def program(comm):
        res = MGRITSolver(Tanh(n), n, opts, comm=comm).solve(u0)
        return res.residuals, {i: s for i, s in enumerate(res.states) if s is not None}
    res = run_virtual(64, program, timeout_s=50)
    owned = {}
    for residuals, states in res:
        np.testing.assert_allclose(residuals, serial.residuals, rtol=1e-12)
        owned.update(states)
    assert sorted(owned) == list(range(n + 1))
    for i, s in owned.items():
        np.testing.assert_allclose(s, serial.states[i], rtol=1e-12, atol=1e-14)


@GUARD
def test_allgatherv_vectors_changed_in_place_are_read_again():
    """The checks of an Allgatherv's (counts, displs) are kept by their contents: vectors a
    caller changes in place between calls place the parts anew and are checked anew."""
    def program(comm):
        counts, displs = np.array([2, 2]), np.array([0, 2])
        send = np.full(2, float(comm.Get_rank() + 1))
        out = []
        for d in ([0, 2], [2, 0]):
            displs[:] = d
            recv = np.zeros(4)
            comm.Allgatherv([send, MPI.DOUBLE], [recv, (counts, displs), MPI.DOUBLE])
            out.append(recv.tolist())
        displs[:] = [0, 9]
        try:
            comm.Allgatherv([send, MPI.DOUBLE], [np.zeros(4), (counts, displs), MPI.DOUBLE])
        except ValueError as exc:
            out.append(str(exc))
        return out
    res = run_virtual(2, program)
    for got in res:
        assert got[0] == [1.0, 1.0, 2.0, 2.0] and got[1] == [2.0, 2.0, 1.0, 1.0]
        assert "displacement 9 exceeds the receive buffer" in got[2]



def test_halo_element_vectors_kept_only_for_tuples():
    """Halo._elements keeps the scaled vectors of tuples (immutable; read-only arrays) and
    scales arrays a caller may change in place afresh at every call."""
    from mgnn.comm.halo import Halo
    counts, displs = (1, 2), (0, 1)
    a = Halo._elements(counts, displs, 3)
    assert Halo._elements(counts, displs, 3) is a and not a[0].flags.writeable
    assert a[0].tolist() == [3, 6] and a[1].tolist() == [0, 3]
    c, d = np.array([1, 2]), np.array([0, 1])
    assert Halo._elements(c, d, 3)[0].tolist() == [3, 6]
    c[:] = [2, 2]
    assert Halo._elements(c, d, 3)[0].tolist() == [6, 6]
