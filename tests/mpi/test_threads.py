"""Threads per rank (mgnn.comm.threads): the policy against a fake communicator and environment,
and real ``mpiexec -n 2`` runs with no thread variable set (Python API and CLI), where each rank
must end up with ``cores // ranks sharing them`` BLAS and Numba threads instead of one per core.

Also a script: ``python -m tests.mpi.test_threads api|cli|bad`` is what each rank runs.
"""
import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

import mgnn

try:
    from mgnn.comm import threads as th
except ImportError:  # so that the mpiexec runs show what older versions chose
    th = None

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS",
               "BLIS_NUM_THREADS", "NUMBA_NUM_THREADS")
try:
    import mpi4py  # noqa: F401
    HAVE_MPI = MPIEXEC is not None
except ImportError:
    HAVE_MPI = False


# ------------------------------------------------------------------ the policy, in one process
class FakeComm:
    """Rank 0 of ``len(masks)`` ranks on one node; rank r may run on the CPUs ``masks[r]``."""

    def __init__(self, masks):
        self.masks, self.split_kinds = [frozenset(m) for m in masks], []

    def Get_size(self):
        return len(self.masks)

    def Get_rank(self):
        return 0

    def allgather(self, obj):
        return [obj] * len(self.masks)

    def Split_type(self, kind):
        self.split_kinds.append(kind)
        return types.SimpleNamespace(allgather=lambda mine: list(self.masks), Free=lambda: None)


@pytest.fixture
def fake(monkeypatch):
    """A FakeComm factory; this process's thread limits are restored afterwards."""
    import numba
    import scipy.linalg.cython_blas  # noqa: F401 (its BLAS is limited too: restore it as well)
    from threadpoolctl import threadpool_limits
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(
        MPI=types.SimpleNamespace(COMM_TYPE_SHARED="shared")))

    def make(masks):
        monkeypatch.setattr(th, "affinity", lambda: set(masks[0]))
        return FakeComm(masks)
    n = numba.get_num_threads()
    with threadpool_limits(limits=None):  # restores every BLAS's count on exit
        yield make
    numba.set_num_threads(n)


def _blas_now():
    from threadpoolctl import threadpool_info
    return sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})


