"""One BLAS thread inside Numba's parallel dense drivers (np.dot in every Numba thread), the
process's BLAS counts untouched outside them."""
import numpy as np
import pytest

import mgnn.backend.numba_cpu as nb
from mgnn.backend.blas_threads import blas_controllers, one_blas_thread


@pytest.fixture
def two_blas_threads():
    """Every loaded BLAS (Numba's SciPy one included) at 2 threads; the counts put back after."""
    ctls = blas_controllers(True)
    assert ctls, "no BLAS found: threadpoolctl should see NumPy's and SciPy's"
    before = [(c, c.num_threads) for c in ctls]
    for c in ctls:
        c.set_num_threads(2)
    if max(c.num_threads for c in ctls) < 2:
        pytest.skip("this BLAS build runs one thread only")
    yield ctls
    for c, n in before:
        c.set_num_threads(n)


def _most(ctls):
    return max(c.num_threads for c in ctls)


def test_one_blas_thread_lowers_and_restores(two_blas_threads):
    counts = [c.num_threads for c in two_blas_threads]
    with one_blas_thread():
        assert _most(two_blas_threads) == 1
    assert [c.num_threads for c in two_blas_threads] == counts
    with pytest.raises(RuntimeError, match="inside"):
        with one_blas_thread():
            raise RuntimeError("inside")
    assert [c.num_threads for c in two_blas_threads] == counts  # restored on an exception too


def _recording(seen, name):
    def driver(*args):
        seen.append((name, _most(blas_controllers())))
        return 0.0
    return driver


def test_parallel_dense_drivers_run_with_one_blas_thread(two_blas_threads, monkeypatch):
    """The stacked kernels' and the tape's prange drivers see one BLAS thread, and so does
    every conv driver (its per-sample GEMMs: no oversubscription, bits independent of the BLAS
    count); the serial dense drivers see the process's count."""
    seen = []
    drivers = {key: (_recording(seen, f"{key[0]} serial"), _recording(seen, f"{key[0]} par"))
               for key in nb._DRIVERS}
    monkeypatch.setattr(nb.stacked, "_DRIVERS", drivers)  # where the drivers are looked up
    monkeypatch.setattr(nb.tapes, "_tape", _recording(seen, "tape serial"))
    monkeypatch.setattr(nb.tapes, "_tape_par", _recording(seen, "tape par"))
    U = np.zeros((4, 2, 3), np.float32)
    idx, outs = np.array([[1, 1], [2, 1]]), np.zeros(0, np.int64)
    for kind in ("dense", "conv"):
        for parallel in (True, False):
            nb._run(kind, False, U, None, None, None, None, 0, idx, outs, 1, 1, None, 0, 2,
                    parallel)
    W, hs = np.zeros((1, 3, 3), np.float32), np.zeros(1, np.float32)
    for parallel in (True, False):
        nb._run_tape("dense", [U], None, hs, W, np.zeros((1, 3), np.float32), 0, 0, False,
                     np.zeros(1), parallel)
    assert seen == [("dense par", 1), ("dense serial", 2), ("conv par", 1), ("conv serial", 1),
                    ("tape par", 1), ("tape serial", 2)]
    assert _most(two_blas_threads) == 2


def test_solve_context_holds_one_blas_thread_while_numba_threads_run(two_blas_threads):
    """mgnn's propagators' solve context (numba backend, more than one Numba thread): one BLAS
    thread for the whole solve; with one Numba thread, or a backend that calls no BLAS from
    Numba's threads, the counts stay as the process set them."""
    import numba

    from mgnn.backend import get_backend
    from mgnn.backend.blas_threads import solve_blas_context
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("Numba was started with one thread (NUMBA_NUM_THREADS=1)")
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        with solve_blas_context(get_backend("numba")):
            assert _most(two_blas_threads) == 1
        assert _most(two_blas_threads) == 2
        with solve_blas_context(get_backend("numpy")):
            assert _most(two_blas_threads) == 2
        numba.set_num_threads(1)
        with solve_blas_context(get_backend("numba")):
            assert _most(two_blas_threads) == 2
    finally:
        numba.set_num_threads(before)


_FRESH = """
import sys
from mgnn.backend.blas_threads import blas_controllers, one_blas_thread
assert "scipy.linalg.cython_blas" not in sys.modules  # Numba loads it at its first np.dot
with one_blas_thread():
    scipy_blas = [c for c in blas_controllers() if "scipy" in c.filepath]
    assert scipy_blas and all(c.num_threads == 1 for c in scipy_blas), scipy_blas
print("OK")
"""


