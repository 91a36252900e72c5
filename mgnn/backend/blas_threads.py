"""BLAS thread pools of this process (threadpoolctl), and one BLAS thread inside Numba's
parallel loops.

mgnn's dense kernels call BLAS through ``np.dot`` (Numba: SciPy's ``cython_blas``). Inside a
``prange`` loop every Numba thread makes its own calls, so a BLAS that starts threads of its own
oversubscribes the cores: on 2 cores with OpenBLAS's default 2 threads, a dense MGRIT solve
(N = 256, w = 64, B = 128) whose chains ran in parallel took 180 ms against 12 ms with one BLAS
thread. :func:`one_blas_thread` sets every loaded BLAS to one thread for the duration of such a
call and puts the counts back after, so the parallel drivers are safe whatever the process's
BLAS setting (:func:`mgnn.comm.configure_threads` sets the counts for a whole run).
:func:`solve_blas_context` holds them at one for a whole MGRIT solve, so that the solve's serial
kernel calls do not switch the pools back in between (an uncaptured solve: 40 ms with each
parallel call guarded, 16 ms guarded as a whole).

The counts are process-wide: a count changed inside the context is overwritten on exit, and
two Python threads solving at once may restore the counts while the other is still inside
(slower, never wrong). threadpoolctl is a dependency of mgnn; without it nothing is limited.
"""
import contextlib
import sys

_CONTROLLERS = {}  # the BLAS controllers found at a count of loaded modules (scans are slow)


def blas_controllers(load_numba_blas=False):
    """threadpoolctl controllers of every loaded BLAS (cached until a module is imported; [] if
    threadpoolctl is missing); with ``load_numba_blas`` first load the one Numba's ``np.dot``
    calls (SciPy's ``scipy.linalg.cython_blas``) so it is found too."""
    if load_numba_blas:
        try:
            import scipy.linalg.cython_blas  # noqa: F401
        except ImportError:
            pass
    # a new library comes with a new module (a BLAS loaded through ctypes alone is not seen)
    if _CONTROLLERS.get("modules") != len(sys.modules):
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            found = []
        else:
            found = ThreadpoolController().select(user_api="blas").lib_controllers
        _CONTROLLERS.update(modules=len(sys.modules), blas=found)
    return _CONTROLLERS["blas"]


@contextlib.contextmanager
def one_blas_thread():
    """Context: every loaded BLAS runs one thread inside it; the counts that were higher are
    restored on exit (a few microseconds when every BLAS already has one thread). Numba's BLAS
    (SciPy's, which Numba loads at its first ``np.dot``) is loaded first, so it is limited too."""
    lowered = []
    try:
        for ctl in blas_controllers(True):
            n = ctl.num_threads
            if n > 1:
                ctl.set_num_threads(1)
                lowered.append((ctl, n))
        yield
    finally:
        restore(lowered)


def solve_blas_context(bk, blas_in_threads=True):
    """The context a propagator on backend ``bk`` runs a solve in: :func:`one_blas_thread` when
    its kernels call BLAS from Numba's threads (``blas_in_threads``: the propagator's, e.g. a
    dense stacked solve, and the backend's flag) and Numba has more than one thread now, else
    nothing."""
    if blas_in_threads and getattr(bk, "blas_in_threads", False):
        import numba
        if numba.get_num_threads() > 1:
            return one_blas_thread()
    return contextlib.nullcontext()


def snapshot():
    """The BLAS counts now, for :func:`restore` (every loaded BLAS, Numba's included)."""
    return [(ctl, ctl.num_threads) for ctl in blas_controllers(True)]


def restore(saved):
    """Set the BLAS counts back to a :func:`snapshot`."""
    for ctl, n in saved:
        ctl.set_num_threads(n)