def _numba_expected(n):
    import numba
    return min(n, numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("masks, local, sharing, per_rank", [
    ([range(8)] * 2, 2, 2, 4),                     # unbound: 8 cores shared by 2 ranks
    ([range(8)] * 3, 3, 3, 2),                     # 8 // 3
    ([range(2)] * 4, 4, 4, 1),                     # more ranks than cores: at least 1
    ([{0, 1, 2}, {3, 4, 5}, {6, 7}], 3, 1, 3),     # bound to disjoint cores: each its own
])
def test_auto_divides_the_cores_among_the_ranks_sharing_them(fake, masks, local, sharing,
                                                             per_rank):
    comm = fake(masks)
    info = th.configure_threads(comm, "auto", environ={})
    assert comm.split_kinds == ["shared"]  # node-local ranks through COMM_TYPE_SHARED
    assert (info["local_ranks"], info["sharing"], info["cores"], info["per_rank"]) == \
        (local, sharing, len(masks[0]), per_rank)
    assert info["blas"] == 1 and _blas_now() == [1]  # small per-layer GEMMs: one BLAS thread
    assert info["numba"] == _numba_expected(per_rank)
    assert info["blas_source"].startswith("auto: 1")
    assert ("capped at NUMBA_NUM_THREADS" in info["numba_source"]) == \
        (per_rank > _numba_expected(per_rank))
    assert th.describe(info).startswith("threads per rank: BLAS 1 (auto: ")


def test_environment_settings_win_per_library(fake):
    comm = fake([range(4)] * 2)
    before = _blas_now()
    info = th.configure_threads(comm, "auto", environ={"OPENBLAS_NUM_THREADS": "3"})
    assert _blas_now() == before and info["blas_source"] == "OPENBLAS_NUM_THREADS=3 (openblas)"
    assert info["numba"] == _numba_expected(2) and info["numba_source"].startswith("auto")
    # OMP_NUM_THREADS: OpenBLAS reads it itself; Numba does not, so mgnn applies it
    info = th.configure_threads(comm, "auto", environ={"OMP_NUM_THREADS": "1,2"})
    assert info["blas_source"] == "OMP_NUM_THREADS=1,2 (openblas)" and _blas_now() == before
    assert info["numba"] == 1 and info["numba_source"] == "OMP_NUM_THREADS=1,2"
    # NUMBA_NUM_THREADS: Numba is left alone, BLAS automatic
    info = th.configure_threads(comm, "auto", environ={"NUMBA_NUM_THREADS": "1"})
    assert info["numba_source"] == "NUMBA_NUM_THREADS=1" and _blas_now() == [1]
    # MKL_NUM_THREADS does not govern OpenBLAS; unreadable or zero values count as unset
    for env in ({"MKL_NUM_THREADS": "1"}, {"OPENBLAS_NUM_THREADS": "x"},
                {"OPENBLAS_NUM_THREADS": "0"}):
        info = th.configure_threads(comm, "auto", environ=env)
        assert info["blas_source"].startswith("auto") and _blas_now() == [1], env


def test_explicit_argument_wins_and_none_changes_nothing(fake):
    comm = fake([range(4)] * 2)
    info = th.configure_threads(comm, 3, environ={"OPENBLAS_NUM_THREADS": "1",
                                                  "NUMBA_NUM_THREADS": "1"})
    assert info["blas"] == 3 and _blas_now() == [3] and info["blas_source"] == "threads=3"
    assert info["numba"] == _numba_expected(3) and info["per_rank"] is None
    info = th.configure_threads(comm, None, environ={})
    assert _blas_now() == [3] and info["blas"] == 3
    assert info["blas_source"] == info["numba_source"] == "unchanged, threads=None"


def test_single_process_gets_its_cores_for_numba_and_one_blas_thread(fake):
    """A single process too: BLAS threads slow mgnn's small per-layer GEMMs down (and
    oversubscribe inside Numba's parallel loops); Numba gets the process's cores."""
    fake([range(4)])
    for comm in (None, FakeComm([range(4)])):
        info = th.configure_threads(comm, "auto", environ={})
        assert _blas_now() == [1] and info["per_rank"] == 4
        assert info["numba"] == _numba_expected(4)
        assert info["blas_source"].startswith("auto: 1")


def test_each_model_puts_its_thread_counts_back(fake):
    """Thread counts are process-wide: a model built later (here with 2 threads, as a
    single-process evaluation model or a study's serial baseline gets the node's cores) must not
    leave its counts to an earlier one: every step re-applies the model's own."""
    fake([range(4)])
    x, y = np.ones((3, 4)), np.array([0, 1, 0])
    first = mgnn.LayerParallel(mgnn.dense_resnet(4, 4, 2, 4), threads=1)
    assert _blas_now() == [1]
    second = mgnn.LayerParallel(mgnn.dense_resnet(4, 4, 2, 4), threads=2)
    import numba
    assert numba.get_num_threads() == _numba_expected(2) and _blas_now() == [2]
    first.loss_and_grad(x, y)
    assert numba.get_num_threads() == 1 and _blas_now() == [1]
    second.predict(x)
    assert numba.get_num_threads() == _numba_expected(2) and _blas_now() == [2]
    untouched = mgnn.LayerParallel(mgnn.dense_resnet(4, 4, 2, 4), threads=None)
    untouched.loss_and_grad(x, y)  # threads=None: leaves whatever is set
    assert numba.get_num_threads() == _numba_expected(2) and _blas_now() == [2]


@pytest.mark.parametrize("bad, exc", [("many", TypeError), (0, ValueError), (2.0, TypeError),
                                      (True, TypeError)])
def test_bad_threads_raise_naming_the_value(fake, bad, exc):
    with pytest.raises(exc, match=f"threads must be None, 'auto' or an int >= 1, got {bad!r}"):
        th.configure_threads(fake([range(2)] * 2), bad)
    with pytest.raises(exc, match="threads must be"):
        mgnn.LayerParallel(mgnn.dense_resnet(4, 4, 2, 2), threads=bad)


def test_stats_always_report_the_threads():
    model = mgnn.dense_resnet(4, 4, 2, 4)
    lp = mgnn.LayerParallel(model, fwd=mgnn.MGRITOptions(cf=2, max_levels=2, max_iter=1),
                            backend="numpy")
    assert lp.stats["threads"] is lp.threads
    assert lp.threads["blas_source"].startswith("auto: 1")
    x, y = np.ones((3, 4)), np.array([0, 1, 0])
    lp.loss_and_grad(x, y)
    assert lp.stats["threads"] is lp.threads and "forward" in lp.stats
    from mgnn.studies.pipeline import PipelineParallel
    pp = PipelineParallel(model, backend="numpy")
    pp.loss_and_grad(x, y)
    assert "timings" in pp.stats and pp.stats["threads"] is pp.threads


# ------------------------------------------------------------------ real mpiexec runs
def _mpirun(n, case, env_extra=None, timeout=180):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(PYTHONPATH=REPO, **(env_extra or {}))
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, "-m", "tests.mpi.test_threads",
                           case], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _ranks(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("[")][-1])