def test_one_blas_thread_finds_numbas_blas_in_a_fresh_process():
    """In a fresh process, before Numba's first np.dot has imported SciPy's cython_blas, the
    BLAS that np.dot will call is among those the context limits (it loads that module before
    it scans, in case nothing else has loaded the library yet)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")}
    res = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "OK", res.stdout + res.stderr


def test_mgnn_propagators_hold_one_blas_thread_in_dense_stacked_solves(two_blas_threads):
    """ForwardPropagator / AdjointPropagator on the numba backend: a dense or conv stacked solve
    holds one BLAS thread (with more than one Numba thread); the numpy backend not."""
    import numba

    import mgnn
    from mgnn.backend import get_backend
    from mgnn.network import AdjointPropagator, ForwardPropagator
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("Numba was started with one thread (NUMBA_NUM_THREADS=1)")
    dense = mgnn.dense_resnet(4, 4, 3, 8, seed=0)
    conv = mgnn.conv_resnet(1, 2, (4, 4), 3, 4, seed=0)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        for name, lowered in (("numba", True), ("numpy", False)):
            bk = get_backend(name)
            for prop in (ForwardPropagator(dense, bk), AdjointPropagator(dense, [], [], bk)):
                with prop.solve_context():
                    assert _most(two_blas_threads) == (1 if lowered else 2), (name, prop)
                assert _most(two_blas_threads) == 2
        with ForwardPropagator(conv, get_backend("numba")).solve_context():
            assert _most(two_blas_threads) == 1
        assert _most(two_blas_threads) == 2
    finally:
        numba.set_num_threads(before)


def test_solver_runs_each_solve_inside_the_propagators_solve_context():
    """MGRITSolver enters ``solve_context()`` around every solve: every step runs inside it,
    and it is left after the solve (also when the solve raises)."""
    import contextlib

    from mgnn.mgrit import MGRITOptions, MGRITSolver

    class Scaling:
        fresh_outputs = True

        def __init__(self):
            self.inside, self.log, self.fail = False, [], False

        @contextlib.contextmanager
        def solve_context(self):
            self.inside = True
            self.log.append("enter")
            try:
                yield
            finally:
                self.inside = False
                self.log.append("exit")

        def step(self, u, start, stop, level):
            assert self.inside, "a step outside the solve context"
            if self.fail:
                raise RuntimeError("step failed")
            return u * 0.5 ** (stop - start)

    prop = Scaling()
    solver = MGRITSolver(prop, 16, MGRITOptions(cf=2, max_levels=2, tol=0.0, max_iter=2))
    res = solver.solve(np.ones(3))
    assert np.allclose(res.final, 0.5 ** 16)
    assert prop.log == ["enter", "exit"] and not prop.inside
    prop.fail = True
    with pytest.raises(RuntimeError, match="step failed"):
        solver.solve(np.ones(3))
    assert prop.log == ["enter", "exit"] * 2 and not prop.inside


def test_restore_threads_makes_apply_threads_set_its_counts_again(two_blas_threads):
    """A configuration applied, then counts put back by restore_threads (the bench's way):
    apply_threads of that configuration must set its BLAS counts again, not trust a record
    of counts that are no longer in effect."""
    from mgnn.comm import apply_threads, configure_threads, restore_threads, snapshot_threads
    saved = snapshot_threads()
    info = configure_threads(None, 1)
    assert _most(two_blas_threads) == 1
    restore_threads(saved)
    assert _most(two_blas_threads) == 2
    apply_threads(info)
    assert _most(two_blas_threads) == 1
    restore_threads(saved)


AVX512 = {"fma", "avx2", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
HASWELL = [("libscipy_openblas.so", "0.3.30", "Haswell", 1)]
SKX = [("libscipy_openblas.so", "0.3.30", "SkylakeX", 1)]


def test_blas_advice_names_a_forced_core_without_avx512_on_an_avx512_cpu():
    from mgnn.backend.blas_threads import blas_advice
    msg = blas_advice(HASWELL, AVX512, {"OPENBLAS_CORETYPE": "Haswell"})
    assert msg is not None and "OPENBLAS_CORETYPE=Haswell" in msg and "Haswell kernels" in msg


@pytest.mark.parametrize("kernels, flags, environ", [
    (HASWELL, AVX512, {}),  # OpenBLAS's own choice: not the user's doing, nothing to advise
    (HASWELL, {"fma", "avx2"}, {"OPENBLAS_CORETYPE": "Haswell"}),  # no AVX-512 to miss
    (SKX, AVX512, {"OPENBLAS_CORETYPE": "SkylakeX"}),
    ([("libmkl_rt.so", "2024", "Haswell", 1)], AVX512, {"OPENBLAS_CORETYPE": "Haswell"}),
])
def test_blas_advice_is_silent_otherwise(kernels, flags, environ):
    from mgnn.backend.blas_threads import blas_advice
    assert blas_advice(kernels, flags, environ) is None


def test_cpu_flags_reads_the_first_cpu(tmp_path):
    from mgnn.backend.blas_threads import cpu_flags
    p = tmp_path / "cpuinfo"
    p.write_text("processor : 0\nflags : fpu avx2 avx512f\n\nprocessor : 1\nflags : fpu\n")
    assert cpu_flags(str(p)) == {"fpu", "avx2", "avx512f"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


def test_blas_kernels_lists_numbas_blas():
    from mgnn.backend.blas_threads import blas_kernels
    kernels = blas_kernels()
    assert any("openblas" in lib.lower() for lib, _, _, _ in kernels), kernels
    assert all(isinstance(arch, str) and arch and n >= 1 for _, _, arch, n in kernels)