def _check_auto(rank, numba_auto=True, blas_auto=True):
    mine = set(rank["affinity"])
    sharing = sum(1 for m in rank["all_affinities"] if mine & set(m))
    want = max(1, len(mine) // sharing)
    if blas_auto:  # one BLAS thread: mgnn's per-layer GEMMs are small
        assert rank["blas_now"] == [1], rank
        assert rank["stats"]["blas"] == 1
    if numba_auto:
        assert rank["numba_now"] == min(want, rank["numba_max"]), rank
        assert rank["stats"]["numba"] == rank["numba_now"]
    assert rank["stats"]["local_ranks"] == len(rank["all_affinities"])


mpi = pytest.mark.skipif(not HAVE_MPI, reason="mpi4py/mpiexec not installed")


@mpi
@pytest.mark.mpi
@pytest.mark.parametrize("case", ["api", "cli"])
def test_two_ranks_without_thread_variables_do_not_oversubscribe(case):
    ranks = _ranks(_mpirun(2, case))
    assert len(ranks) == 2
    for rank in ranks:
        _check_auto(rank)


@mpi
@pytest.mark.mpi
def test_two_ranks_honour_a_thread_variable():
    ranks = _ranks(_mpirun(2, "api", {"OPENBLAS_NUM_THREADS": "2"}))
    for rank in ranks:
        assert rank["blas_now"] == [2] and rank["stats"]["blas_source"] == \
            "OPENBLAS_NUM_THREADS=2 (openblas)"
        _check_auto(rank, blas_auto=False)


@mpi
@pytest.mark.mpi
def test_bad_threads_on_one_rank_raise_on_every_rank():
    ranks = _ranks(_mpirun(2, "bad", timeout=120))
    msg = "ValueError: {}threads must be None, 'auto' or an int >= 1, got 0"
    assert ranks == [msg.format("rank 1: "), msg.format("")]


# ------------------------------------------------------------------ what each rank runs
def _report(comm, lp):
    import numba
    from threadpoolctl import threadpool_info
    mine = sorted(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else
                  range(os.cpu_count() or 1))
    row = {"stats": lp.stats.get("threads"), "affinity": mine,
           "blas_now": sorted({i["num_threads"] for i in threadpool_info()
                               if i["user_api"] == "blas"}),
           "numba_now": numba.get_num_threads(), "numba_max": numba.config.NUMBA_NUM_THREADS}
    rows = comm.allgather(row)
    for r in rows:
        r["all_affinities"] = [x["affinity"] for x in rows]  # one node in these tests
    if comm.Get_rank() == 0:
        print(json.dumps(rows), flush=True)


def _main(case):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if case == "bad":
        try:
            mgnn.LayerParallel(mgnn.dense_resnet(4, 4, 2, 4), comm=comm,
                               threads=0 if comm.Get_rank() == 1 else "auto")
        except ValueError as exc:
            msgs = comm.allgather(f"ValueError: {exc}")
            if comm.Get_rank() == 0:
                print(json.dumps(msgs), flush=True)
        return
    captured = {}
    if case == "cli":  # the CLI's LayerParallel, kept to report on it after training
        real = mgnn.LayerParallel

        class Spy(real):  # the first one: rank 0 also builds a serial replica to compile
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                captured.setdefault("lp", self)
        mgnn.LayerParallel = Spy
        from mgnn.__main__ import main
        rc = main(["train", "--data", "digits", "--layers", "8", "--width", "8", "--epochs", "1",
                   "--limit-train", "64", "--limit-test", "32", "--levels", "2", "--cf", "2",
                   "--dtype", "float64",
                   "--no-progress", "--seed", "1"])
        assert rc == 0
        lp = captured["lp"]
    else:  # the README's Python API
        model = mgnn.dense_resnet(16, 16, 4, 8)
        opts = mgnn.MGRITOptions(cf=2, max_levels=2, max_iter=1)
        lp = mgnn.LayerParallel(model, fwd=opts, bwd=opts, comm=comm)
        rng = np.random.default_rng(comm.Get_rank())
        lp.loss_and_grad(rng.standard_normal((8, 16)), rng.integers(0, 4, 8))
    _report(comm, lp)


if __name__ == "__main__":
    _main(sys.argv[1])
